"""A record of every vLLM server draftlab starts, so that one a killed draftlab left running is
found and stopped by the next run.

Why: vLLM's API server runs its engine in child processes (`VLLM::EngineCore`, and
`VLLM::Worker` where the model runs in processes of its own).
The API server itself dies with draftlab (`procs.spawn`'s parent-death signal), but after a
`kill -9` of draftlab its engine processes stay, holding the model's memory. Each server draftlab
starts gets a file in the records folder (`DRAFTLAB_STATE_DIR`, default
`$XDG_STATE_HOME/draftlab` or `~/.local/state/draftlab`, then `vllm-servers/`): its process group,
the start time of its leader, and the draftlab process that owns it. `stop_orphans()` (called
before every server start) stops each recorded group whose owner is gone. It never touches a
group that is not the recorded one: a pid reused by another process has another start time, and
Linux hands out no pid still used as a process group id.

    python -m draftlab.serve.orphans     # stop what killed runs left, print what was stopped
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from pathlib import Path

from draftlab import procs


def records_dir() -> Path:
    base = os.environ.get("DRAFTLAB_STATE_DIR") or Path(
        os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state") / "draftlab"
    return Path(base) / "vllm-servers"


def _same_process(pid: int, start: int | None) -> bool:
    return start is not None and procs._start_ticks(pid) == start and not procs._zombie(pid)


def record(pgid: int, *, port: int, what: str, log_path: Path, rpc_dir: str | None = None) -> Path:
    """Note a server just started (its leader's pid is its process group id); returns the file.
    `rpc_dir`: the server's own folder for vLLM's sockets, removed once the group is stopped."""
    folder = records_dir()
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    path = folder / f"{pgid}.json"
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps({"pgid": pgid, "leader_start": procs._start_ticks(pgid), "port": port,
                               "what": what, "log": str(log_path), "rpc_dir": rpc_dir, "owner_pid": os.getpid(),
                               "owner_start": procs._start_ticks(os.getpid())}))
    os.replace(tmp, path)
    return path


def forget(path: Path) -> None:
    path.unlink(missing_ok=True)


def _orphaned(rec: dict) -> bool:
    """The recorded group still runs and its owner does not."""
    if _same_process(rec["owner_pid"], rec.get("owner_start")):
        return False  # a live draftlab owns it (this run or another)
    pgid = rec["pgid"]
    if procs._start_ticks(pgid) is not None and not _same_process(pgid, rec.get("leader_start")):
        if not procs._zombie(pgid):
            return False  # that pid is another process now: the group is not ours
    return procs.group_alive(pgid)


def stop_orphans(grace_s: float = 10.0) -> list[dict]:
    """SIGTERM, then SIGKILL, to every recorded server group whose owner died; their records
    are removed, as are those of groups already gone. Returns the records of the groups stopped."""
    stopped = []
    for path in sorted(records_dir().glob("*.json")):
        try:
            rec = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if _same_process(rec.get("owner_pid", -1), rec.get("owner_start")):
            continue
        if _orphaned(rec):
            pgid = rec["pgid"]
            for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, grace_s)):
                try:
                    os.killpg(pgid, sig)
                except (ProcessLookupError, PermissionError):
                    break
                deadline = time.monotonic() + wait_s
                while procs.group_alive(pgid) and time.monotonic() < deadline:
                    time.sleep(0.1)
                if not procs.group_alive(pgid):
                    break
            stopped.append(rec)
        if rec.get("rpc_dir") and not procs.group_alive(rec["pgid"]):
            shutil.rmtree(rec["rpc_dir"], ignore_errors=True)
        forget(path)
    return stopped


if __name__ == "__main__":
    for rec in stop_orphans():
        print(f"stopped vLLM ({rec['what']}) process group {rec['pgid']} on port {rec['port']}")
