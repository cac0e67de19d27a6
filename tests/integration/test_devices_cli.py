"""draftlab extract with a device the host lacks: one line, exit 2, nothing written."""

import subprocess
import sys

import yaml


def test_cli_extract_on_cuda_without_cuda_exits_2_and_writes_nothing(tmp_path):
    (tmp_path / "params.yaml").write_text(yaml.safe_dump({"extract": {"device": "cuda"}}))
    out = subprocess.run([sys.executable, "-m", "draftlab.cli", "extract", "--params", "params.yaml",
                          "--out", "store"], cwd=tmp_path, capture_output=True, text=True,
                         env={"CUDA_VISIBLE_DEVICES": "", "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})
    assert out.returncode == 2, out.stderr
    lines = (out.stdout + out.stderr).strip().splitlines()
    assert len(lines) == 1 and "extract.device: cuda asked" in lines[0]
    assert not (tmp_path / "store").exists() and not (tmp_path / "mlflow.db").exists()
