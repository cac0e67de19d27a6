"""One job per folder, with two real processes: a second `draftlab train` (other params) or a
second `draftlab extract` on the same folder is refused in one line naming the first one's pid and
host, before it moves, writes or deletes anything there, and the first goes on untouched."""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import yaml

from draftlab.rundir import RunDir, StoreDir
from draftlab.store import layout as store
from tests.integration.pause import paused_after, wait_paused


def _lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


def test_a_second_train_with_other_params_is_refused_and_the_live_folder_is_not_moved(built, tmp_path):
    params, target_dir, data_dir, store_dir = built
    raw = params.model_dump()
    raw["train"].update({"epochs": 40, "total_seq_len": 96, "draft_vocab_size": 64, "lr": 3e-3, "num_workers": 0})
    first_params, second_params = tmp_path / "first.yaml", tmp_path / "second.yaml"
    first_params.write_text(yaml.safe_dump(raw))
    raw["train"]["lr"] = 1e-3  # other params: before the fix, this one set the live folder aside
    second_params.write_text(yaml.safe_dump(raw))
    out = tmp_path / "runs" / "train"
    env = dict(os.environ, MLFLOW_TRACKING_URI=f"sqlite:///{tmp_path / 'mlflow.db'}")

    def cmd(p):
        return [sys.executable, "-m", "draftlab.cli", "train", "--params", str(p), "--target", str(target_dir),
                "--data", str(data_dir), "--store", str(store_dir), "--out", str(out)]

    first = subprocess.Popen(cmd(first_params), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 900  # a generous bound for a loaded 2-core host, not a speed check
        while not (out / "checkpoints" / "0" / "training_state.json").exists():
            assert first.poll() is None, "the first training ended before the second started"
            assert time.monotonic() < deadline, "no checkpoint within 900 s"
            time.sleep(0.1)
        key = RunDir(out).run.read().key
        second = subprocess.run(cmd(second_params), env=env, capture_output=True, text=True, timeout=600)
        assert first.poll() is None, "the first training is still running: the refusal came while it ran"
        assert second.returncode == 2, second.stderr
        lines = _lines(second.stdout + second.stderr)
        refusal = [line for line in lines if "another `draftlab train`" in line]
        assert len(refusal) == 1 and "Traceback" not in second.stderr, lines
        assert f"pid {first.pid} on {socket.gethostname()}" in refusal[0], refusal[0]
        assert RunDir(out).run.read().key == key, "the live folder is still the first training's"
        assert not list(out.parent.glob(".stale-*")), "nothing was set aside"
        assert (out / "checkpoints" / "0" / "training_state.json").exists()
    finally:
        first.kill()  # its torchrun and ranks die with it (parent-death signal)
        first.wait()


def test_a_second_extract_on_one_store_is_refused_and_the_first_completes(wide_prepared, tmp_path):
    params_path, target_dir, data_dir = wide_prepared
    out = tmp_path / "hidden_states"
    cmd = [sys.executable, "-m", "draftlab.cli", "extract", "--params", str(params_path),
           "--target", str(target_dir), "--data", str(data_dir), "--out", str(out)]
    env = dict(os.environ, MLFLOW_TRACKING_URI=f"sqlite:///{tmp_path / 'mlflow.db'}")

    pause_env, paused = paused_after(tmp_path, 2)
    first = subprocess.Popen(cmd, env={**env, **{k: pause_env[k] for k in ("PAUSE_AFTER_BATCHES", "PAUSED_FILE",
                                                                           "PYTHONPATH")}},
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_paused(first, paused)
        work = store.work_dir(out)
        journal_before = StoreDir(work).journal_path.read_bytes()
        temp = work / ".hs_999.safetensors.tmp-1"  # what a writer mid-file has: the second must not delete it
        temp.write_bytes(b"being written")
        second = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        assert second.returncode == 2, second.stderr
        lines = _lines(second.stdout + second.stderr)
        assert len(lines) == 1 and "Traceback" not in second.stderr, lines
        assert "another `draftlab extract`" in lines[0] and f"pid {first.pid} on {socket.gethostname()}" in lines[0]
        assert temp.read_bytes() == b"being written" and StoreDir(work).journal_path.read_bytes() == journal_before
        assert first.poll() is None
    finally:
        first.kill()
        first.wait()
    rerun = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)  # the lock died with it
    assert rerun.returncode == 0, rerun.stderr
    num_samples = yaml.safe_load(params_path.read_text())["prepare"]["num_samples"]
    assert store.verify(out) == [] and json.loads(StoreDir(out).manifest.path.read_text())["num_files"] == num_samples
