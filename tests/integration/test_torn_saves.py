"""Nothing torn is trusted: a kill -9 in the middle of a checkpoint save, and a full disk (a small
tmpfs) before and during a checkpoint and in the middle of an extraction, each end with one line
and the last good state intact; a rerun with space completes with nothing lost or duplicated.

A `sitecustomize` on the processes' PYTHONPATH stops them at the named point (inside the Nth
checkpoint save, after its weights are written aside and before its optimizer state; before the
Nth save; after the Nth journaled extraction batch) and waits for a go file, so the kill or the
full disk lands there whatever the machine's speed."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from draftlab.rundir import RunDir, StoreDir
from draftlab.store import layout as store
from draftlab.training import checkpoint as ck

SITECUSTOMIZE = '''
import os
import time
from pathlib import Path


def _pause(tag):
    Path(os.environ["PAUSED_FILE"]).write_text(tag)
    go = Path(os.environ["GO_FILE"])
    while not go.exists():
        time.sleep(0.05)


_where, _n = os.environ.get("PAUSE_AT"), [0]
if _where in ("in-save", "before-save"):
    import draftlab.training.checkpoint as _c

    _stock = _c.atomic_save

    def atomic_save(save, trainer, epoch):
        _n[0] += 1
        if _n[0] == int(os.environ["PAUSE_N"]):
            if _where == "before-save":
                _pause("before the save")
            else:
                import torch

                real = torch.save

                def paused(obj, f, *args, **kwargs):
                    if str(f).endswith("optimizer_state_dict.pt"):
                        torch.save = real
                        _pause("in the save")
                    return real(obj, f, *args, **kwargs)

                torch.save = paused
        return _stock(save, trainer, epoch)

    _c.atomic_save = atomic_save
elif _where == "extract":
    import draftlab.store.layout as _s

    _record = _s.Journal.record

    def record(self, files):
        _record(self, files)
        _n[0] += 1
        if _n[0] == int(os.environ["PAUSE_N"]):
            _pause("after a batch")

    _s.Journal.record = record
'''


def _pausing_env(tmp_path: Path, where: str, n: int) -> tuple[dict, Path, Path]:
    site = tmp_path / "pause-site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    paused, go = tmp_path / "paused", tmp_path / "go"
    env = {"PAUSE_AT": where, "PAUSE_N": str(n), "PAUSED_FILE": str(paused), "GO_FILE": str(go),
           "PYTHONPATH": os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH")) if p)}
    return env, paused, go


def _wait_paused(proc, paused: Path, timeout_s: float = 900) -> None:
    deadline = time.monotonic() + timeout_s  # a generous bound for a loaded 2-core host, not a speed check
    while not paused.exists():
        assert proc.poll() is None, "the process ended before its pause"
        assert time.monotonic() < deadline, "the process never reached its pause"
        time.sleep(0.05)


@pytest.fixture
def small_disk(tmp_path):
    """A tmpfs of its own (a disk that can be filled), unmounted at the end."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    disk = tmp_path / "disk"
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=512m", "tmpfs", str(disk)], check=True)
    yield disk
    subprocess.run(["umount", "-l", str(disk)], check=False)


def _fill(disk: Path, leave_bytes: int) -> Path:
    """Take all of `disk`'s free space but `leave_bytes`."""
    st = os.statvfs(disk)
    filler = disk / "filler"
    fd = os.open(filler, os.O_CREAT | os.O_WRONLY)
    try:
        os.posix_fallocate(fd, 0, max(st.f_bavail * st.f_frsize - leave_bytes, 1))
    finally:
        os.close(fd)
    return filler


def _train_setup(built, tmp_path, out: Path):
    params, target_dir, data_dir, store_dir = built
    raw = params.model_dump()
    # sub-epoch saves: speculators rewrites checkpoints/0/ several times in epoch 0
    raw["train"].update({"epochs": 2, "total_seq_len": 96, "draft_vocab_size": 64, "lr": 3e-3, "num_workers": 0,
                         "checkpoint_freq": 0.3})
    params_path = tmp_path / "params.yaml"
    params_path.write_text(yaml.safe_dump(raw))
    cmd = [sys.executable, "-m", "draftlab.cli", "train", "--params", str(params_path), "--target", str(target_dir),
           "--data", str(data_dir), "--store", str(store_dir), "--out", str(out)]
    env = dict(os.environ, MLFLOW_TRACKING_URI=f"sqlite:///{tmp_path / 'mlflow.db'}")
    return cmd, env


def _snapshot(folder: Path) -> dict:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


def _rerun_completes_once_each(cmd, env, out: Path, tmp_path: Path) -> None:
    import mlflow

    from draftlab.training import metrics as train_metrics

    rerun = subprocess.run(cmd, env=env, capture_output=True, text=True)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    record = RunDir(out).train.read()
    assert record.accounting == "verified"
    total = json.loads((out / "accounting.json").read_text())["total_steps"]
    assert sorted(train_metrics.read(out)) == list(range(total)), "metrics.jsonl: every step once"
    client = mlflow.MlflowClient(env["MLFLOW_TRACKING_URI"])
    steps = [m.step for m in client.get_metric_history(record.run_id, "train/loss")]
    assert sorted(steps) == list(range(total)), "MLflow: every step logged exactly once"
    assert ck.problem(Path(record.checkpoint)) is None and not (out / "checkpoints" / ck.STAGING).exists()


def test_kill_9_in_the_middle_of_a_checkpoint_keeps_the_last_complete_one(built, tmp_path):
    out = tmp_path / "run"
    cmd, env = _train_setup(built, tmp_path, out)
    pause, paused, _ = _pausing_env(tmp_path, "in-save", 2)  # the second save: over checkpoints/0/
    proc = subprocess.Popen(cmd, env={**env, **pause}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_paused(proc, paused)
        good = out / "checkpoints" / "0"
        before = _snapshot(good)
        assert ck.problem(good) is None
        assert (out / "checkpoints" / ck.STAGING / "0" / "model.safetensors").exists(), "mid-save: weights written"
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    from tests.conftest import train_ranks_of

    deadline = time.monotonic() + 30
    while train_ranks_of(out) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not train_ranks_of(out), "the ranks die with their launcher"
    assert _snapshot(good) == before, "the last complete checkpoint is intact, byte for byte"
    assert ck.newest_complete(out / "checkpoints") == good
    _rerun_completes_once_each(cmd, env, out, tmp_path)


@pytest.mark.parametrize("when", ["before-save", "in-save"])
def test_a_full_disk_at_a_checkpoint_is_one_line_and_a_rerun_with_space_completes(built, tmp_path, small_disk, when):
    out = small_disk / "run"
    cmd, env = _train_setup(built, tmp_path, out)
    pause, paused, go = _pausing_env(tmp_path, when, 2)
    proc = subprocess.Popen(cmd, env={**env, **pause}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_paused(proc, paused)
        good = out / "checkpoints" / "0"
        before = _snapshot(good)
        size = sum(len(b) for b in before.values())
        # before the save: half a checkpoint's room (the check refuses); in it: less than its optimizer state
        # (the write fails), a few pages left for the small records the launcher writes meanwhile
        filler = _fill(small_disk, size // 2 if when == "before-save" else 32 << 10)
        go.touch()
        stdout, stderr = proc.communicate(timeout=600)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode != 0
    errors = [line for line in (stdout + stderr).splitlines() if line.startswith("error:")]
    assert len(errors) == 1, errors
    expected = "training stopped before writing it" if when == "before-save" else "filled up while a checkpoint"
    assert "checkpoint:" in errors[0] and expected in errors[0] and "rerun `draftlab train`" in errors[0], errors[0]
    assert _snapshot(good) == before, "the last complete checkpoint is intact, byte for byte"
    assert not (out / "checkpoints" / ck.STAGING).exists(), "the dropped save's files are gone"
    filler.unlink()
    _rerun_completes_once_each(cmd, env, out, tmp_path)


def test_a_full_disk_in_the_middle_of_an_extraction_is_one_line_and_a_rerun_completes(wide_prepared, tmp_path,
                                                                                        small_disk):
    params_path, target_dir, data_dir = wide_prepared
    cmd = [sys.executable, "-m", "draftlab.cli", "extract", "--params", str(params_path),
           "--target", str(target_dir), "--data", str(data_dir)]
    env = dict(os.environ, MLFLOW_TRACKING_URI=f"sqlite:///{tmp_path / 'mlflow.db'}")
    out = small_disk / "hidden_states"

    pause, paused, go = _pausing_env(tmp_path, "extract", 3)
    proc = subprocess.Popen([*cmd, "--out", str(out)], env={**env, **pause}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        _wait_paused(proc, paused, timeout_s=300)
        work = store.work_dir(out)
        journaled = {r["index"] for line in StoreDir(work).journal_path.read_text().splitlines()[1:]
                     for r in json.loads(line)["files"]}
        filler = _fill(small_disk, 0)
        go.touch()
        stdout, stderr = proc.communicate(timeout=300)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == 2, stderr[-2000:]
    errors = [line for line in (stdout + stderr).splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "extract: the disk of" in errors[0] and "rerun `draftlab extract`" in errors[0], errors
    assert "Traceback" not in stderr
    key = json.loads(StoreDir(work).journal_path.read_text().splitlines()[0])["key"]
    filler.unlink()
    assert journaled <= set(store.Journal.open(work, key).done), "every journaled batch is kept"
    rerun = subprocess.run([*cmd, "--out", str(out)], env=env, capture_output=True, text=True)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    fresh = subprocess.run([*cmd, "--out", str(tmp_path / "fresh")], env=env, capture_output=True, text=True)
    assert fresh.returncode == 0, fresh.stderr[-3000:]
    assert store.verify(out) == []
    names = sorted(p.name for p in out.glob("hs_*.safetensors"))
    assert names == sorted(p.name for p in (tmp_path / "fresh").glob("hs_*.safetensors"))
    for name in names:  # nothing lost, nothing duplicated: the same store as an uninterrupted run
        assert (out / name).read_bytes() == (tmp_path / "fresh" / name).read_bytes(), name
    manifest = StoreDir(out).manifest.read()
    assert sorted(f.index for f in manifest.files) == list(range(manifest.num_files))


@pytest.mark.parametrize("which", ["spool", "journal"])
def test_a_full_disk_in_the_middle_of_an_append_loses_and_repeats_nothing(small_disk, which):
    """A write that fills the disk half-way through a line (tmpfs fills the file's last page, then
    has none): the line is left torn, the error says the disk is full; with space again, the next
    append trims the torn line and follows the last whole record."""
    from draftlab.rundir import append_spool, read_spool
    from draftlab.store.layout import Journal

    def rec(i, pad=0):
        return {"index": i, "name": f"hs_{i}.safetensors", "bytes": 1, "sha256": "x" * pad, "tokens": 1}

    if which == "spool":
        path = small_disk / "run" / "tracking-spool.jsonl"

        def append(i, pad=0):
            append_spool(path, {"run_id": "r", "kind": "tags", "tags": {"i": str(i), "pad": "x" * pad}})

        def records():
            return [int(r.tags["i"]) for r in read_spool(path)]
    else:
        journal = Journal.open(small_disk / "store", "key")
        path = journal.path

        def append(i, pad=0):
            Journal.open(small_disk / "store", "key").record([rec(i, pad)])

        def records():
            return sorted(Journal.open(small_disk / "store", "key").done)

    append(0)
    append(1)
    filler = _fill(small_disk, 0)  # the file's last page still has room, no other page is free
    with pytest.raises(OSError) as err:
        append(2, pad=8000)
    assert err.value.errno == 28  # ENOSPC: what the stage turns into its one line
    assert not path.read_bytes().endswith(b"\n"), "the write was cut in the middle of its line"
    assert records() == [0, 1], "the torn line is not a record; the whole ones are all there"
    filler.unlink()
    append(2, pad=8000)
    append(3)
    assert records() == [0, 1, 2, 3], "nothing lost, nothing twice"
    assert path.read_bytes().endswith(b"\n")
