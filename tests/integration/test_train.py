"""`draftlab train` for real: torchrun, 2 gloo ranks, speculators' trainer, a real MLflow store.

Uses the session's tiny pipeline (39 samples, 35 of them train: an odd split, so the packing sampler's
per-epoch drops and uneven rank loads are exercised)."""

import json
import os
import signal
import subprocess
import time

import pytest

from draftlab.rundir import RunDir


def _train_params(built, **train):
    params = built[0]
    raw = params.model_dump()
    raw["train"].update({"epochs": 2, "total_seq_len": 128, "draft_vocab_size": 64, "lr": 3e-3, **train})
    from draftlab.params import parse_params

    return parse_params(raw)


def _run(params, built, out_dir):
    from draftlab.stages import train

    _, target_dir, data_dir, store_dir = built
    return train.run(params, target_dir=target_dir, data_dir=data_dir, store_dir=store_dir, out_dir=out_dir)


def test_two_gloo_ranks_odd_samples_accounting_verified_one_mlflow_run(built, tmp_path, mlflow_store):
    from draftlab.training.job import plan

    params = _train_params(built, gpus=2)
    a, _ = plan(params, built[2])
    assert a.train_samples % 2 == 1
    result = _run(params, built, tmp_path / "run")

    runs = mlflow_store.search_runs([mlflow_store.get_experiment_by_name("draftlab").experiment_id])
    assert len(runs) == 1, "one run per training job, not one per rank"
    run = runs[0]
    assert run.info.status == "FINISHED" and run.info.run_id == result.run_id
    p = run.data.params
    assert int(p["world_size"]) == 2 and int(p["total_steps"]) == a.total_steps == result.total_steps
    assert int(p["tokens_per_step"]) == 2 * 128
    assert json.loads(p["dropped_samples"]) == a.dropped_samples
    per_epoch = [e.steps for e in a.epochs]  # every epoch, not epoch 0 under the name of all
    assert json.loads(p["steps_per_epoch"]) == per_epoch
    hist = mlflow_store.get_metric_history(run.info.run_id, "accounting/steps_per_epoch")
    assert sorted((m.step, m.value) for m in hist) == list(enumerate(map(float, per_epoch)))
    steps = [m.step for m in mlflow_store.get_metric_history(run.info.run_id, "train/loss")]
    assert steps == list(range(a.total_steps)), "every global step logged once"
    assert {"train/loss_0", "train/full_acc_0", "train/cond_acc_0", "lr/AdamW", "epoch", "perf/steps_per_s",
            "perf/tokens_per_s", "perf/data_wait_frac", "perf/eta_s", "val/loss_epoch"} <= run.data.metrics.keys()
    assert any(k.startswith("system/") for k in run.data.metrics)
    assert run.data.tags["data.hidden_states_hash"] and run.data.tags["git.commit"]
    check = json.loads((tmp_path / "run" / "accounting-check.json").read_text())
    assert check == {"problems": [], "observed_steps": a.total_steps}
    # the ranks' recorded sample sets: disjoint per epoch
    recs = [json.loads(l) for f in (tmp_path / "run" / "samples").glob("*.jsonl") for l in f.read_text().splitlines()]
    for epoch in range(2):
        r0, r1 = ([set(r["ids"]) for r in recs if r["epoch"] == epoch and r["rank"] == k] for k in (0, 1))
        assert r0 and r1 and not (r0[-1] & r1[-1])
    record = RunDir(tmp_path / "run").train.read()
    assert record.run_id == result.run_id
    # every rank's step profile: one line a step, with the process's minor page faults so far
    for rank in (0, 1):
        prof = [json.loads(l) for l in RunDir(tmp_path / "run").profile_file(rank).read_text().splitlines()]
        assert [r["step"] for r in prof] == list(range(a.total_steps))
        faults = [r["minflt"] for r in prof]
        assert faults == sorted(faults) and faults[0] > 0
    # the time to the first step, by phase: consecutive spans that add up to it, within the run's
    # wall-clock; a new run's MLflow run made beside the ranks' start, out of the sum
    from draftlab.training import startup

    phases = record.startup
    assert phases and {"beside/mlflow_run", "torchrun", "rank_speculators", "first_step"} <= phases.keys()
    assert "mlflow_run" not in phases
    assert abs(startup.in_sum(phases) - phases["total_s"]) < 0.05
    assert 0 < phases["total_s"] < record.wall_clock_s
    assert run.data.metrics["startup/total_s"] == phases["total_s"]


def test_accounting_mismatch_is_reported():
    from draftlab.plan import accounting as acc

    plan = acc.plan_epochs([50, 60, 70, 80, 90], total_seq_len=128, world_size=2, epochs=1, seed=0)
    ids = [[i for b in acc.rank_batches([50, 60, 70, 80, 90], total_seq_len=128, world_size=2, rank=r,
                                        seed=0, epoch=0) for i in b] for r in range(2)]
    assert acc.check_observed(plan, {0: {0: ids[0], 1: ids[1]}}, plan.total_steps) == []
    every_rank_all = {0: {0: ids[0] + ids[1], 1: ids[0] + ids[1]}}  # the reference run's failure mode
    problems = acc.check_observed(plan, every_rank_all, plan.total_steps * 2)
    assert any("global steps: observed" in p for p in problems)
    assert any("repeats" in p for p in problems)


def test_same_seed_one_rank_gives_identical_metrics(built, tmp_path, mlflow_store):
    params = _train_params(built, epochs=1)
    first = _run(params, built, tmp_path / "a")
    second = _run(params, built, tmp_path / "b")
    for key in ("train/loss", "train/full_acc_0", "val/loss_epoch"):
        h1 = [(m.step, m.value) for m in mlflow_store.get_metric_history(first.run_id, key)]
        h2 = [(m.step, m.value) for m in mlflow_store.get_metric_history(second.run_id, key)]
        assert h1 == h2 and h1, key


def test_nan_loss_stops_the_run_with_a_clear_message(built, tmp_path, mlflow_store):
    from draftlab.training.job import TrainingFailed

    params = _train_params(built, epochs=1, lr=1e30, scheduler="none")
    with pytest.raises(TrainingFailed, match=r"train/loss is (nan|inf)"):
        _run(params, built, tmp_path / "nan")
    run = mlflow_store.search_runs([mlflow_store.get_experiment_by_name("draftlab").experiment_id])[0]
    assert run.info.status == "FAILED"


def test_bad_train_params_fail_before_launch(built, tmp_path, mlflow_store):
    from draftlab.params import ParamsError

    params = _train_params(built, extra_args=["--loss-implementation", "fused"])  # valid params, not on a CPU
    with pytest.raises(ParamsError, match=r"train.extra_args: --loss-implementation sets --loss-implementation, "
                                          r"which a CPU run sets itself"):
        _run(params, built, tmp_path / "bad")
    assert not (tmp_path / "bad").exists()


def _wait_for(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out after {timeout_s:.0f} s waiting for {what}"
        time.sleep(0.05)


def test_kill_9_torchrun_then_launcher_no_rank_survives_and_rerun_resumes(built, tmp_path, mlflow_store):
    """kill -9 torchrun mid-training: its ranks (each in a session of its own) die within seconds
    and the launcher fails; the rerun resumes; kill -9 that launcher: again no rank survives; the
    third run resumes from the last checkpoint in the same MLflow run and logs no step twice."""
    from tests.conftest import train_command, train_ranks_of

    params = _train_params(built, epochs=3, total_seq_len=96)
    out = tmp_path / "run"
    cmd = train_command(built, params, tmp_path / "params.yaml", out)
    env = dict(os.environ)

    def start_until(checkpoint: str):
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 300
        while not (out / "checkpoints" / checkpoint / "training_state.json").exists():
            assert proc.poll() is None, "training ended before it could be killed"
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert train_ranks_of(out), "the ranks run"
        return proc

    launcher = start_until("0")
    os.kill(RunDir(out).launch_file().read().pgid, signal.SIGKILL)  # torchrun itself
    _wait_for(lambda: not train_ranks_of(out), 10, "the ranks to die with torchrun")
    assert launcher.wait(timeout=120) != 0, "the launcher reports that training did not finish"
    run_id = RunDir(out).run.read().run_id

    launcher = start_until("1")
    os.kill(launcher.pid, signal.SIGKILL)
    launcher.wait()
    _wait_for(lambda: not train_ranks_of(out), 10, "the ranks to die with their launcher")

    rerun = subprocess.run(cmd, env=env, capture_output=True, text=True)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert RunDir(out).train.read().run_id == run_id
    runs = mlflow_store.search_runs([mlflow_store.get_experiment_by_name("draftlab").experiment_id])
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"
    assert int(runs[0].data.tags["draftlab.resumed_from_step"]) > 0, "resumed from the second kill's checkpoint"
    steps = [m.step for m in mlflow_store.get_metric_history(run_id, "train/loss")]
    total = json.loads((out / "accounting.json").read_text())["total_steps"]
    assert sorted(steps) == list(range(total)), "each step logged exactly once across the kills"


def test_evaluate_and_export_log_into_the_training_run(built, tmp_path, mlflow_store):
    from draftlab.stages import evaluate, export
    from draftlab.tracking import MlflowTracker

    params = _train_params(built, epochs=1)
    _, target_dir, data_dir, store_dir = built
    result = _run(params, built, tmp_path / "run")
    from draftlab.training import metrics as train_metrics

    curve = train_metrics.read(tmp_path / "run")
    # a folder trained before rank 0 wrote metrics.jsonl: the rerun resumes, trains nothing more,
    # and restores the file from the MLflow run, so evaluate's input is there again
    (tmp_path / "run" / "metrics.jsonl").unlink()
    assert _run(params, built, tmp_path / "run").run_id == result.run_id
    assert train_metrics.read(tmp_path / "run") == curve and len(curve) == result.total_steps
    tracker = MlflowTracker(result.run_id)
    ev = evaluate.run(params, target_dir=target_dir, data_dir=data_dir, store_dir=store_dir,
                      train_dir=tmp_path / "run", out_dir=tmp_path / "reports", tracker=tracker)
    m = ev.metrics
    k = params.train.ttt_steps
    assert m["eval/lossless"] == 1.0, "speculative decoding must reproduce the target's greedy output"
    assert m["eval/simulated_acc_len"] == pytest.approx(1 + sum(m[f"eval/full_acc_{s}"] for s in range(k)))
    assert 1.0 <= m["eval/measured_acc_len"] <= 1 + k
    assert m["eval/target_forwards"] <= m["eval/plain_forwards"]
    saved = json.loads((tmp_path / "reports" / "metrics.json").read_text())
    assert saved["run_id"] == result.run_id and "eval/predicted_over_measured" in saved
    for name in ("acceptance_by_position.png", "loss_per_ttt_step.png", "acceptance.csv", "train_loss.csv"):
        assert (tmp_path / "reports" / name).stat().st_size > 0
    export.run(params, target_dir=target_dir, train_dir=tmp_path / "run", store_dir=store_dir,
               out_dir=tmp_path / "draft", tracker=tracker)
    run = mlflow_store.get_run(result.run_id)
    assert {"eval/simulated_acc_len", "eval/measured_acc_len"} <= run.data.metrics.keys()
    assert run.data.tags["draftlab.export"] == str(tmp_path / "draft")
    cfg = json.loads((tmp_path / "draft" / "config.json").read_text())
    assert len(cfg["eagle_aux_hidden_state_layer_ids"]) == 3
    assert cfg["speculators_config"]["verifier"]["name_or_path"]


def test_step_limited_calibration_is_accounted_timed_marked_and_refused_by_export(built, tmp_path, mlflow_store):
    """epochs 2 + max_steps N: N steps, one epoch boundary, 1 step (draftlab.training.compat's pin), checked
    by the accounting; its timing/* metrics are a cost-model point `plan` and the sweep read back."""
    from draftlab.params import ParamsError
    from draftlab.plan import costmodel
    from draftlab.plan import inputs as plan_inputs
    from draftlab.stages import export

    params = _train_params(built, epochs=2, max_steps=4)
    result = _run(params, built, tmp_path / "run")
    assert result.total_steps == 5
    check = json.loads((tmp_path / "run" / "accounting-check.json").read_text())
    assert check == {"problems": [], "observed_steps": 5}
    run = mlflow_store.get_run(result.run_id)
    assert run.data.tags["draftlab.calibration"] == "true" and run.data.tags["draftlab.accounting"] == "verified"
    steps = [m.step for m in mlflow_store.get_metric_history(result.run_id, "train/loss")]
    assert steps == list(range(5))
    m = run.data.metrics
    assert m["timing/steps"] == 5 and m["timing/epochs"] == 2 and m["timing/step_s"] > 0
    assert m["timing/epoch_s"] >= 0
    train_json = RunDir(tmp_path / "run").train.read()
    assert train_json.calibration is True
    # one name, one span: wall_clock_s is the plan's span (process start to the run's end) in
    # train.json, the stage's result, MLflow and the cost model's timing; torchrun's is shorter
    assert train_json.wall_clock_s == pytest.approx(m["timing/wall_s"], abs=0.01)
    assert result.wall_clock_s == pytest.approx(m["perf/run_wall_clock_s"]) == pytest.approx(m["timing/wall_s"])
    assert train_json.torchrun_wall_s == pytest.approx(m["perf/torchrun_wall_s"], abs=0.01)
    assert 0 < train_json.torchrun_wall_s < train_json.wall_clock_s

    points, note = plan_inputs.measured_points(params, built[3], built[1])
    assert set(points) == {1} and "(calibration," in points[1].source, note
    # the point reproduces its own run, to the run's end (closed just after timing/* was logged)
    closing = run.info.end_time / 1000 - m["timing/ended_at"]
    assert 0 <= closing < 30
    assert points[1].train_s(5, 2) == pytest.approx(m["timing/wall_s"] + closing)
    assert costmodel.nearest(points, 2)[0] is points[1]

    _, target_dir, _, store_dir = built
    with pytest.raises(ParamsError, match="calibration"):
        export.run(params, target_dir=target_dir, train_dir=tmp_path / "run", store_dir=store_dir,
                   out_dir=tmp_path / "draft")
    assert not (tmp_path / "draft").exists()
