"""Child processes that die with their owner: the one way draftlab starts long-lived processes
(torchrun, its ranks, sweep trials, extraction ranks, vLLM servers).

Why: torch's elastic launcher starts every rank in a session of its own, so a signal to a process
group never reaches them, and a SIGKILLed launcher leaves them running (retrying a dead TCPStore
for 30 min, holding GPU memory). So each child asks the kernel for SIGKILL when its parent dies
(`PR_SET_PDEATHSIG`; SIGKILL, not SIGTERM, because speculators turns SIGTERM into a checkpoint
attempt of up to 120 s), then checks that the parent is still the one that started it (it may
have died before the request). The signal fires when the *thread* that forked the child exits, so
`spawn` forks from the main thread or from one long-lived spawner thread, never from a worker
thread that ends early. Ranks also record their pid in the run folder (`record_self`), so a
rerun or the sweep's reaper can stop them by pid (`kill_recorded`), not only by process group.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import queue
import signal
import subprocess
import threading
import time
from pathlib import Path

from draftlab.rundir import RunDir

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36


_libc = None


def _prctl_fn():
    """libc's prctl, looked up once in the parent: a child between fork and exec must not
    dlopen (another thread may have held the loader's lock at the fork)."""
    global _libc
    if _libc is None:
        try:
            _libc = ctypes.CDLL(None, use_errno=True).prctl
        except (OSError, AttributeError):  # not Linux: nothing to ask for
            _libc = False
    return _libc


def _prctl(option: int, value: int) -> bool:
    fn = _prctl_fn()
    return bool(fn) and fn(option, value, 0, 0, 0) == 0


def die_with_parent(expected_parent: int | None = None) -> None:
    """SIGKILL this process when its parent dies; exit now if it is already gone.

    `expected_parent`: the pid that started us (known when forking). None: the parent must not
    be init or a subreaper that adopted us, which we tell by the parent having changed from the
    process named in DRAFTLAB_PARENT_CMD (a substring of its command line)."""
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    parent = os.getppid()
    if expected_parent is not None:
        if parent != expected_parent:
            os._exit(137)
        return
    marker = os.environ.get("DRAFTLAB_PARENT_CMD")
    if marker and marker not in _cmdline(parent):
        os._exit(137)


def make_subreaper() -> bool:
    """Orphans of our descendants re-parent to us instead of init (the test suite's leak check)."""
    return _prctl(PR_SET_CHILD_SUBREAPER, 1)


def _preexec(parent: int):
    def fn():
        die_with_parent(parent)

    return fn


class _Spawner:
    """One daemon thread that forks children for callers on short-lived threads."""

    def __init__(self):
        self.jobs: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=self._work, name="draftlab-spawner", daemon=True)
        self.thread.start()

    def _work(self):
        while True:
            fn, box, done = self.jobs.get()
            try:
                box.append(fn())
            except BaseException as err:  # noqa: BLE001 — re-raised in the caller
                box.append(err)
            done.set()

    def call(self, fn):
        box: list = []
        done = threading.Event()
        self.jobs.put((fn, box, done))
        done.wait()
        if isinstance(box[0], BaseException):
            raise box[0]
        return box[0]


_spawner: _Spawner | None = None
_spawner_lock = threading.Lock()


def spawn(cmd: list[str], *, env: dict | None = None, new_session: bool = True, **popen_kwargs) -> subprocess.Popen:
    """`subprocess.Popen` whose child gets SIGKILL when this process dies, in a session (and
    process group) of its own unless `new_session=False`. Forked from a thread that lives as
    long as this process. Extra keyword arguments go to Popen (stdout, cwd, …)."""
    global _spawner

    _prctl_fn()

    def start():
        return subprocess.Popen(cmd, env=env, start_new_session=new_session, preexec_fn=_preexec(os.getpid()),
                                **popen_kwargs)

    if threading.current_thread() is threading.main_thread():
        return start()
    with _spawner_lock:
        if _spawner is None:
            _spawner = _Spawner()
    return _spawner.call(start)


def run_group(cmd: list[str], *, env: dict | None = None, on_start=None) -> int:
    """Run `cmd` through `spawn` (a process group of its own), call `on_start(proc)` once it has
    started, and wait for it. Ctrl-C sends the whole group SIGTERM and waits for it. Returns
    the exit code."""
    proc = spawn(cmd, env=env)
    if on_start is not None:
        on_start(proc)
    return wait_group(proc)


def wait_group(proc: subprocess.Popen) -> int:
    """Wait for a process `spawn` started in a group of its own; Ctrl-C sends the whole group
    SIGTERM and waits for it. Returns the exit code."""
    try:
        return proc.wait()
    except KeyboardInterrupt:
        os.killpg(proc.pid, signal.SIGTERM)
        return proc.wait()


def stop_group(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    """SIGTERM to the group of a process `spawn` started, SIGKILL after `grace_s`; waits for it."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


# ---------------------------------------------------------------- pids recorded in a run folder


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _start_ticks(pid: int) -> int | None:
    """The process's start time (clock ticks since boot): tells a live pid from a reused one."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def record_self(run_dir: Path, name: str) -> Path:
    """Write this process's pid (and start time) to `run_dir/pids/<name>.json`."""
    path = RunDir(run_dir).pids_dir / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps({"pid": os.getpid(), "start": _start_ticks(os.getpid())}))
    os.replace(tmp, path)
    return path


def recorded_alive(run_dir: Path) -> list[int]:
    """Pids recorded in `run_dir/pids/` that still run the process that recorded them."""
    alive = []
    for path in sorted(RunDir(run_dir).pids_dir.glob("*.json")):
        try:
            rec = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if rec.get("start") is not None and _start_ticks(rec["pid"]) == rec["start"] and not _zombie(rec["pid"]):
            alive.append(rec["pid"])
    return alive


def group_alive(pgid: int) -> bool:
    """Whether a process of the group still runs. Zombies do not count: they hold no memory, and
    under a parent that does not reap (a container's PID 1, a test runner) they linger."""
    proc = Path("/proc")
    if not proc.is_dir():
        try:
            os.killpg(pgid, 0)
            return True
        except (ProcessLookupError, PermissionError):
            return False
    for stat in proc.glob("[0-9]*/stat"):
        try:
            state, _ppid, pgrp = stat.read_text().rsplit(")", 1)[1].split()[:3]
        except (OSError, ValueError):
            continue
        if int(pgrp) == pgid and state not in ("Z", "X"):
            return True
    return False


def gone(pid: int) -> bool:
    """No process runs as `pid`: none has it, or only a zombie (exited, and its parent may never reap it)."""
    if not Path("/proc").is_dir():
        try:
            os.kill(pid, 0)
            return False
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
    return _zombie(pid)


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (OSError, IndexError):
        return True


def kill_recorded(run_dir: Path, sig: int = signal.SIGKILL, wait_s: float = 5.0) -> list[int]:
    """Signal every live recorded pid of `run_dir`; wait up to `wait_s` for them to go. Returns
    the pids signalled."""
    pids = recorded_alive(run_dir)
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass
    deadline = time.monotonic() + wait_s
    while pids and recorded_alive(run_dir) and time.monotonic() < deadline:
        time.sleep(0.1)
    return pids


def clear_recorded(run_dir: Path) -> None:
    for path in RunDir(run_dir).pids_dir.glob("*.json"):
        path.unlink(missing_ok=True)
