"""kill -9 in the middle of extraction, rerun: the store is byte-identical to an
uninterrupted run, and a half-written file never counts as done."""

import os
import signal
import subprocess
import sys
from pathlib import Path

from draftlab.rundir import StoreDir
from draftlab.store import layout as store
from tests.integration.pause import paused_after, wait_paused


def _extract(prepared, root: Path, out: str, env: dict | None = None) -> subprocess.Popen:
    params_path, target_dir, data_dir = prepared
    return subprocess.Popen(
        [sys.executable, "-m", "draftlab.cli", "extract", "--params", str(params_path),
         "--target", str(target_dir), "--data", str(data_dir), "--out", str(root / out)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env,
    )


def test_kill_9_then_rerun_gives_a_byte_identical_store(wide_prepared, tmp_path):
    """The session's random-init wide target and its 60 samples, in batches of 256 tokens: far more
    batches than the 4 done before the kill."""
    # Interrupted run: stopped right after its 4th journaled batch (of many more), then SIGKILL.
    env, paused = paused_after(tmp_path, 4)
    proc = _extract(wide_prepared, tmp_path, "killed", env)
    work = store.work_dir(tmp_path / "killed")  # where an unfinished store lives (outside DVC's output)
    journal = StoreDir(work).journal_path
    wait_paused(proc, paused)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (tmp_path / "killed").exists() and not store.has_manifest(work), \
        "a killed run must not look finished"
    done_before = len(journal.read_text().splitlines()) - 1

    # A torn file from a kill mid-write is never taken as done.
    (work / ".hs_999.safetensors.tmp-1").write_bytes(b"half")

    resumed = _extract(wide_prepared, tmp_path, "killed")
    assert resumed.wait() == 0, resumed.stderr.read()
    fresh = _extract(wide_prepared, tmp_path, "fresh")
    assert fresh.wait() == 0, fresh.stderr.read()

    killed_files = sorted(p.name for p in (tmp_path / "killed").iterdir() if not p.name.startswith("."))
    fresh_files = sorted(p.name for p in (tmp_path / "fresh").iterdir() if not p.name.startswith("."))
    assert killed_files == fresh_files
    for name in fresh_files:
        assert (tmp_path / "killed" / name).read_bytes() == (tmp_path / "fresh" / name).read_bytes(), name
    assert done_before == 4
    assert store.verify(tmp_path / "killed") == []
    assert not list((tmp_path / "killed").glob(".hs_*.tmp-*")) and not list(work.glob(".hs_*.tmp-*"))
