"""train's pure helpers: the trainer's argv (read back by speculators' own TrainConfig), the
store's layer ids against the draft config, the torchrun command line, the rank's metric
handler (steps logged before a resume skipped, a NaN loss stops training), and the clean-up
of a killed launcher's leftovers. No process is started."""

from __future__ import annotations

import io
import json
import logging
import math
import sys
from pathlib import Path

import pytest
from rich.console import Console

from draftlab import paths, procs
from draftlab.params import ParamsError
from draftlab.rundir import Launch, Manifest, RankPlan, RunDir, TargetInfo
from draftlab.store.hidden_states import StoreSource
from draftlab.training import job, launch
from draftlab.training.rank import MetricsToTracker
from tests.conftest import RecordingTracker, tiny_params


def _argv(params, tmp_path, device="cpu", source=None):
    return job.speculators_argv(
        params, verifier="v", data_dir=tmp_path / "data", source=source or StoreSource(tmp_path / "hs", "bfloat16"),
        out_dir=tmp_path / "run",
        layer_ids=[2, 4, 5], total_steps=17, d2t=tmp_path / "d2t.npy", t2d=tmp_path / "t2d.npy", device=device)


def test_speculators_reads_back_what_the_params_say(tmp_path):
    from speculators.train.config import TrainConfig

    params = tiny_params(train={"epochs": 3, "lr": 2e-3, "total_seq_len": 128, "max_steps": 9, "sharding": "fsdp",
                                "extra_args": ["--log-freq", "5"]})
    cfg = TrainConfig.resolve(_argv(params, tmp_path))
    assert cfg.trainer.epochs == 3 and cfg.trainer.max_steps == 9 and cfg.trainer.fsdp_shard
    assert cfg.optimizer.lr == params.train.resolved_lr() and cfg.optimizer.optimizer == params.train.optimizer
    assert cfg.scheduler.scheduler_total_steps == 17, "the exact total from the accounting, not the trainer's guess"
    assert cfg.data.total_seq_len == 128 and cfg.data.hidden_states_backend == "file"
    assert cfg.draft.target_layer_ids == [2, 4, 5]
    assert cfg.trainer.save_path == str(tmp_path / "run" / "checkpoints")
    assert cfg.trainer.log_freq == 5, "extra_args reach the trainer, last so they win"
    assert (cfg.draft.draft_attn_impl, cfg.loss.loss_implementation) == ("sdpa", "eager"), "what CPU can run"


def test_on_a_gpu_the_trainers_own_kernels_stay_and_no_cut_without_max_steps(tmp_path):
    from speculators.train.config import TrainConfig

    cfg = TrainConfig.resolve(_argv(tiny_params(train={"max_steps": None}), tmp_path, device="cuda"))
    assert cfg.loss.loss_implementation == "fused" and cfg.trainer.max_steps is None and not cfg.trainer.fsdp_shard


def test_layer_ids_come_from_the_store_and_extra_args_cannot_name_others():
    manifest = Manifest(key="k", target=TargetInfo(source="tiny", num_layers=8, hidden_size=32), layer_ids=[2, 4, 5],
                        num_files=0, num_tokens=0, total_bytes=0, files=[])
    assert job.check_layer_ids(tiny_params(), manifest) == [2, 4, 5]
    with pytest.raises(ParamsError, match=r"train.extra_args: --target-layer-ids sets --target-layer-ids, which "
                                          r"draftlab sets itself"):
        tiny_params(train={"extra_args": ["--target-layer-ids", "2", "4", "5"]})


def test_every_flag_draftlab_sets_is_one_extra_args_cannot_override(tmp_path):
    """RESERVED_TRAIN_FLAGS is the list of what speculators_argv sets, with either source: the two cannot drift."""
    from draftlab.params import CPU_TRAIN_FLAGS, RESERVED_TRAIN_FLAGS
    from draftlab.store.hidden_states import VllmSource

    params = tiny_params(train={"max_steps": 3, "sharding": "fsdp"})
    online = VllmSource(model="v", layer_ids=[2, 4, 5], exchange_dir=tmp_path / "x", endpoint="http://127.0.0.1:1/v1")
    argv = _argv(params, tmp_path, device="cpu") + _argv(params, tmp_path, device="cpu", source=online)
    assert {a for a in argv if a.startswith("--")} == {*RESERVED_TRAIN_FLAGS, *CPU_TRAIN_FLAGS}


@pytest.mark.parametrize("args, flag", [
    (["--save-path", "/tmp/elsewhere"], "--save-path"),
    (["--log-freq", "5", "--lr=0.5"], "--lr"),
    (["--save", "/tmp/elsewhere"], "--save-path"),  # argparse expands a unique prefix
    (["--epochs", "9"], "--epochs"),
])
def test_extra_args_that_override_a_draftlab_flag_are_refused_in_one_line(args, flag):
    with pytest.raises(ParamsError) as err:
        tiny_params(train={"extra_args": args})
    line = str(err.value)
    assert "\n" not in line and line.startswith("params.yaml: train.extra_args: ") and f"sets {flag}, which" in line


def test_on_cpu_extra_args_cannot_change_the_cpu_kernels(tmp_path):
    params = tiny_params(train={"extra_args": ["--loss-implementation", "fused"]})
    with pytest.raises(ParamsError, match=r"--loss-implementation sets --loss-implementation, which a CPU run sets"):
        _argv(params, tmp_path, device="cpu")
    assert "fused" in _argv(params, tmp_path, device="cuda"), "a GPU run may choose its kernels"


def test_torchrun_is_standalone_on_one_node_and_rendezvous_across_nodes():
    one = launch.torchrun_cmd(tiny_params(train={"gpus": 2}), ["--epochs", "1"])
    assert one[:3] == [sys.executable, "-m", "draftlab.training.torchrun"]  # torch.distributed.run without the teardown
    assert one[one.index("--nproc-per-node") + 1] == "2" and "--standalone" in one and "--rdzv-endpoint" not in one
    assert one[-4:] == ["-m", "draftlab.training.rank", "--epochs", "1"]
    two = launch.torchrun_cmd(tiny_params(train={"gpus": 8, "nnodes": 2, "node_rank": 1,
                                                "rdzv_endpoint": "head:29400"}), [])
    assert "--standalone" not in two
    assert [two[two.index(k) + 1] for k in ("--nnodes", "--node-rank", "--rdzv-backend", "--rdzv-endpoint")] == \
        ["2", "1", "c10d", "head:29400"]


# ---------------------------------------------------------------- the rank's metric handler


def _record(msg: dict, step: int) -> logging.LogRecord:
    record = logging.LogRecord("speculators.metrics", logging.INFO, __file__, 0, msg, None, None)
    record.step = step
    return record


def _train_msg(loss: float, epoch: int = 0) -> dict:
    return {"train": {"loss": loss, "loss_0": loss}, "epoch": epoch, "lr": 1e-3,
            "profile": {"step_ms": 50.0, "fetch_frac": 0.25}}


@pytest.fixture
def handler(tmp_path):
    tracker = RecordingTracker()
    plan = RankPlan(total_steps=6, step_tokens=[100] * 6, epoch_steps=[3, 3], last_logged_step=2, optimizer="AdamW")
    h = MetricsToTracker(tracker, plan, tmp_path)
    yield h, tracker
    h.tracker.close()


def test_steps_logged_before_a_resume_are_not_logged_again(handler):
    h, tracker = handler
    for step in range(6):  # a resume from the checkpoint after step 1 redoes step 2
        h.emit(_record(_train_msg(3.0 - 0.1 * step, epoch=step // 3), step))
    h.emit(_record({"val": {"loss_epoch": 2.5}, "epoch": 1}, 5))
    h.tracker.close()
    train_steps = [step for step, m in tracker.metrics if "train/loss" in m]
    assert train_steps == [3, 4, 5]
    at3 = next(m for step, m in tracker.metrics if step == 3)
    assert at3["train/loss"] == pytest.approx(2.7) and at3["lr/AdamW"] == 1e-3 and at3["epoch"] == 1
    assert at3["perf/steps_per_s"] == pytest.approx(20.0) and at3["perf/tokens_per_s"] == pytest.approx(2000.0)
    assert at3["perf/data_wait_frac"] == 0.25
    assert (5, {"val/loss_epoch": 2.5}) in tracker.metrics


def test_step_phases_reach_mlflow_as_each_epochs_mean_at_its_last_step(handler):
    h, tracker = handler
    for step in range(3, 6):  # epoch 1: steps 3..5
        msg = _train_msg(1.0, epoch=1)
        msg["profile"].update(step_ms=40.0 + 10 * step, fwd_ms=step)
        h.emit(_record(msg, step))
    h.tracker.close()
    with_phases = [(step, m) for step, m in tracker.metrics if "perf/step_ms" in m]
    assert [step for step, _ in with_phases] == [5]
    assert with_phases[0][1]["perf/step_ms"] == pytest.approx(80.0) and with_phases[0][1]["perf/fwd_ms"] == 4.0
    assert all("perf/tokens_per_s" in m for step, m in tracker.metrics if "train/loss" in m), "rates every step"


@pytest.mark.parametrize("loss", [math.nan, math.inf])
@pytest.mark.parametrize("writer", [True, False])
def test_a_non_finite_loss_stops_training_and_says_where(handler, tmp_path, loss, writer):
    from draftlab.training.rank import ConvergenceGuard

    h, tracker = handler
    plan = RankPlan(total_steps=6, step_tokens=[100] * 6, epoch_steps=[3, 3], watch={})
    guard = ConvergenceGuard(plan, tmp_path, writer=writer)
    guard.tags = h.tracker.set_tags if writer else None
    with pytest.raises(FloatingPointError, match=rf"train/loss is {loss} at global step 4 \(epoch 1\)"):
        for hd in (guard, h):  # as the rank attaches them: the guard first
            hd.emit(_record(_train_msg(loss, epoch=1), 4))
    failure = RunDir(tmp_path).failure.read()  # every rank writes it: the first one out may end the group
    assert failure.reason == "diverged" and "global step 4" in failure.message
    h.tracker.close()
    assert not any(step == 4 for step, _ in tracker.metrics)
    assert tracker.tags.get("draftlab.convergence") == ("diverged" if writer else None)


def test_the_guard_says_each_change_of_trend_once_and_tags_it(handler, tmp_path, capsys):
    from draftlab.training.rank import ConvergenceGuard

    h, tracker = handler
    plan = RankPlan(total_steps=40, step_tokens=[100] * 40, epoch_steps=[40], watch={"window_steps": 5})
    guard = ConvergenceGuard(plan, tmp_path, writer=True)
    guard.tags = h.tracker.set_tags
    losses = [4.0 - 0.05 * s for s in range(20)] + [3.0 + 0.3 * s for s in range(20)]  # learns, then rises
    for step, loss in enumerate(losses):
        guard.emit(_record(_train_msg(loss), step))
    h.tracker.close()
    said = [line for line in capsys.readouterr().err.splitlines() if line.startswith("train: step")]
    assert len(said) == 2 and "learning" in said[0] and "diverging" in said[1]
    assert tracker.tags["draftlab.convergence"] == "diverging"
    assert not RunDir(tmp_path).failure.exists(), "a trend stops nothing unless train.watch.stop_on says so"


# ---------------------------------------------------------------- a killed launcher's leftovers


def _dead_group() -> int:
    return next(n for n in range(4_000_000, 4_194_304) if not procs.group_alive(n))


def _console():
    out = io.StringIO()
    return Console(file=out, width=200), out


def test_a_dead_runs_process_group_record_is_cleared(tmp_path):
    RunDir(tmp_path).launch_file().write(Launch(pgid=_dead_group()))
    console, out = _console()
    launch.stop_orphans(tmp_path, console)
    assert not RunDir(tmp_path).launch_file().exists() and out.getvalue() == ""


def test_a_reused_pid_is_not_taken_for_a_rank(tmp_path):
    path = procs.record_self(tmp_path, "rank0")  # this process, recorded with another start time:
    rec = json.loads(path.read_text())  # the pid of a rank that died, now someone else's
    path.write_text(json.dumps({**rec, "start": rec["start"] + 1}))
    console, out = _console()
    launch.stop_orphans(tmp_path, console)  # would SIGKILL this test if it took the pid for the rank
    assert "orphaned" not in out.getvalue()


def test_a_live_launcher_is_left_alone(tmp_path):
    RunDir(tmp_path).launch_file().write(Launch(pgid=_dead_group()))
    console, out = _console()
    with launch.exclusive(tmp_path):  # what a running `draftlab train` holds
        launch.stop_orphans(tmp_path, console)  # another launcher, before it has the lock
    assert RunDir(tmp_path).launch_file().exists() and out.getvalue() == ""


def test_the_run_folders_step_record_keeps_each_step_once_across_a_kill(tmp_path):
    from draftlab.training import metrics as train_metrics

    first = train_metrics.StepWriter(tmp_path)
    for step in range(4):
        first.write(step, {"train/loss_0": 5.0 - step})
    with open(RunDir(tmp_path).step_metrics_path, "a") as f:
        f.write('{"step": 4, "train/lo')  # killed mid-line
    resumed = train_metrics.StepWriter(tmp_path)  # the trainer redoes steps 2.. from its checkpoint
    for step in range(2, 6):
        resumed.write(step, {"train/loss_0": 9.0})
    steps = train_metrics.read(tmp_path)
    assert sorted(steps) == [0, 1, 2, 3, 4, 5]
    assert [steps[s]["train/loss_0"] for s in range(6)] == [5.0, 4.0, 3.0, 2.0, 9.0, 9.0], "first values stay"
    lines = (RunDir(tmp_path).step_metrics_path).read_text().splitlines()
    assert len(lines) == 6 and all(line.startswith('{"step": ') for line in lines)


def test_a_folder_without_its_step_record_gets_the_mlflow_runs_steps_back(tmp_path, store_uri):
    import mlflow

    from draftlab.training import metrics as train_metrics

    client = mlflow.MlflowClient(store_uri)
    run_id = client.create_run(client.create_experiment("draftlab")).info.run_id
    for step in range(5):
        client.log_metric(run_id, "train/loss", 5.0 - step, step=step)
        client.log_metric(run_id, "train/loss_0", 6.0 - step, step=step)
        client.log_metric(run_id, "epoch", step // 3, step=step)
    client.log_metric(run_id, "val/loss_epoch", 1.0, step=2)
    writer = train_metrics.StepWriter(tmp_path)
    for step in (3, 4):  # what the ranks wrote after a resume: their values stay
        writer.write(step, {"train/loss": 0.5, "epoch": 1})
    assert train_metrics.backfill(tmp_path, client, run_id) == 3
    steps = train_metrics.read(tmp_path)
    assert sorted(steps) == [0, 1, 2, 3, 4]
    assert steps[1] == {"step": 1, "train/loss": 4.0, "train/loss_0": 5.0, "epoch": 0}
    assert steps[3]["train/loss"] == 0.5 and "val/loss_epoch" not in steps[2]
    assert train_metrics.backfill(tmp_path, client, run_id) == 0, "nothing twice"
    lines = RunDir(tmp_path).step_metrics_path.read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [0, 1, 2, 3, 4]


def test_the_rank_writes_every_finite_step_to_the_run_folder(handler, tmp_path):
    from draftlab.training import metrics as train_metrics

    h, _ = handler
    for step in range(6):
        h.emit(_record(_train_msg(3.0 - 0.1 * step, epoch=step // 3), step))
    steps = train_metrics.read(tmp_path)
    assert sorted(steps) == list(range(6)), "the MLflow run's resume point does not thin the run folder's record"
    assert steps[4] == {"step": 4, "train/loss": pytest.approx(2.6), "train/loss_0": pytest.approx(2.6), "epoch": 1}


def test_a_long_run_logs_a_thinned_loss_curve_beside_every_step(tmp_path):
    """train_mean/loss: the mean train/loss of each 1,000 global steps (and of the last, partial
    stretch), at the stretch's last step; train/loss keeps every step."""
    tracker = RecordingTracker()
    plan = RankPlan(total_steps=2500, step_tokens=[100] * 2500, epoch_steps=[1250, 1250])
    h = MetricsToTracker(tracker, plan, tmp_path)
    for step in range(2500):
        h.emit(_record(_train_msg(float(step), epoch=step // 1250), step))
    h.tracker.close()
    thinned = [(step, m["train_mean/loss"]) for step, m in tracker.metrics if "train_mean/loss" in m]
    assert thinned == [(999, pytest.approx(499.5)), (1999, pytest.approx(1499.5)), (2499, pytest.approx(2249.5))]
    assert [step for step, m in tracker.metrics if "train/loss" in m] == list(range(2500))


def test_a_launch_removes_the_scratch_folders_of_launchers_that_are_gone(tmp_path):
    """torchrun's log folders live in `draftlab-torchrun-<pid>-…`; a launcher killed with -9 leaves its
    folder, and the next launch removes it, never a live launcher's."""
    import os
    import subprocess

    from draftlab.training.torchrun import SCRATCH_PREFIX, _reap_scratch

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    for name in (f"{SCRATCH_PREFIX}{dead.pid}-a1", f"{SCRATCH_PREFIX}{os.getpid()}-b2", f"{SCRATCH_PREFIX}x-c3", "other"):
        (tmp_path / name / "torchelastic_x").mkdir(parents=True)
    _reap_scratch(str(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [f"{SCRATCH_PREFIX}{os.getpid()}-b2", f"{SCRATCH_PREFIX}x-c3", "other"])
