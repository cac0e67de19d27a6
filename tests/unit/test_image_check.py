"""scripts/image-check.sh refuses bad input with one line and exit 2 before it builds anything, and
a host without podman gets one line saying what to install (exit 3). The check itself (a build and
`dvc repro` in the image) runs from .ci/run; these are its refusals, which take seconds.

    python -m pytest tests/unit/test_image_check.py -q
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "image-check.sh"
needs_podman = pytest.mark.skipif(not (shutil.which("podman") and shutil.which("runc")),
                                  reason="podman and runc absent (Debian: apt-get install podman runc)")
needs_venv = pytest.mark.skipif(not (ROOT / ".venv" / "bin" / "python").exists(),
                                reason="no .venv here (scripts/install.sh makes it)")


def image_check(tmp_path: Path, *args: str, path: str | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "DRAFTLAB_IMAGE_CACHE": str(tmp_path / "cache")}
    if path is not None:
        env["PATH"] = path
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, env=env, timeout=120,
                          check=False)


def refused(proc: subprocess.CompletedProcess, code: int, *words: str) -> None:
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == code, (proc.returncode, proc.stdout, proc.stderr)
    assert len(lines) == 1, f"not one line: {proc.stderr!r}"
    for word in words:
        assert word in lines[0], lines[0]


@pytest.mark.parametrize(("args", "words"), [
    (("--target", "tpu"), ("unknown target 'tpu'",)),
    (("--target", "gpu"), ("--target gpu", "GPU host")),
    (("--uid", "1000"), ("--uid 1000", "image's default 1000")),
    (("--uid", "0"), ("--uid 0",)),
    (("--frobnicate",), ("unknown argument --frobnicate",)),
])
def test_bad_arguments_are_one_line_and_exit_2(tmp_path, args, words):
    refused(image_check(tmp_path, *args), 2, *words)
    assert not (tmp_path / "cache").exists(), "a refused check made its cache"


@needs_podman
@needs_venv
def test_a_base_podman_does_not_have_is_refused(tmp_path):
    refused(image_check(tmp_path, "--base", "localhost/draftlab-no-such-base:none"), 2,
            "--base localhost/draftlab-no-such-base:none", "podman images")


@needs_podman
@needs_venv
def test_a_wheelhouse_missing_a_pin_names_it_before_any_base_is_made(tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    (wheels / "six-1.0.0-py2.py3-none-any.whl").write_bytes(b"")  # not a pin of cpu.txt
    proc = image_check(tmp_path, "--wheelhouse", str(wheels))
    pins = [line.split(" ")[0] for line in (ROOT / "requirements" / "cpu.txt").read_text().splitlines()
            if "==" in line and not line.startswith((" ", "#"))]
    refused(proc, 2, f"the wheelhouse {wheels} lacks", pins[0], "requirements/cpu.txt")
    assert "mmdebstrap" not in proc.stdout + proc.stderr, "a base was made before the wheelhouse was checked"
    assert not list((tmp_path / "cache").glob("base-*")), "a base was cached"


def test_without_podman_one_line_says_what_to_install(tmp_path):
    bin_dir = tmp_path / "bin"  # the script's first commands, and no podman
    bin_dir.mkdir()
    for tool in ("bash", "dirname"):
        (bin_dir / tool).symlink_to(shutil.which(tool))
    proc = image_check(tmp_path, path=str(bin_dir))
    refused(proc, 3, "podman and runc not found", "apt-get install podman runc mmdebstrap")


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
