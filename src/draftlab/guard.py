"""A command whose whole process group dies with draftlab: `python -m draftlab.guard --parent PID -- CMD…`.

Why: `procs.spawn` gives its child SIGKILL when draftlab dies, but not the child's own children.
vLLM's API server starts its engine core and workers as children that do not watch their
parent: after a kill -9 of `draftlab extract` they kept running (and holding the CPU or GPU)
under new titles (`VLLM::EngineCore`). The guard is the group leader (spawned in a session of
its own); it asks for SIGTERM when draftlab dies, runs CMD in its group, and when draftlab dies,
when it is told to stop, or when CMD ends, it stops every other member of its group: SIGTERM,
then SIGKILL after `--grace-s`. Its exit code is CMD's.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import subprocess
import sys
import time

PR_SET_PDEATHSIG = 1


def _members() -> list[int]:
    """Live processes of this process group other than this one."""
    me, group, out = os.getpid(), os.getpgrp(), []
    for name in os.listdir("/proc"):
        if name.isdigit() and int(name) != me:
            try:
                fields = open(f"/proc/{name}/stat").read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == group and fields[0] not in ("Z", "X"):
                out.append(int(name))
    return out


def stop_group(grace_s: float) -> None:
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        for pid in _members():
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait_s
        while _members() and time.monotonic() < deadline:
            try:
                os.waitpid(-1, os.WNOHANG)  # reap our own child, so it stops counting
            except ChildProcessError:
                pass
            time.sleep(0.1)
        if not _members():
            return


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m draftlab.guard")
    ap.add_argument("--parent", type=int, required=True, help="the pid whose death stops the group")
    ap.add_argument("--grace-s", type=float, default=10.0)
    ap.add_argument("cmd", nargs=argparse.REMAINDER)
    args = ap.parse_args()
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd

    def stop(signum, frame):
        stop_group(args.grace_s)
        os._exit(128 + signum)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, stop)
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    if os.getppid() != args.parent:  # draftlab died before the request above
        sys.exit(137)
    rc = subprocess.call(cmd)
    stop_group(args.grace_s)
    sys.exit(rc)


if __name__ == "__main__":
    main()
