"""Children started with `procs.spawn` die with their owner, even by SIGKILL, even when the
thread that asked for them has ended; recorded pids are stopped, reused pids are not."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from draftlab import procs

# An owner that spawns a long sleeper (from a short-lived thread when asked), prints its pid, waits.
OWNER = textwrap.dedent('''
    import sys, threading, time
    from draftlab import procs
    box = []
    start = lambda: box.append(procs.spawn([sys.executable, "-c", "import time; time.sleep(120)"]))
    if sys.argv[1] == "thread":
        t = threading.Thread(target=start); t.start(); t.join()  # the asking thread is gone
    else:
        start()
    print(box[0].pid, flush=True)
    time.sleep(120)
''')


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def _wait_gone(pid: int, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not _alive(pid)


@pytest.mark.parametrize("where", ["main", "thread"])
def test_a_child_dies_when_its_owner_is_killed_with_sigkill(where):
    owner = subprocess.Popen([sys.executable, "-c", OWNER, where], stdout=subprocess.PIPE, text=True)
    child = int(owner.stdout.readline())
    time.sleep(0.5)
    assert _alive(child), "the child outlives the thread that asked for it, while its owner runs"
    owner.kill()
    owner.wait()
    assert _wait_gone(child), "the child outlived its SIGKILLed owner"


def test_a_child_whose_parent_died_before_the_request_exits_at_once(tmp_path):
    # DRAFTLAB_PARENT_CMD names the expected parent; a child adopted by someone else exits
    env = dict(os.environ, DRAFTLAB_PARENT_CMD="no-such-parent-command")
    code = "from draftlab import procs; procs.die_with_parent(); print('still here')"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 137 and "still here" not in out.stdout
    env["DRAFTLAB_PARENT_CMD"] = ""  # no expectation: it carries on
    assert "still here" in subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True).stdout


def test_spawn_gives_the_child_its_own_session():
    proc = procs.spawn([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert os.getsid(proc.pid) == proc.pid != os.getsid(0)
    finally:
        proc.kill()
        proc.wait()


def test_recorded_pids_are_stopped_and_reused_pids_are_left_alone(tmp_path):
    code = "import sys, time; from draftlab import procs; procs.record_self(sys.argv[1], 'rank0'); print(1, flush=True); time.sleep(60)"
    rank = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    rank.stdout.readline()
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        # a stale record whose pid now belongs to another process (a different start time)
        (tmp_path / "pids" / "rank1.json").write_text(json.dumps({"pid": bystander.pid, "start": 1}))
        assert procs.recorded_alive(tmp_path) == [rank.pid]
        assert procs.kill_recorded(tmp_path) == [rank.pid]
        assert rank.wait(timeout=10) == -signal.SIGKILL
        assert bystander.poll() is None, "a pid reused by another process is not signalled"
    finally:
        bystander.kill()
        bystander.wait()
        rank.kill()
        rank.wait()
