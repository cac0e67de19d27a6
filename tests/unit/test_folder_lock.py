"""draftlab.folder_lock: one job per folder, the second refused in one line naming the first's pid
and host; the lock lies beside the folder, so moving the folder aside never frees it."""

import os
import socket
import subprocess
import sys
import time

import pytest

from draftlab import folder_lock
from draftlab.errors import HostError

HOLDER = """
import sys, time
from pathlib import Path
from draftlab import folder_lock
with folder_lock.hold(Path(sys.argv[1]), "draftlab train"):
    Path(sys.argv[2]).write_text("held")
    time.sleep(600)
"""


@pytest.fixture
def other_process(tmp_path):
    """A second real process holding `tmp_path / "run"`'s lock; killed at the end."""
    ready = tmp_path / "ready"
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path / "run"), str(ready)])
    deadline = time.monotonic() + 60
    while not ready.exists():
        assert proc.poll() is None and time.monotonic() < deadline, "the holder did not take the lock"
        time.sleep(0.02)
    yield proc
    proc.kill()
    proc.wait()


def test_a_second_process_is_refused_with_the_holders_pid_and_host(tmp_path, other_process):
    with pytest.raises(HostError) as err:
        with folder_lock.hold(tmp_path / "run", "draftlab train"):
            pass
    line = str(err.value)
    assert "\n" not in line and f"(pid {other_process.pid} on {socket.gethostname()})" in line
    assert "another `draftlab train`" in line and err.value.exit_code == 2
    assert folder_lock.held(tmp_path / "run")


def test_the_lock_is_beside_the_folder_so_moving_the_folder_keeps_it(tmp_path, other_process):
    run = tmp_path / "run"
    assert folder_lock.lock_path(run) == tmp_path / ".run.lock"
    run.mkdir(exist_ok=True)
    run.rename(tmp_path / "aside")  # what a job that set the folder aside would do
    with pytest.raises(HostError):
        with folder_lock.hold(run, "draftlab train"):
            pass


def test_a_killed_holders_lock_is_free_at_once(tmp_path, other_process):
    other_process.kill()
    other_process.wait()
    with folder_lock.hold(tmp_path / "run", "draftlab train"):
        assert str(os.getpid()) in folder_lock.lock_path(tmp_path / "run").read_text()
    assert not folder_lock.held(tmp_path / "run")


def test_reentrant_holds_of_one_process_nest_and_others_do_not(tmp_path):
    with folder_lock.hold(tmp_path / "store", "draftlab extract", reentrant=True):
        with folder_lock.hold(tmp_path / "store", "draftlab extract", reentrant=True):
            pass
        assert folder_lock.held(tmp_path / "store"), "the outer block still holds it"
        with pytest.raises(HostError):
            with folder_lock.hold(tmp_path / "store", "draftlab extract"):
                pass
    assert not folder_lock.held(tmp_path / "store")
