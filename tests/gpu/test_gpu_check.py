"""The GPU host check for real (`scripts/gpu-check.sh`): skipped without CUDA; CI stays CPU-only.

    pytest -m gpu tests/gpu
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

REPO = Path(__file__).resolve().parents[2]


def test_gpu_check_passes_on_this_host(tmp_path):
    out = subprocess.run([str(REPO / "scripts" / "gpu-check.sh"), "--out", str(tmp_path / "check.json")],
                         env=dict(os.environ, PYTHON=sys.executable), capture_output=True, text=True, timeout=420)
    steps = {s["name"]: s for s in json.loads((tmp_path / "check.json").read_text())["steps"]}
    assert out.returncode == 0, out.stdout[-3000:]
    assert steps["pipeline"]["status"] == "pass" and steps["extract"]["status"] == "pass"
    two = torch.cuda.device_count() >= 2
    for name in ("ddp", "fsdp"):
        assert steps[name]["status"] == ("pass" if two else "skip"), steps[name]
