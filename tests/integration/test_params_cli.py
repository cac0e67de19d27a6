"""draftlab as a process on bad params: one line, exit 2, outputs kept."""

import subprocess
import sys

import yaml

def test_cli_bad_params_exit_2_one_line_and_outputs_kept(tmp_path):
    """The CLI answers a params error with exit code 2 and one line, and deletes nothing."""
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump({"prepare": {"num_sample": 3}}))
    out = tmp_path / "prepared"
    out.mkdir()
    (out / "precious").write_text("hours of work")
    proc = subprocess.run(
        [sys.executable, "-m", "draftlab.cli", "prepare", "--params", str(path), "--out", str(out)],
        capture_output=True, text=True, cwd=tmp_path,
    )
    assert proc.returncode == 2
    lines = [l for l in proc.stderr.splitlines() if l.strip()]
    assert len(lines) == 1, proc.stderr
    assert "prepare.num_sample" in lines[0] and "prepare.num_samples" in lines[0]
    assert "Traceback" not in proc.stderr
    assert (out / "precious").read_text() == "hours of work"
