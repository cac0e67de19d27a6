"""The convergence watch and `draftlab status` on real trainings: torchrun, 2 gloo ranks,
speculators' trainer, a real MLflow store (the session's tiny pipeline; its steps are counted by draftlab's
plan, as the tests read them). Nothing here depends on the machine's speed: a training that must be seen running
is held at a step the test names (a sitecustomize on the ranks' PYTHONPATH)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from draftlab.rundir import RunDir
from tests.conftest import train_command
from tests.waiting import wait_for

# lr 1e30 with no schedule: global step 0 trains from finite weights (its loss is finite), AdamW's
# first update moves every weight by about ±lr (still finite in fp32 and bf16, whose range ends
# near 3e38), and step 1's products overflow: its loss is NaN or inf on any CPU. A checkpoint every
# step (checkpoint_freq 0.1 of a 7-step epoch rounds to 1) keeps step 0's weights, finite. A
# moderate lr's divergence depends on the CPU's kernels: lr 18 gave NaN at step 5 on one host and
# a finished run on an AVX-512-BF16 one.
DIVERGING_LR, EVERY_STEP = 1e30, 0.1


def _params(built, **train):
    from draftlab.params import parse_params

    raw = built[0].model_dump()
    raw["train"].update({"epochs": 3, "total_seq_len": 128, "draft_vocab_size": 64, "gpus": 2, **train})
    return parse_params(raw)


def _steps(params, built) -> tuple[int, int]:
    """(global steps of epoch 0, total steps) as draftlab's plan counts them for this data."""
    from draftlab.training.job import plan

    a, _ = plan(params, built[2])
    return a.epochs[0].steps, a.total_steps


def _epoch_ends(params, built) -> tuple[list[int], int]:
    """(global step at the end of each epoch, total steps), from draftlab's plan."""
    from itertools import accumulate

    from draftlab.training.job import plan

    a, _ = plan(params, built[2])
    return list(accumulate(e.steps for e in a.epochs)), a.total_steps


def _cli_train(built, params, tmp_path, out, env=None, **popen):
    cmd = train_command(built, params, tmp_path / f"params-{out.name}.yaml", out)
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env or dict(os.environ), **popen)


def _status(path: Path) -> tuple[int, dict | str]:
    p = subprocess.run([sys.executable, "-m", "draftlab.cli", "status", str(path), "--json"],
                       capture_output=True, text=True, timeout=120)
    return p.returncode, (json.loads(p.stdout) if p.returncode == 0 else p.stdout + p.stderr)


def _run_of(client, out: Path):
    return client.get_run(RunDir(out).run.read().run_id)


def test_a_far_too_large_lr_diverges_stops_in_one_line_and_keeps_the_good_checkpoint(built, tmp_path, mlflow_store):
    from safetensors.torch import load_file

    from draftlab.training.job import last_global_step

    out = tmp_path / "diverge"
    params = _params(built, lr=DIVERGING_LR, scheduler="none", checkpoint_freq=EVERY_STEP)
    proc = _cli_train(built, params, tmp_path, out)
    text, _ = proc.communicate(timeout=900)
    assert proc.returncode == 3, text[-3000:]
    assert "Traceback" not in text and "ChildFailedError" not in text and "elastic" not in text
    lines = [ln for ln in text.splitlines() if "is nan" in ln or "is inf" in ln]
    assert len(lines) == 1 and "training stopped; the last good checkpoint is kept" in lines[0], text[-3000:]
    run = _run_of(mlflow_store, out)
    assert run.info.status == "FAILED"
    assert run.data.tags["draftlab.convergence"] == "diverged"
    failure = RunDir(out).failure.read()
    assert failure.reason == "diverged"
    nan_step = int(failure.message.split("global step ")[1].split()[0])
    good = last_global_step(out / "checkpoints")
    assert good is not None and good <= nan_step, "a checkpoint from before the NaN is there"
    weights = load_file(str(out / "checkpoints" / "0" / "model.safetensors"))
    assert weights and all(bool(t.float().isfinite().all()) for t in weights.values()), "the kept checkpoint is finite"
    code, info = _status(out)
    assert code == 0 and info["state"] == "diverged" and info["convergence"]["trend"] == "diverged"
    assert info["checkpoint"]["global_step"] == good

    # a rerun resumes from that checkpoint (and, at the same lr, diverges at the same step again)
    proc = _cli_train(built, params, tmp_path, out)
    text2, _ = proc.communicate(timeout=900)
    assert proc.returncode == 3
    assert f"resuming MLflow run {run.info.run_id} from global step {good}" in " ".join(text2.split())
    assert RunDir(out).failure.read().message == failure.message
    assert last_global_step(out / "checkpoints") == good


# `stalled` is a finding that the loss is flat within its noise. The tiny pipeline's loss varies
# about 10 % from step to step: at the default stall_frac (2 %) a lr-0 run of ~21 steps reads
# `cannot tell yet` to its end (measured: halves' fall −0.4 %, its noise 13–15 %), as it should;
# showing "no fall of 30 %" is within reach of 20+ steps (a run of 12 could not show it), and a
# learning run here falls 50 %+.
FLAT_WATCH = {"stall_frac": 0.3}
FLAT_STEPS = 21


def _flat_params(built, **train):
    """lr 0 over enough epochs for FLAT_STEPS steps on this data (the plan counts them)."""
    epoch0, _ = _steps(_params(built, epochs=1), built)
    return _params(built, lr=0.0, watch=FLAT_WATCH, epochs=-(-FLAT_STEPS // epoch0), **train)


def test_lr_0_is_reported_stalled(built, tmp_path, mlflow_store):
    from draftlab.stages import train

    _, target_dir, data_dir, store_dir = built
    out = tmp_path / "lr0"
    train.run(_flat_params(built), target_dir=target_dir, data_dir=data_dir,
              store_dir=store_dir, out_dir=out)
    run = _run_of(mlflow_store, out)
    assert run.info.status == "FINISHED"
    assert run.data.tags["draftlab.convergence"] == "stalled"
    progress = RunDir(out).progress.read()
    assert progress.convergence == "stalled"
    assert all(p["trend"] == "stalled" for p in progress.trend["positions"].values())


def test_lr_0_stops_when_the_watch_is_asked_to(built, tmp_path, mlflow_store):
    from draftlab.stages import train
    from draftlab.training.job import TrainingStopped

    _, target_dir, data_dir, store_dir = built
    out = tmp_path / "lr0stop"
    params = _params(built, lr=0.0, epochs=4, watch={**FLAT_WATCH, "stop_on": ["stalled"]})
    with pytest.raises(TrainingStopped, match="loss stalled"):
        train.run(params, target_dir=target_dir, data_dir=data_dir, store_dir=store_dir, out_dir=out)
    assert _run_of(mlflow_store, out).data.tags["draftlab.convergence"] == "stalled"
    assert RunDir(out).failure.read().reason == "stalled"


HOLD = '''
import os
import time
from pathlib import Path

import draftlab.training.rank as _rank

_stock = _rank.MetricsToTracker._progress


def _progress(self, step, flat, out):
    _stock(self, step, flat, out)
    if step == int(os.environ["HOLD_AT_STEP"]):
        self.progress_at = 0.0
        _stock(self, step, flat, out)  # written now, whatever the throttle
        Path(os.environ["HELD_FILE"]).write_text(str(step))
        while not Path(os.environ["GO_FILE"]).exists():
            time.sleep(0.05)


_rank.MetricsToTracker._progress = _progress
'''


def test_status_from_another_process_shows_the_progress_then_the_end(built, tmp_path, mlflow_store):
    site = tmp_path / "hold-site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(HOLD)
    held, go = tmp_path / "held", tmp_path / "go"
    # held at step 9 (past warm-up, where the trend reads `learning`) of a run of 21+ steps
    epoch0, _ = _steps(_params(built, epochs=1), built)
    params = _params(built, lr=3e-3, epochs=max(3, -(-FLAT_STEPS // epoch0)))
    ends, total = _epoch_ends(params, built)
    hold = 9
    epoch = next(e for e, end in enumerate(ends) if end > hold)
    assert epoch >= 1 and hold < total
    env = dict(os.environ, HOLD_AT_STEP=str(hold), HELD_FILE=str(held), GO_FILE=str(go),
               PYTHONPATH=os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]))
    out = tmp_path / "watched"
    code, msg = _status(out)
    assert code == 2 and "not found" in msg
    proc = _cli_train(built, params, tmp_path, out, env=env)
    try:
        wait_for(lambda: held.exists() or proc.poll() is not None, 900, f"the training to reach step {hold}")
        assert proc.poll() is None, proc.stdout.read()[-3000:]
        code, info = _status(out)
        assert code == 0, info
        assert info["state"] == "running"
        assert info["step"] == hold + 1 and info["total_steps"] == total and info["epoch"] == epoch
        assert set(info["losses"]) >= {"loss_0", "loss_1", "loss_2"}
        assert info["convergence"]["trend"] == "learning"
        assert info["eta"]["s"] is not None
        assert info["checkpoint"]["global_step"] == ends[epoch - 1], "the last finished epoch's checkpoint"
        assert info["mlflow"]["run_id"] == RunDir(out).run.read().run_id
        assert info["mlflow"]["ui"].endswith(f"/runs/{info['mlflow']['run_id']}?workflowType=machine_learning")
        assert info["tracking"] == {"spooling": False, "records_waiting": 0}
    finally:
        go.write_text("")
    text, _ = proc.communicate(timeout=900)
    assert proc.returncode == 0, text[-3000:]
    code, info = _status(out)
    assert code == 0 and info["state"] == "finished" and info["step"] == total
    assert info["bottleneck"]["label"]


def test_a_sweep_trial_whose_training_diverges_reports_it_for_pruning(built, tmp_path, mlflow_store):
    """The real trial process (`python -m draftlab.sweep.trial`, as the sweep starts it): its
    training diverges, and the outcome the sweep reads says so (the loop prunes it at once:
    tests/unit/test_sweep_watch.py)."""
    from draftlab.sweep.budget import TrialSpec
    from draftlab.sweep.trial import ProcessLauncher

    _, target_dir, data_dir, store_dir = built
    params = _params(built, lr=DIVERGING_LR, scheduler="none", checkpoint_freq=EVERY_STEP,
                     watch={"stop_on": ["stalled", "diverging"]})
    launcher = ProcessLauncher(study="watch", metric="val/loss", target_dir=target_dir, data_dir=data_dir,
                               store_dir=store_dir, parent_run_id=None, gpu_slots=False, total_slots=2)
    handle = launcher.start(TrialSpec(number=1, values={"train.lr": DIVERGING_LR}, params=params,
                                      devices=["cpu0", "cpu1"], role="search", trial_dir=tmp_path / "trial-0001"))
    out = wait_for(handle.poll, 900, "the trial process to end")
    assert not out.ok and out.convergence == "diverged", out
    assert "is nan" in out.message or "is inf" in out.message, out.message
    assert mlflow_store.get_run(out.run_id).data.tags["draftlab.convergence"] == "diverged"
