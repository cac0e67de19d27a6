"""vllm_env: which python runs vLLM here, or the one line saying why none does.

    python -m pytest tests/unit/test_vllm_env.py -q
"""

from __future__ import annotations

import importlib.util
import os
import sys
import types
from pathlib import Path

import pytest

from draftlab.errors import HostError
from draftlab.serve import vllm_env


@pytest.fixture
def no_vllm_here(monkeypatch, tmp_path):
    """This interpreter without vllm, and a checkout whose .venv-vllm does not exist."""
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))
    monkeypatch.delenv(vllm_env.PYTHON_ENV, raising=False)
    monkeypatch.setattr(vllm_env, "VENV", tmp_path / ".venv-vllm")
    return tmp_path / ".venv-vllm"


def test_the_checkouts_vllm_venv_once_installed(no_vllm_here, monkeypatch):
    monkeypatch.setattr(vllm_env, "cpu_lacks_avx2", lambda: False)
    with pytest.raises(vllm_env.VllmMissing, match="run scripts/install-vllm.sh"):
        vllm_env.vllm_python()
    python = no_vllm_here / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text("")
    # a venv whose install did not finish (no stamp) is not taken
    assert "install-vllm.sh" in vllm_env.vllm_unavailable_reason()
    (no_vllm_here / ".draftlab-lock-sha256").write_text("x")
    assert vllm_env.vllm_python() == str(python)
    assert vllm_env.api_server_command() == [str(python), "-m", "vllm.entrypoints.openai.api_server"]


def test_a_cpu_without_avx2_is_named_as_the_reason(no_vllm_here, monkeypatch):
    monkeypatch.setattr(vllm_env, "cpu_lacks_avx2", lambda: True)
    reason = vllm_env.vllm_unavailable_reason()
    assert "no AVX2" in reason and "\n" not in reason
    assert issubclass(vllm_env.VllmMissing, HostError)


def test_a_named_interpreter_wins_and_a_wrong_one_is_one_line(no_vllm_here, monkeypatch, tmp_path):
    monkeypatch.setenv(vllm_env.PYTHON_ENV, sys.executable)
    assert vllm_env.vllm_python() == sys.executable
    monkeypatch.setenv(vllm_env.PYTHON_ENV, str(tmp_path / "nope"))
    with pytest.raises(vllm_env.VllmMissing, match="DRAFTLAB_VLLM_PYTHON=.*nope: no such interpreter"):
        vllm_env.vllm_python()


def test_vllm_beside_draftlab_is_this_interpreter(monkeypatch):
    """The GPU image: vllm is installed in draftlab's own environment."""
    real = importlib.util.find_spec
    monkeypatch.delenv(vllm_env.PYTHON_ENV, raising=False)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: types.SimpleNamespace(origin="/site-packages/vllm/__init__.py") if name == "vllm" else real(name, *a))
    assert vllm_env.vllm_python() == sys.executable


def test_a_folder_named_vllm_in_the_cwd_is_not_vllm(monkeypatch, tmp_path):
    """A store written to ./vllm is a namespace package to `find_spec`: not an installed vLLM."""
    (tmp_path / "vllm").mkdir()
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv(vllm_env.PYTHON_ENV, raising=False)
    monkeypatch.setattr(vllm_env, "VENV", tmp_path / ".venv-vllm")
    with pytest.raises(vllm_env.VllmMissing):
        vllm_env.vllm_python()


def _cpu_has_amx() -> bool:
    try:
        return "amx_tile" in Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False


def test_a_vllm_servers_processes_may_use_amx_and_keep_the_sitecustomize_they_had(tmp_path):
    """vLLM's CPU attention runs AMX where the CPU has it without asking the kernel first, and its
    worker dies of SIGILL: every process started with server_env() holds the permission, and a
    sitecustomize the environment already had still runs."""
    import subprocess

    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "sitecustomize.py").write_text("import os\nopen(os.environ['MARK'], 'w').write('ran')\n")
    base = {"PATH": os.environ["PATH"], "PYTHONPATH": str(theirs), "MARK": str(tmp_path / "mark")}
    probe = ("import ctypes; m = ctypes.c_ulong(); ctypes.CDLL(None).syscall(158, 0x1022, ctypes.byref(m)); "
             "print(m.value >> 18 & 1)")  # ARCH_GET_XCOMP_PERM: is XTILEDATA permitted?

    def amx_permitted(env) -> str:
        return subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True,
                              check=True).stdout.strip()

    served = amx_permitted(vllm_env.server_env(base))
    assert (tmp_path / "mark").read_text() == "ran"
    assert vllm_env.server_env(base)["PYTHONPATH"].split(os.pathsep) == [str(vllm_env.BOOT), str(theirs)]
    if _cpu_has_amx() and os.uname().machine == "x86_64":
        assert amx_permitted(base) == "0"  # a plain interpreter has not asked
        assert served == "1"
