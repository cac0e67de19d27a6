"""One job per folder: an exclusive lock on a file *beside* the folder a job writes.

The lock file sits next to the folder (`runs/.train.lock` for `runs/train`), never inside it:
a job may move its folder aside (params changed) or replace it, and a lock that moved with the
folder would let a second job lock the fresh one while the first still writes. It is taken
before anything in the folder is moved, written or deleted, and records the holder's pid and
host, so a second job is refused in one line naming them. The lock is a `flock`: the kernel
drops it when its holder dies (kill -9 included), so a stale file never blocks anyone.

    with folder_lock.hold(Path("runs/train"), "draftlab train"):
        ...  # only this process writes runs/train
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from draftlab.errors import HostError


def lock_path(folder: Path, suffix: str = "") -> Path:
    """The lock file of `folder`: `.<name>.lock<suffix>` in its parent."""
    folder = Path(folder)
    return folder.parent / f".{folder.name}.lock{suffix}"


def holder(lock: Path) -> str:
    """Who holds `lock`, as its file says: 'pid N on HOST' (or 'a process' when it cannot tell)."""
    try:
        rec = json.loads(Path(lock).read_text())
        return f"pid {int(rec['pid'])} on {rec['host']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "a process"  # the holder has not written its name yet, or an older draftlab holds it


_HELD: dict[Path, int] = {}  # locks this process holds, and how many `hold` blocks hold each


@contextmanager
def hold(folder: Path, what: str, suffix: str = "", *, reentrant: bool = False) -> Iterator[Path]:
    """Hold `folder`'s lock for the block, or raise HostError naming the holder's pid and host.
    Yields the lock file's path. `reentrant`: a block of this process that holds it already (the
    CLI and the stage it calls) goes on; otherwise a second hold is refused like another process."""
    lock = lock_path(folder, suffix).absolute()
    if reentrant and lock in _HELD:
        _HELD[lock] += 1
        try:
            yield lock
        finally:
            _HELD[lock] -= 1
        return
    lock.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(lock, os.O_CREAT | os.O_RDWR, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise HostError(f"{folder}: another `{what}` ({holder(lock)}) is writing this folder; "
                        f"wait for it to end or stop it, or give this one another folder") from None
    _HELD[lock] = _HELD.get(lock, 0) + 1
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps({"pid": os.getpid(), "host": socket.gethostname()}) + "\n").encode(), 0)
        yield lock
    finally:
        _HELD[lock] -= 1
        if not _HELD[lock]:
            del _HELD[lock]
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def held(folder: Path, suffix: str = "") -> bool:
    """Whether some open file holds `folder`'s lock (this process's own `hold` counts too)."""
    lock = lock_path(folder, suffix)
    if not lock.exists():
        return False
    fd = os.open(lock, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
