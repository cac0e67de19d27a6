"""Where a stage runs its target: `device: auto|cpu|cuda` of `prepare`, `extract` and `evaluate`
resolved against this host, the compute dtype that goes with it, and whether a target fits one GPU.

On CUDA the target computes under bf16 autocast; on CPU it runs exactly as before (its own dtype,
no autocast), so CPU outputs are byte-identical to those of earlier versions. The resolved
device and compute dtype are recorded in each stage's outputs and keys: the same params on
another host do not produce the same bytes, and must not be mistaken for the same data.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

from draftlab.params import ParamsError

GPU_FIT_FRAC = 0.8  # weights above this share of one GPU's memory leave too little for activations


@dataclass(frozen=True)
class Placement:
    device: str  # "cpu" or "cuda"
    compute_dtype: str  # the dtype matmuls run in: the target's on CPU, bfloat16 (autocast) on CUDA

    def record(self) -> dict:
        return {"device": self.device, "compute_dtype": self.compute_dtype}


def cuda_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def resolve(key: str, asked: str, target_dtype: str) -> Placement:
    """`key` is the dotted params key (`extract.device`) named in the error."""
    count = cuda_count()
    if asked == "cuda" and count == 0:
        raise ParamsError(f"{key}: cuda asked but no CUDA device is visible here; set {key}: auto or cpu, "
                          "or run on a GPU host")
    return on("cuda" if asked == "cuda" or (asked == "auto" and count > 0) else "cpu", target_dtype)


def on(device: str, target_dtype: str) -> Placement:
    return Placement(device, "bfloat16" if device == "cuda" else target_dtype)


def autocast(placement: Placement):
    """bf16 autocast on CUDA; nothing on CPU (the path stays what it always was)."""
    if placement.device != "cuda":
        return contextlib.nullcontext()
    import torch

    return torch.autocast("cuda", dtype=torch.bfloat16)


def check_gpus(key: str, asked: int) -> None:
    visible = cuda_count()
    if asked > visible:
        raise ParamsError(f"{key}: {asked} GPU processes asked but {visible} CUDA device(s) are visible; "
                          f"lower {key} or set CUDA_VISIBLE_DEVICES")


def weight_bytes(model_dir: str) -> int | None:
    """The target's weight files on disk (a good estimate of its memory in its saved dtype)."""
    from pathlib import Path

    path = Path(model_dir)
    if not path.is_dir():
        return None
    return sum(p.stat().st_size for p in path.iterdir() if p.suffix in (".safetensors", ".bin"))


def fits_one_gpu(model_bytes: int | None) -> bool:
    import torch

    if model_bytes is None or not torch.cuda.is_available():
        return True
    return model_bytes <= GPU_FIT_FRAC * torch.cuda.get_device_properties(0).total_memory


def device_tags(device: str) -> dict[str, str]:
    import platform

    tags = {"host": platform.node(), "device.type": device}
    if device == "cuda":
        import torch

        tags["device.model"] = torch.cuda.get_device_name(0)
        tags["device.count"] = str(torch.cuda.device_count())
    else:
        tags["device.model"] = platform.processor() or platform.machine()
        tags["device.count"] = str(os.cpu_count())
    return tags
