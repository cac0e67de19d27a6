"""`draftlab.guard`: a command's whole process group dies with draftlab — kill -9 included — even
children that do not watch their parent (vLLM's engine core and workers)."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

# draftlab's role: spawn the guarded command (procs.spawn, own session), write its pid, wait
OWNER = textwrap.dedent('''
    import sys, time
    from draftlab import procs
    from draftlab.store.vllm_extract import guard_command
    proc = procs.spawn(guard_command([sys.executable, sys.argv[1], sys.argv[2]]))
    time.sleep(600)
''')
# the server's role: a child in its group that ignores SIGTERM and outlives its parent
SERVER = textwrap.dedent('''
    import json, signal, subprocess, sys, time
    child = subprocess.Popen([sys.executable, "-c",
                              "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"])
    open(sys.argv[1], "w").write(json.dumps([__import__("os").getpid(), child.pid]))
    time.sleep(600)
''')


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def test_kill_9_of_the_owner_stops_the_whole_group(tmp_path):
    server = tmp_path / "server.py"
    server.write_text(SERVER)
    pids_file = tmp_path / "pids.json"
    owner = subprocess.Popen([sys.executable, "-c", OWNER, str(server), str(pids_file)])
    deadline = time.monotonic() + 60
    while not pids_file.exists() or not pids_file.read_text():
        assert time.monotonic() < deadline and owner.poll() is None
        time.sleep(0.05)
    time.sleep(0.2)
    pids = json.loads(pids_file.read_text())
    assert all(_alive(p) for p in pids)
    os.kill(owner.pid, signal.SIGKILL)
    owner.wait()
    deadline = time.monotonic() + 30  # SIGTERM, then SIGKILL after the guard's grace (10 s)
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(p) for p in pids), "the server and the child that ignores SIGTERM are gone"
