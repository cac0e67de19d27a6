"""gpu-check inside draftlab's images: in the GPU image its first step is the image's import check
(torch, vllm, flash_attn, speculators, transformers; sm_120 kernels); in the CPU image that step
is skipped with its reason. CPU only: `python -m pytest tests/unit/test_gpucheck_image.py -q`.
(The check's child-process run inside the GPU image is exercised by scripts/gpu-check.sh there.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from draftlab.gpucheck import check, steps


def test_import_check_names_what_the_cpu_venv_lacks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert {"torch", "vllm", "flash_attn", "speculators", "transformers"} <= set(steps.IMAGE_IMPORTS)
    # speculators and transformers import here too, but slowly: torch stands for what does
    monkeypatch.setattr(steps, "IMAGE_IMPORTS", ("torch", "vllm", "flash_attn"))
    result = steps.run_one("image", tmp_path)
    assert result["status"] == "fail"
    assert "vllm:" in result["reason"] and "flash_attn:" in result["reason"]
    assert "torch:" not in result["reason"]


def test_import_check_requires_sm_120(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    monkeypatch.setattr(steps, "IMAGE_IMPORTS", ("torch",))  # what imports here; the GPU stack does not
    monkeypatch.setattr(torch.cuda, "get_arch_list", lambda: ["sm_90"])
    assert "no sm_120" in steps.image_imports(tmp_path)["reason"]
    monkeypatch.setattr(torch.cuda, "get_arch_list", lambda: ["sm_90", "sm_120"])
    assert steps.image_imports(tmp_path)["status"] == "pass"


def test_cpu_image_skips_every_step_with_a_reason(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DRAFTLAB_IMAGE", "cpu")
    out = tmp_path / "gpu-check.json"
    assert check.main(["--out", str(out)]) == 4  # no CUDA device here
    report = json.loads(out.read_text())
    names = [s["name"] for s in report["steps"]]
    assert names[0] == "image" and names[1] == "host"
    assert all(s["status"] == "skip" and s["reason"] for s in report["steps"])
