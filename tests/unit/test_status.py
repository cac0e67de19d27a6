"""`draftlab status` on run folders made of the records a training writes, and on the study of a
simulated sweep (a real Optuna journal); the live verdict's window and its go/no-go line."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from draftlab import status as st
from draftlab.cli import app
from draftlab.rundir import Failure, Progress, RankPlan, RunDir, RunState
from tests.conftest import RecordingTracker


def _run_folder(path: Path, *, step=9, total=21, convergence="learning") -> RunDir:
    rd = RunDir(path)
    path.mkdir(parents=True)
    rd.run.write(RunState(key="k", run_id="abc123"))
    rd.plan.write(RankPlan(total_steps=total))
    rd.progress.write(Progress(step=step, total_steps=total, epoch=1, updated_at=time.time(), eta_s=120.0,
                               eta_p10_s=100.0, eta_p90_s=150.0,
                               losses={"loss_0": 0.5, "loss_1": 0.6, "loss": 1.1}, convergence=convergence,
                               trend={"step": step, "state": convergence, "window": 5, "overall_change": -0.18,
                                      "positions": {"loss_0": {"change": -0.2, "trend": convergence}}},
                               experiment_id="7"))
    ck = path / "checkpoints" / "0"
    ck.mkdir(parents=True)
    (ck / "training_state.json").write_text(json.dumps({"epoch": 0, "local_step": 0, "global_step": 7}))
    (ck / "model.safetensors").write_bytes(b"x")
    return rd


def test_a_killed_run_is_stale_with_its_progress_checkpoint_and_link(tmp_path):
    rd = _run_folder(tmp_path / "run")
    info = st.status(rd.path)
    assert info["state"] == "stale", "launched, nothing alive, no end record"
    assert info["step"] == 10 and info["total_steps"] == 21 and info["epoch"] == 1
    assert info["losses"]["loss_0"] == 0.5 and info["convergence"]["trend"] == "learning"
    assert "eta" not in info, "no ETA for a run that is not running"
    assert info["checkpoint"]["global_step"] == 7 and info["checkpoint"]["age_s"] >= 0
    assert info["mlflow"]["run_id"] == "abc123" and "/experiments/7/runs/abc123" in info["mlflow"]["ui"]
    assert info["tracking"] == {"spooling": False, "records_waiting": 0}


def test_a_running_run_has_its_eta_counted_down_from_the_last_write(tmp_path):
    rd = _run_folder(tmp_path / "run")
    fd = os.open(rd.lock_path(), os.O_CREAT | os.O_RDWR)
    import fcntl

    fcntl.flock(fd, fcntl.LOCK_EX)  # as the launcher holds it
    try:
        info = st.status(rd.path)
    finally:
        os.close(fd)
    assert info["state"] == "running"
    assert 0 < info["eta"]["s"] <= 120.0 and info["eta"]["p10_s"] <= info["eta"]["s"] <= info["eta"]["p90_s"]


def test_a_diverged_run_says_why_and_the_spool_counts_what_waits(tmp_path):
    rd = _run_folder(tmp_path / "run", convergence="learning")
    rd.failure.write(Failure(reason="diverged", message="train/loss_0 is nan at global step 9 (epoch 1)"))
    rd.spool_path.write_text('{"a": 1}\n{"b": 2}\n{"c": 3}\n')
    info = st.status(rd.path)
    assert info["state"] == "diverged" and "is nan at global step 9" in info["why"]
    assert info["convergence"]["trend"] == "diverged"
    assert info["tracking"]["spooling"] and info["tracking"]["records_waiting"] == 3
    assert info["tracking"]["upload"] == f"draftlab tracking-import {rd.spool_path}"


def test_cli_json_is_one_object_and_bad_paths_are_one_line_exit_2(tmp_path):
    rd = _run_folder(tmp_path / "run")
    runner = CliRunner()
    res = runner.invoke(app, ["status", str(rd.path), "--json"])
    assert res.exit_code == 0 and json.loads(res.stdout)["state"] == "stale"
    res = runner.invoke(app, ["status", str(rd.path)])
    assert res.exit_code == 0 and "stale" in res.stdout and "abc123" in res.stdout
    for bad, needle in ((tmp_path / "nowhere", "not found"), (tmp_path, "not a run folder")):
        res = runner.invoke(app, ["status", str(bad)])
        assert res.exit_code == 2 and needle in res.output and len(res.output.strip().splitlines()) <= 2
    journal = tmp_path / "study"
    journal.mkdir()
    (journal / "journal.log").write_text("not a journal\n")
    res = runner.invoke(app, ["status", str(journal)])
    assert res.exit_code == 2 and "journal.log" in res.output


def test_a_run_folder_without_progress_json_reads_the_last_step_from_its_end(tmp_path):
    rd = RunDir(tmp_path / "old")
    rd.path.mkdir()
    rd.run.write(RunState(key="k", run_id="r"))
    lines = [json.dumps({"step": s, "epoch": s // 10, "train/loss": 3.0 - s * 0.001, "train/loss_0": 1.0})
             for s in range(5000)]
    rd.step_metrics_path.write_text("\n".join(lines) + '\n{"step": 5000, "tor')  # torn by a kill
    info = st.status(rd.path)
    assert info["step"] == 5000 and info["epoch"] == 499 and info["losses"]["loss"] == pytest.approx(3.0 - 4.999)


def test_status_of_a_study_after_a_short_simulated_sweep(tmp_path):
    from tests.sweep_sim import FakeClock, SimLauncher, make_spec, make_worker, run_to_end

    clock = FakeClock()
    spec = make_spec(tmp_path, budget=900, space={"train.epochs": {"choices": [1, 2]}, "train.gpus": {"choices": [1]},
                                                  "train.lr": {"low": 1e-3, "high": 1e-2, "log": True}})
    w = make_worker(tmp_path, spec, clock, SimLauncher(clock), devices=("cpu0",), n_trials=4)
    w.study.set_user_attr("draftlab.budget_s", spec.budget_s)  # as `draftlab sweep` records it
    run_to_end(w, clock)
    info = st.status(tmp_path)  # the folder holding the study's journal.log
    trials = w.study.get_trials()
    done = [t for t in trials if t.user_attrs.get("status") == "completed"]
    assert info["kind"] == "study" and info["study"] == "sim"
    assert info["trials"]["completed"] == len(done) > 0
    assert info["budget"]["budget_s"] == 900 and 0 < info["budget"]["spent_s"] <= 900 + 60
    assert info["budget"]["left_s"] == pytest.approx(max(900 - info["budget"]["spent_s"], 0), abs=0.2)
    best = max(done, key=lambda t: t.value)
    assert info["best"]["number"] == best.number and info["best"]["params"] == best.params
    text = CliRunner().invoke(app, ["status", str(tmp_path)]).stdout
    assert f"{len(done)} completed" in text and f"trial {best.number}" in text


# ---------------------------------------------------------------- the live verdict


def test_the_go_no_go_line_has_the_trend_the_bottleneck_and_the_eta():
    from draftlab.observe.live import go_no_go

    p = Progress(step=3544, total_steps=177_230, updated_at=0.0, eta_s=34.6 * 3600, eta_p10_s=33.9 * 3600,
                 eta_p90_s=35.2 * 3600, convergence="learning", trend={"overall_change": -0.18})
    assert go_no_go(p, "compute-bound") == "train: 2% — learning (loss −18% since warmup), compute-bound, ETA 34.6 h (33.9–35.2 h)"


def test_a_live_window_goes_to_mlflow_and_the_run_folder(tmp_path):
    from types import SimpleNamespace

    from draftlab.observe.live import TAG, LiveVerdict
    from draftlab.observe.telemetry import Sample

    rd = RunDir(tmp_path)
    prof = rd.profile_file(0)
    prof.parent.mkdir(parents=True)
    now = time.time()
    recs = [{"t": now + i, "rank": 0, "step": i, "fetch_ms": 80.0, "fwd_ms": 5.0, "bwd_ms": 10.0, "opt_ms": 5.0,
             "step_ms": 100.0, "fetch_frac": 0.8} for i in range(10)]
    prof.write_text("".join(json.dumps(r) + "\n" for r in recs) + '{"t": 1, "rank"')  # a line being written
    samples = [Sample(t=now + i, disk_read_mb_s=1.0, disk_busy_pct=2.0, cpu_busy_pct=30.0, cpu_idle_pct=70.0,
                      cpu_iowait_pct=0.0, process_rss_mb=1.0, process_cpu_cores=0.5, shm_used_mb=None) for i in range(5)]
    tracker = RecordingTracker()
    live = LiveVerdict(SimpleNamespace(samples=samples), tmp_path, tracker, window_s=60)
    rec = live.window()
    assert rec["label"].startswith("data-bound") and rec["last_step"] == 9
    assert tracker.tags[TAG] == rec["label"]
    assert any(step == 9 and m["bottleneck/data_wait_frac"] == pytest.approx(0.8) for step, m in tracker.metrics)
    assert json.loads(RunDir(tmp_path).live_verdict_path.read_text())["label"] == rec["label"]
    assert live.window() is None, "nothing new: no window"
    info = st.run_status(_with_run(tmp_path))
    assert info["bottleneck"]["label"] == rec["label"]


def test_an_online_runs_wait_is_named_as_the_vllm_forward_not_decode(tmp_path):
    """The same loader-bound step records: from a store they are the disk or the CPUs; from a live
    vLLM (train.source: vllm) the verdict, live and in `draftlab status`, names the server's forward."""
    from types import SimpleNamespace

    from draftlab.observe.live import LiveVerdict
    from draftlab.observe.telemetry import Sample
    from draftlab.store.hidden_states import StoreSource, VllmSource

    rd = RunDir(tmp_path)
    prof = rd.profile_file(0)
    prof.parent.mkdir(parents=True)
    now = time.time()
    prof.write_text("".join(json.dumps({"t": now + i, "rank": 0, "step": i, "fetch_ms": 400.0, "fwd_ms": 50.0,
                                        "bwd_ms": 100.0, "opt_ms": 10.0, "step_ms": 560.0}) + "\n" for i in range(10)))
    samples = [Sample(t=now + i, disk_read_mb_s=0.5, disk_busy_pct=1.0, cpu_busy_pct=97.0, cpu_idle_pct=3.0,
                      cpu_iowait_pct=0.0, process_rss_mb=1.0, process_cpu_cores=1.5, shm_used_mb=None)
               for i in range(5)]
    assert StoreSource(tmp_path / "store", dtype="bfloat16").describe_wait() is None, "a store: disk and CPU decide"
    online = VllmSource(model="target", layer_ids=[1, 2, 3], exchange_dir=tmp_path / ".vllm-train",
                        endpoint="http://127.0.0.1:8123/v1")
    live = LiveVerdict(SimpleNamespace(samples=samples), tmp_path, RecordingTracker(), window_s=60, device="cpu",
                       wait=online.describe_wait())
    rec = live.window()
    assert rec["label"] == "data-bound (vLLM)"
    assert "target's forward in vLLM" in rec["evidence"]["why"] and "decode" not in rec["label"]
    assert "train.num_workers" in rec["remedy"] and "draftlab plan" in rec["remedy"]
    shown = st.run_status(_with_run(tmp_path))["bottleneck"]
    assert shown["label"] == "data-bound (vLLM)" and "offline" not in shown["label"]


def _with_run(path: Path) -> Path:
    RunDir(path).run.write(RunState(key="k", run_id="r"))
    return path


def test_json_of_a_diverged_run_is_strict_json(tmp_path):
    rd = _run_folder(tmp_path / "run")
    rd.failure.write(Failure(reason="diverged", message="train/loss_0 is nan at global step 9 (epoch 1)"))
    prog = rd.progress.read()
    rd.progress.write(prog.model_copy(update={"losses": {"loss_0": float("nan"), "loss": float("inf")}}))
    res = CliRunner().invoke(app, ["status", str(rd.path), "--json"])
    info = json.loads(res.stdout, parse_constant=lambda c: pytest.fail(f"{c} is not JSON"))
    assert info["losses"] == {"loss_0": "nan", "loss": "inf"}
