"""Data-parallel extraction on CPU: 2 rank processes write the very store (every file and the
manifest, byte for byte) that 1 process writes, and a kill -9 of the launcher takes its ranks
with it and resumes."""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml

from draftlab.store import layout as store
from tests.integration.pause import paused_after, wait_paused


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file() and not p.name.startswith(".")}


def test_two_processes_write_the_store_one_process_writes(built, tmp_path):
    from draftlab.params import parse_params
    from draftlab.stages import extract

    params, target_dir, data_dir, store_dir = built
    raw = params.model_dump()
    raw["extract"]["processes"] = 2
    result = extract.run(parse_params(raw), target_dir=target_dir, data_dir=data_dir, out_dir=tmp_path / "dp")
    one, two = _files(store_dir), _files(tmp_path / "dp")
    assert result.extracted_now == result.num_tokens > 0
    assert sorted(one) == sorted(two) and len(one) == result.num_files + 1  # + manifest.json
    different = [name for name in one if one[name] != two[name]]
    assert not different, f"files differ between 1 and 2 processes: {different[:5]}"
    assert store.read_manifest(tmp_path / "dp").compute == {"device": "cpu", "compute_dtype": "float32"}


def test_kill_9_of_the_launcher_stops_its_ranks_and_resumes(built, tmp_path):
    from tests.conftest import descendants

    params, target_dir, data_dir, store_dir = built
    raw = params.model_dump()
    raw["extract"].update({"processes": 2, "batch_tokens": 192})  # more batches than the pause leaves done
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(raw))
    cmd = [sys.executable, "-m", "draftlab.cli", "extract", "--params", str(tmp_path / "params.yaml"),
           "--target", str(target_dir), "--data", str(data_dir), "--out", str(tmp_path / "dp")]
    env, paused = paused_after(tmp_path, 2)  # the launcher stops after journaling 2 batches of many
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    wait_paused(proc, paused)
    ranks = [pid for pid, cmdline in descendants(proc.pid).items() if "draftlab.store.extract_ranks" in cmdline]
    assert len(ranks) == 2
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + 10
    while any(Path(f"/proc/{pid}").exists() and _running(pid) for pid in ranks):
        assert time.monotonic() < deadline, "the ranks outlived their launcher"
        time.sleep(0.05)
    rerun = subprocess.run(cmd, capture_output=True, text=True)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    done = re.search(r"(\d+)/(\d+) batches already done", " ".join((rerun.stdout + rerun.stderr).split()))
    assert done and int(done[1]) == 2 < int(done[2]), "the rerun resumed the killed run's batches"
    manifest = store.read_manifest(tmp_path / "dp")
    assert manifest.num_files == store.read_manifest(store_dir).num_files
    assert store.verify(tmp_path / "dp") == [], "every file whole and as the manifest says"


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False
