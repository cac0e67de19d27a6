"""One hidden-state file's tensors and its atomic write, as vLLM's CPU connector (`vllm_connector`,
inside the vLLM server) writes them. Imports torch and safetensors only: the vLLM venv has no
hs_connectors, so fp8 restates its `quantize_tensor_to_fp8` (one fp32 scale per token over every
layer and feature, clamped at 1e-12), and a unit test holds the two equal, so that hs_connectors'
`FP8Transfer` (speculators' fp8 reader) dequantizes what is written here.

Legend: T tokens, L the 4 layers (3 aux + the final one, pre-norm), H hidden size.
"""

from __future__ import annotations

import os

import torch
from safetensors.torch import save_file

SCALES_KEY = "hidden_states_scales"
FP8 = "float8_e4m3fn"


def quantize_fp8(hidden_TLH: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """hs_connectors.fp8_utils.quantize_tensor_to_fp8, restated (the vLLM venv has no hs_connectors):
    scale = amax over a token's layers and features / fp8 max, clamped at 1e-12."""
    fp8 = torch.float8_e4m3fn
    fp32 = hidden_TLH.float()
    amax_T11 = fp32.abs().amax(dim=tuple(range(1, fp32.dim())), keepdim=True)
    scale_T11 = (amax_T11 / torch.finfo(fp8).max).clamp(min=1e-12)
    return (fp32 / scale_T11).to(fp8), scale_T11


def sample_tensors(hidden_TLH: torch.Tensor, token_ids: torch.Tensor, dtype: str | None) -> dict[str, torch.Tensor]:
    """One file's tensors in `dtype` (None: the cache's own dtype, as upstream writes)."""
    if dtype == FP8:
        fp8_TLH, scale_T11 = quantize_fp8(hidden_TLH)
        return {"hidden_states": fp8_TLH, SCALES_KEY: scale_T11, "token_ids": token_ids}
    hidden = hidden_TLH if dtype is None else hidden_TLH.to(getattr(torch, dtype))
    return {"hidden_states": hidden.contiguous(), "token_ids": token_ids}


def write_atomic(tensors: dict[str, torch.Tensor], filename: str) -> None:
    """A reader never sees a half-written file at `filename`, even after a kill -9."""
    tmp = f"{filename}.tmp-{os.getpid()}"
    save_file(tensors, tmp)
    os.replace(tmp, filename)
