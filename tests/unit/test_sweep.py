"""Budget logic of `draftlab sweep` on a real Optuna journal storage, with simulated trial
durations and an injected clock: prediction, rejection before start, the cap guard, pruning,
device packing, resume after a dead worker, and two workers sharing one budget."""

from __future__ import annotations

import pytest

from draftlab.plan.costmodel import CostModel, Point
from draftlab.sweep.budget import STALE_AFTER_S, Outcome, point_from_outcome, steps_from_lengths, union_s
from draftlab.sweep.propose import rejected
from draftlab.sweep.report import pareto_front, trial_rows
from draftlab.sweep.space import SpaceError, check_spec, parse_duration, read_spec
from draftlab.plan.sampler import steps_under_max_steps
from tests.sweep_sim import (
    BASE,
    GRACE,
    POLL,
    FakeClock,
    SimLauncher,
    dead_pid,
    make_spec,
    make_worker,
    run_side_by_side,
    run_to_end,
    sim_duration,
    sim_steps,
)


def statuses(study):
    return [t.user_attrs.get("status") for t in study.get_trials()]


# ---------------------------------------------------------------- the space file


@pytest.mark.parametrize("over, needle", [
    ({"space": {}}, "space: empty"),
    ({"space": {"train.lr": {"low": 0.0, "high": 0.01}}}, "space.train.lr = 0.0"),
    ({"space": {"train.gpus": {"choices": [1, 4]}}}, "space.train.gpus: 4 exceeds the 2 device slot(s)"),
    ({"space": {"train.gpus": {"low": 1, "high": 2}}}, "space.train.gpus: declare choices"),
    ({"space": {"prepare.num_samples": {"choices": [10, 20]}}}, "space.prepare.num_samples: only train.* keys"),
    ({"space": {"train.epoch": {"low": 1, "high": 2}}}, "space.train.epoch: not a params key"),
    ({"budget": 300}, "budget: 300 s is shorter than the calibration itself"),
])
def test_bad_spaces_fail_with_one_line_naming_the_key(tmp_path, over, needle):
    spec = make_spec(tmp_path, **over)
    with pytest.raises(SpaceError) as err:
        check_spec(spec, BASE, num_devices=2)
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_space_file_errors_and_durations(tmp_path):
    assert parse_duration("1h30m", "budget") == 5400 and parse_duration("24h", "b") == 86400
    assert parse_duration(90, "b") == 90 and parse_duration("300", "b") == 300  # --budget 300: seconds
    for bad in ("soon", "0s", "-5"):
        with pytest.raises(SpaceError, match="budget"):
            parse_duration(bad, "budget")
    p = tmp_path / "s.yaml"
    p.write_text("study: x\nbudget: 1h\nspace: {train.lr: {low: 0.01, high: 0.001}}\n")
    with pytest.raises(SpaceError, match="low 0.01 is above high 0.001"):
        read_spec(p)
    p.write_text("study: x\nbudget: 1h\nspace: {train.lr: {low: 0.001, high: 0.01}}\n")
    assert read_spec(p, budget="2h").budget_s == 7200  # a flag overrides the file


def test_cli_bad_space_exits_2_with_one_line_and_writes_nothing(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from draftlab.cli import app

    monkeypatch.chdir(tmp_path)
    (tmp_path / "params.yaml").write_text("train: {gpus: 1}\n")
    (tmp_path / "data" / "prepared").mkdir(parents=True)
    (tmp_path / "data" / "hidden_states").mkdir(parents=True)
    (tmp_path / "data" / "hidden_states" / "manifest.json").write_text("{}")
    (tmp_path / "space.yaml").write_text("study: s\nbudget: 1h\ndevices: 2\nspace:\n  train.lr: {low: -1, high: 0.01}\n")
    result = CliRunner().invoke(app, ["sweep", "space.yaml"])
    assert result.exit_code == 2
    assert "space.train.lr = -1" in result.output and len(result.output.strip().splitlines()) == 1
    assert not (tmp_path / "runs").exists(), "nothing is created for a rejected space"


@pytest.mark.parametrize("train, needle", [
    # each trial would start its own server and load the target again: refused, before anything is written
    ("{source: vllm, gpus: 1}", "train.source is vllm without train.vllm_url"),
    # one server the trials share: no store needed, and that server is asked once, before any trial
    ("{source: vllm, vllm_url: 'http://127.0.0.1:9/v1', gpus: 1}", "train.vllm_url: http://127.0.0.1:9/v1/models "
                                                                  "does not answer"),
])
def test_an_online_sweep_shares_the_users_server_or_is_refused_in_one_line(tmp_path, monkeypatch, train, needle):
    from typer.testing import CliRunner

    from draftlab import paths
    from draftlab.cli import app

    monkeypatch.chdir(tmp_path)
    (tmp_path / "params.yaml").write_text(f"train: {train}\n")
    (tmp_path / "data" / "prepared").mkdir(parents=True)  # no hidden-state store: online reads none
    (tmp_path / paths.TARGET).mkdir(parents=True)
    (tmp_path / paths.TARGET / "config.json").write_text('{"model_type": "llama", "num_hidden_layers": 8}')
    (tmp_path / "space.yaml").write_text("study: s\nbudget: 1h\ndevices: 1\n"
                                         "space:\n  train.lr: {low: 0.0001, high: 0.01}\n")
    result = CliRunner().invoke(app, ["sweep", "space.yaml"])
    assert result.exit_code == 2, result.output
    assert needle in result.output and len(result.output.strip().splitlines()) == 1, result.output
    assert "hidden-state store" not in result.output
    assert not (tmp_path / "runs").exists(), "nothing is created for a refused sweep"


def test_the_source_is_not_a_sweep_dimension(tmp_path):
    spec = make_spec(tmp_path, space={"train.source": {"choices": ["store", "vllm"]}})
    with pytest.raises(SpaceError, match="space.train.source: every trial reads the same hidden states"):
        check_spec(spec, BASE, num_devices=2)


# ---------------------------------------------------------------- cost model and budget arithmetic


def test_union_counts_overlapping_worker_spans_once():
    assert union_s([(0, 10), (5, 15), (20, 30)]) == 25
    assert union_s([(0, 10), (0, 10)]) == 10
    assert union_s([]) == 0


def test_prediction_uses_the_packing_sampler_and_the_calibrated_costs():
    from draftlab.plan import steps as plan_steps

    lengths = [50 + (i * 37) % 400 for i in range(101)]
    steps = steps_from_lengths(lengths)
    p1 = BASE.model_copy(update={"train": BASE.train.model_copy(update={"epochs": 3, "total_seq_len": 512})})
    p2 = p1.model_copy(update={"train": p1.train.model_copy(update={"gpus": 2})})
    one_epoch = plan_steps.plan_from_lengths(lengths, total_seq_len=512, world_size=1, epochs=1, exact=False)
    assert steps(p1) == 3 * one_epoch.central_total_steps
    assert steps(p2) < steps(p1), "two ranks shard the data: fewer global steps"
    point = Point(1, fixed_s=30, step_s=0.5, epoch_s=4, tokens_per_s=900, steps=10, epochs=1, wall_s=39, trial=0)
    pred = CostModel({1: point}, steps).predict(p1)
    assert pred.wall_s == pytest.approx(30 + steps(p1) * 0.5 + 2 * 4)
    scaled = CostModel({1: point}, steps).predict(p2)
    assert "s/step held" in scaled.basis and scaled.wall_s < pred.wall_s


def test_calibration_point_reproduces_the_calibration_trial():
    out = Outcome(True, None, wall_s=110.0, timing={"steps": 20, "epochs": 2, "step_s": 2.0, "epoch_s": 5.0,
                                                     "tokens_per_s": 800, "wall_s": 100.0})
    p = point_from_outcome(1, 0, out)
    assert p.fixed_s == pytest.approx(55.0) and p.after_s == pytest.approx(10.0)  # evaluate after training
    base1 = BASE.model_copy(update={"train": BASE.train.model_copy(update={"epochs": 2})})
    assert CostModel({1: p}, lambda params: 20).predict(base1).wall_s == pytest.approx(110.0)


def test_scaling_efficiency_is_logged_per_gpu_count():
    pts = {n: Point(n, 10, 1, 1, tps, 10, 1, 30, n) for n, tps in ((1, 1000.0), (2, 1800.0), (4, 3000.0))}
    eff = CostModel(pts, lambda p: 1).scaling_efficiency()
    assert eff == pytest.approx({1: 1.0, 2: 0.9, 4: 0.75})


def test_pareto_front_keeps_only_undominated_trials():
    rows = [{"number": i, "status": "completed", "gpu_hours": h, "value": v}
            for i, (h, v) in enumerate([(1, 1.2), (2, 1.1), (2, 1.5), (4, 1.6), (3, 1.4)])]
    rows.append({"number": 9, "status": "rejected", "gpu_hours": None, "value": None})
    assert [r["number"] for r in pareto_front(rows, maximize=True)] == [0, 2, 3]


# ---------------------------------------------------------------- the sweep loop, simulated


def test_calibrates_each_gpu_count_then_predicts_within_the_margin(tmp_path):
    clock = FakeClock()
    launcher = SimLauncher(clock)
    w = make_worker(tmp_path, make_spec(tmp_path), clock, launcher)
    run_to_end(w, clock)
    trials = w.study.get_trials()
    cal = [t for t in trials if t.user_attrs.get("role") == "calibration"]
    assert sorted(t.user_attrs["gpus"] for t in cal) == [1, 2]
    assert all(t.params["train.lr"] == pytest.approx(3e-3) for t in cal)
    # step-limited: epochs 2, max_steps 20 (20 steps, one boundary, 1 step); timing, never a completed trial
    ran = {spec.number: spec for spec, _, _ in launcher.started}
    assert all((ran[t.number].params.train.epochs, ran[t.number].params.train.max_steps) == (2, 20) for t in cal)
    assert all(sim_steps(ran[t.number].params) == 21 for t in cal)
    assert all(t.state.name == "FAIL" and t.user_attrs["status"] == "calibration" and t.value is None for t in cal)
    assert set(w.calibration()) == {1, 2}
    for t in trials:
        if t.user_attrs.get("role") == "search" and t.user_attrs.get("status") == "completed":
            assert t.user_attrs["predicted_s"] == pytest.approx(t.user_attrs["wall_s"], abs=0.2)
            assert t.user_attrs["resolved_lr"] == pytest.approx(t.params["train.lr"])


def test_never_over_budget_rejects_what_cannot_fit_before_it_starts(tmp_path):
    clock = FakeClock()
    launcher = SimLauncher(clock)
    spec = make_spec(tmp_path, budget=900)
    w = make_worker(tmp_path, spec, clock, launcher)
    t0 = clock.now()
    run_to_end(w, clock)
    assert clock.now() - t0 <= 900 + GRACE + 2 * POLL
    assert w.ledger.spent_s() == pytest.approx(clock.now() - t0)
    refused = rejected(w.study)
    assert refused, "late proposals that cannot finish are rejected"
    started_numbers = {s.number for s, _, _ in launcher.started}
    assert {t.number for t in w.study.get_trials()} == started_numbers, \
        "a rejected proposal costs nothing: never launched, and never a trial of the study"
    for r in refused:
        assert "does not fit the budget" in r["reason"] or "cap" in r["reason"]
        assert r["predicted_s"] > 0
    for spec_, start, h in launcher.started:  # every launched trial ends before budget + grace
        end = start + (h.killed_at - h.start if h.killed_at else h.duration)
        assert end - t0 <= 900 + GRACE + 2 * POLL


def test_a_trial_that_overruns_its_cap_is_stopped_then_killed(tmp_path):
    clock = FakeClock()

    def slow_at_high_lr(params):  # the cost model cannot know: this one runs 5x longer than calibrated
        return sim_duration(params) * (5 if params.train.lr > 5e-3 else 1)

    launcher = SimLauncher(clock, duration=slow_at_high_lr, honors_sigterm=False)
    spec = make_spec(tmp_path, budget=2000, trial_cap="150s",
                     space={"train.epochs": {"choices": [1]}, "train.lr": {"choices": [3e-3, 8e-3]},
                            "train.gpus": {"choices": [1]}})
    w = make_worker(tmp_path, spec, clock, launcher, n_trials=4)
    run_to_end(w, clock)
    stopped = [t for t in w.study.get_trials() if t.user_attrs.get("status") == "stopped-cap"]
    assert stopped, statuses(w.study)
    for t in stopped:
        h = next(h for s, _, h in launcher.started if s.number == t.number)
        assert h.terminated_at - h.start == pytest.approx(150, abs=POLL), "SIGTERM at the cap"
        assert h.killed_at - h.terminated_at == pytest.approx(GRACE, abs=POLL), "SIGKILL after the stated grace"
        assert t.state.name == "PRUNED"
        assert t.user_attrs["run_id"] == f"run{t.number}", "a stopped trial keeps its MLflow run"


def test_pruner_stops_trials_whose_epochs_fall_behind(tmp_path):
    clock = FakeClock()
    launcher = SimLauncher(clock, epoch_value=lambda p, e: (0.1 if p.train.lr > 5e-3 else 1.0) + 0.01 * e)
    spec = make_spec(tmp_path, budget=5000, pruner={"kind": "median", "startup_trials": 2, "warmup_epochs": 0},
                     space={"train.epochs": {"choices": [4]}, "train.lr": {"choices": [2e-3, 9e-3]},
                            "train.gpus": {"choices": [1]}}, calibration={"steps": 20, "max_s": 400})
    w = make_worker(tmp_path, spec, clock, launcher, devices=("cpu0",), n_trials=7)
    order = [2e-3, 2e-3, 9e-3, 2e-3, 9e-3, 9e-3]  # two good ones complete first: the median to beat
    w.start()  # queues the calibration first
    for lr in order:
        w.study.enqueue_trial({"train.epochs": 4, "train.lr": lr, "train.gpus": 1})
    while not w.step():
        clock.sleep(POLL)
    search = [t for t in w.study.get_trials() if t.user_attrs.get("role") == "search"]
    assert [t.params["train.lr"] for t in search] == order
    assert [t.user_attrs["status"] for t in search] == ["completed", "completed", "pruned", "completed", "pruned",
                                                        "pruned"]
    pruned = [t for t in search if t.user_attrs["status"] == "pruned"]
    assert all(t.user_attrs["run_id"] == f"run{t.number}" for t in pruned), "a pruned trial keeps its MLflow run"
    for t in pruned:
        h = next(h for s, _, h in launcher.started if s.number == t.number)
        assert h.terminated_at - h.start < h.duration, "stopped before it would have finished"


def test_trials_pack_onto_disjoint_device_slots(tmp_path):
    clock = FakeClock()
    launcher = SimLauncher(clock)
    spec = make_spec(tmp_path, budget=3000, space={"train.epochs": {"low": 1, "high": 2}, "train.gpus": {"choices": [1, 2]}})
    w = make_worker(tmp_path, spec, clock, launcher, devices=("0", "1", "2"), n_trials=10)
    run_to_end(w, clock)
    assert launcher.max_concurrent() >= 2, "a 3-slot worker runs trials side by side"
    for s, _, _ in launcher.started:
        assert len(s.devices) == s.params.train.gpus, "a trial gets as many slots as its GPU count"
    spans = [(t, t + (h.killed_at or h.start + h.duration) - h.start, set(s.devices)) for s, t, h in launcher.started]
    for i, (a0, a1, da) in enumerate(spans):
        for b0, b1, db in spans[i + 1:]:
            if a0 < b1 and b0 < a1:
                assert not (da & db), "overlapping trials never share a device"


def test_resume_after_kill9_marks_the_orphan_failed_and_does_not_redo_or_recount(tmp_path):
    clock = FakeClock()
    launcher = SimLauncher(clock)
    spec = make_spec(tmp_path, budget=900)
    a = make_worker(tmp_path, spec, clock, launcher, pid=dead_pid())  # its pid is gone: a kill -9 victim
    a.start()
    while len([t for t in a.study.get_trials() if t.state.name == "COMPLETE"]) < 3 or not a.running:
        a.step()
        clock.sleep(POLL)
    orphan = a.running[0].trial.number
    done_before = {t.number for t in a.study.get_trials() if t.state.name == "COMPLETE"}
    spent_a = a.ledger.spent_s()
    a.ledger.beat(force=True)
    clock.sleep(600)  # the machine is down for 10 minutes: not the sweep's time

    b = make_worker(tmp_path, spec, clock, launcher)
    started_before = len(launcher.started)
    b.start()
    t = b.study.get_trials()[orphan]
    assert t.state.name == "FAIL" and t.user_attrs["status"] == "interrupted"
    assert t.user_attrs["run_id"] == f"run{orphan}", "the orphan keeps its MLflow run id"
    assert launcher.reaped and launcher.reaped[0][0] == f"trial-{orphan:04d}" and launcher.reaped[0][1] == [10_000 + orphan]
    assert b.ledger.spent_s() == pytest.approx(spent_a), "the downtime is not spent budget, the past is counted once"
    run_to_end(b, clock)
    relaunched = {s.number for s, _, _ in launcher.started[started_before:]}
    assert not (relaunched & done_before), "completed trials are not redone"
    assert not any(s.role == "calibration" for s, _, _ in launcher.started[started_before:]), "calibration is cached"
    assert b.ledger.spent_s() <= 900 + GRACE + 2 * POLL


def test_two_workers_share_one_budget(tmp_path):
    clock = FakeClock()
    launcher = SimLauncher(clock)
    spec = make_spec(tmp_path, budget=1200, space={"train.epochs": {"low": 1, "high": 3},
                                                    "train.gpus": {"choices": [1, 2]}})
    a = make_worker(tmp_path, spec, clock, launcher, host="hostA", devices=("0", "1"))
    a.start()
    for _ in range(300):  # worker B joins 300 s later, on another host, same storage
        a.step()
        clock.sleep(POLL)
    b = make_worker(tmp_path, spec, clock, launcher, host="hostB", devices=("0", "1"))
    b.start()
    t0 = clock.now() - 300
    run_side_by_side((a, b), clock)
    end = clock.now() - t0
    assert end <= 1200 + GRACE + 3 * POLL, "B stops at the shared budget, not 1200 s after it joined"
    assert a.ledger.spent_s() == pytest.approx(b.ledger.spent_s(), abs=STALE_AFTER_S)
    assert len({s.number for s, _, _ in launcher.started}) == len(launcher.started), "no trial runs twice"
    assert not [t for t in a.study.get_trials() if t.user_attrs.get("role") == "calibration"
                and t.user_attrs.get("worker") == b.worker_id], "B reuses A's calibration"
    hosts = {t.user_attrs.get("worker") for t in a.study.get_trials() if t.user_attrs.get("status") == "completed"}
    assert len(hosts) == 2, "both workers ran trials"


def test_a_short_trial_backfills_free_slots_without_delaying_a_waiting_wider_one(tmp_path):
    clock = FakeClock()
    launcher = SimLauncher(clock)
    spec = make_spec(tmp_path, budget=5000)
    w = make_worker(tmp_path, spec, clock, launcher, n_trials=6)
    w.start()  # queues the two calibration trials first
    for epochs, gpus in ((4, 1), (2, 2), (1, 1), (4, 1)):  # A long 1-GPU, B 2-GPU, C short 1-GPU, D long 1-GPU
        w.study.enqueue_trial({"train.epochs": epochs, "train.lr": 3e-3, "train.gpus": gpus})
    for _ in range(100_000):
        if w.step():
            break
        clock.sleep(POLL)
    start = {s.number: t for s, t, _ in launcher.started}
    end = {s.number: t + h.duration for s, t, h in launcher.started}
    a, b, c, d = 2, 3, 4, 5
    assert start[c] < start[b], "C fits in the free slot and ends before A: it backfills"
    assert end[c] <= end[a]
    assert start[b] == pytest.approx(end[a], abs=2 * POLL), "B starts as soon as A frees its slot"
    assert start[d] >= start[b], "D would outlast A and delay B: it waits"


def test_per_epoch_values_are_indexed_by_epoch_not_global_step():
    """speculators logs val/*_epoch at the epoch's last global step (5, 10, 15): the pruner
    must compare trials epoch by epoch, whatever their GPU count's steps per epoch."""
    from types import SimpleNamespace

    from draftlab.sweep.trial import epoch_values

    history = {"val/full_acc_0_epoch": [(10, 0.5), (5, 0.3)], "val/full_acc_1_epoch": [(5, 0.1), (10, 0.2)],
               "val/loss_epoch": [(5, 3.0), (10, 2.5)]}
    client = SimpleNamespace(get_metric_history=lambda run_id, key: [SimpleNamespace(step=s, value=v)
                                                                     for s, v in history[key]])
    assert epoch_values(client, "r", "eval/simulated_acc_len", ttt_steps=2) == pytest.approx({0: 1.4, 1: 1.7})
    assert epoch_values(client, "r", "val/loss", ttt_steps=2) == {0: 3.0, 1: 2.5}


def test_an_unsettled_calibration_is_redone_with_twice_the_steps(tmp_path):
    clock = FakeClock()
    launcher = SimLauncher(clock, settled=lambda spec: (spec.params.train.max_steps or 40) >= 40)
    spec = make_spec(tmp_path, budget=900, space={"train.lr": {"low": 1e-3, "high": 1e-2, "log": True}})
    w = make_worker(tmp_path, spec, clock, launcher, n_trials=3)
    run_to_end(w, clock)
    cal = [s for s, _, _ in launcher.started if s.role == "calibration"]
    assert [s.params.train.max_steps for s in cal] == [20, 40]
    assert w.calibration()[1].steps == sum(steps_under_max_steps([40, 40], 40))  # the settled one is kept



def test_the_tiny_default_calibrates_once_per_gpu_count_and_completes_trials_in_6_minutes(tmp_path):
    """The tiny default's epochs hold 5 packed steps at 1 GPU and 3 at 2 (params.yaml: 144 train
    rows, 1,024-token packing): a calibration (epochs 2, max_steps 20) trains 10 or 6 steps, and
    the settled test over the last 10 step times (costmodel.settled) can never pass on them.
    Asking again with twice the steps would retrain the same steps until the budget is gone."""
    import math

    from draftlab.plan.costmodel import settled
    from tests.sweep_sim import EPOCH_S, FIXED, STEP_S

    per_epoch = {1: 5, 2: 3}

    def tiny_steps(params):
        t = params.train
        return sum(steps_under_max_steps([per_epoch[t.gpus]] * t.epochs, t.max_steps))

    def duration(params):
        return FIXED + tiny_steps(params) * STEP_S[params.train.gpus] + params.train.epochs * EPOCH_S

    def inner_intervals_settle(spec):  # the real rule on the step times such a run has (no boundary)
        t = spec.params.train
        ends = {sum([per_epoch[t.gpus]] * (i + 1)) - 1 for i in range(t.epochs)}
        inner = [1.0 for s in range(tiny_steps(spec.params) - 1) if s not in ends]
        return settled(inner)

    clock, lines = FakeClock(), []
    launcher = SimLauncher(clock, duration=duration, settled=inner_intervals_settle, steps=tiny_steps)
    spec = make_spec(tmp_path, budget="6m", safety_margin=0.1,
                     calibration={"steps": 20, "max_s": 75, "max_steps": 320})  # experiments/sweep-tiny.yaml's
    w = make_worker(tmp_path, spec, clock, launcher, steps_fn=tiny_steps, log=lines.append)
    run_to_end(w, clock)
    cal = [s.params.train.gpus for s, _, _ in launcher.started if s.role == "calibration"]
    assert sorted(cal) == [1, 2], f"one calibration per GPU count, not {cal}"
    assert statuses(w.study).count("completed") >= 1, lines
    assert w.calibration_spent_s() <= spec.calibration.budget_share * w.budget_s
    assert any("the epochs hold only 10 of the 20 steps asked" in line and "safety margin" in line for line in lines)
    assert not any("calibrating again" in line or "again with" in line for line in lines), lines
    launched = [line for line in lines if "(calibration) on" in line]
    assert launched and all("stopped if still running at" in line for line in launched), \
        "the deadline is not said as if it had happened"
    assert math.isclose(w.calibration_bound_s(), 0.4 * 360)


# ---------------------------------------------------------------- what the study and its report show


def test_the_study_holds_only_trials_that_ran_rejections_are_in_the_report(tmp_path):
    """optuna-dashboard draws a timeline bar for every finished trial: a proposal rejected before
    it starts is no trial of the study, only a row of trials.csv (no number, no state)."""
    import csv

    from draftlab.sweep.report import report

    clock = FakeClock()
    launcher = SimLauncher(clock)
    spec = make_spec(tmp_path, budget=900)
    w = make_worker(tmp_path, spec, clock, launcher)
    run_to_end(w, clock)
    assert w.study.metric_names == ["eval/simulated_acc_len"], "the dashboard names the objective"
    launched = {s.number: s for s, _, _ in launcher.started}
    assert {t.number for t in w.study.get_trials()} == set(launched)
    assert rejected(w.study), "the budget of 900 s rejects late proposals"
    summary = report(w.study, spec, tmp_path / "out", None, spent_s=w.ledger.spent_s(), budget_s=900, ended="x",
                     model_points={}, efficiency={})
    with open(tmp_path / "out" / "report" / "trials.csv") as f:
        rows = list(csv.DictReader(f))
    refused = [r for r in rows if r["status"] == "rejected"]
    assert len(refused) == len(rejected(w.study)) == summary["trials"]["rejected"]
    assert all(r["number"] == "" and r["state"] == "" and "does not fit" in r["reason"] for r in refused)
    ran = [r for r in rows if r["number"]]
    assert len(ran) == len(launched) and all(r["run_id"] == f"run{r['number']}" for r in ran), \
        "every trial that got an MLflow run has its id in trials.csv"


def test_a_calibration_over_its_cap_ends_the_sweep_with_nothing_left_running(tmp_path):
    """Seen under load: the 2-GPU calibration hit its cap while the 1-GPU one ran; the sweep
    ended with two trials RUNNING in its storage and 0 completed, exit 0."""
    from draftlab.sweep.loop import drive
    from draftlab.sweep.report import report

    clock = FakeClock()

    def calibrations_stall(params):  # a calibration is the step-limited training (max_steps)
        return 10_000.0 if params.train.max_steps else sim_duration(params)

    launcher = SimLauncher(clock, duration=calibrations_stall)
    spec = make_spec(tmp_path, budget=3000)
    w = make_worker(tmp_path, spec, clock, launcher, devices=("cpu0", "cpu1", "cpu2"))  # both calibrate at once
    ended = drive(w, poll_s=POLL)
    assert "did not finish within 200 s; raise calibration.max_s" in ended
    assert [s.role for s, _, _ in launcher.started] == ["calibration", "calibration"]
    assert not [t for t in w.study.get_trials() if t.state.name in ("RUNNING", "WAITING")], \
        "the other calibration is stopped at its cap too, not left RUNNING"
    assert sorted(t.user_attrs["status"] for t in w.study.get_trials()) == ["stopped-cap", "stopped-cap"]
    summary = report(w.study, spec, tmp_path / "out", None, spent_s=w.ledger.spent_s(), budget_s=3000, ended=ended,
                     model_points={}, efficiency={})
    assert summary["trials"]["completed"] == 0 and "best" not in summary


def test_an_interrupted_worker_leaves_no_trial_running(tmp_path):
    from draftlab.sweep.loop import drive

    clock = FakeClock()
    launcher = SimLauncher(clock)
    w = make_worker(tmp_path, make_spec(tmp_path, budget=3000), clock, launcher)

    def ctrl_c_once_a_search_trial_runs(worker):
        if any(r.spec.role == "search" for r in worker.running) and clock.now() - worker.running[-1].started > 30:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        drive(w, poll_s=POLL, on_tick=ctrl_c_once_a_search_trial_runs)
    trials = w.study.get_trials()
    assert not [t for t in trials if t.state.name in ("RUNNING", "WAITING")]
    stopped = [t for t in trials if t.user_attrs.get("status") == "interrupted"]
    assert stopped and all(t.state.name == "FAIL" and t.user_attrs["run_id"] for t in stopped)
    assert all(h.killed_at is not None for s, _, h in launcher.started if s.number in {t.number for t in stopped})


@pytest.mark.parametrize("summary, code", [({"trials": {"completed": 0}}, 1),
                                           ({"trials": {"completed": 1}, "best": {"trial": 3}}, 0)])
def test_cli_exits_non_zero_when_the_study_completed_nothing(tmp_path, monkeypatch, summary, code):
    from typer.testing import CliRunner

    from draftlab.cli import app
    from draftlab.sweep import study

    monkeypatch.chdir(tmp_path)
    (tmp_path / "params.yaml").write_text("train: {gpus: 1}\n")
    (tmp_path / "space.yaml").write_text("study: s\nbudget: 1h\nspace:\n  train.lr: {low: 0.001, high: 0.01}\n")
    monkeypatch.setattr(study, "run", lambda *a, **k: summary)
    assert CliRunner().invoke(app, ["sweep", "space.yaml"]).exit_code == code


def test_a_worker_notices_a_dead_peer_on_the_journal_while_it_runs(tmp_path):
    """Two workers on one host and journal: B dies (kill -9: its pid is gone, its trial's
    process would live on); A, still running, fails B's trial as interrupted and reaps it."""
    clock = FakeClock()
    launcher = SimLauncher(clock)
    spec = make_spec(tmp_path, budget=3000)
    a = make_worker(tmp_path, spec, clock, launcher, devices=("cpu0",))
    b = make_worker(tmp_path, spec, clock, launcher, devices=("cpu1",), pid=dead_pid())
    a.start()
    b.start()
    while not any(r.spec.role == "search" for r in b.running):
        a.step()
        b.step()
        clock.sleep(POLL)
    orphan = next(r.trial.number for r in b.running if r.spec.role == "search")
    for _ in range(int(spec.heartbeat_s / POLL) + 1):  # B is gone; A goes on
        a.step()
        clock.sleep(POLL)
    t = a.study.get_trials()[orphan]
    assert t.state.name == "FAIL" and t.user_attrs["status"] == "interrupted"
    assert f"trial-{orphan:04d}" in [name for name, _, _ in launcher.reaped]


@pytest.mark.parametrize("url, needle", [
    ("mysql://u:p@db/optuna", "storage: mysql:// is not supported; use postgresql://"),
    ("postgresql://u:Planted-Secret-7@127.0.0.1:1/optuna", "storage: cannot open 'postgresql://u:***@127.0.0.1:1/optuna'"),
])
def test_bad_storage_urls_fail_with_one_line(url, needle):
    """…and the line shows the URL without its password."""
    from draftlab.sweep.storage import StudyStorage

    with pytest.raises(SpaceError) as err:
        StudyStorage(url)
    assert needle in str(err.value) and "\n" not in str(err.value)
    assert "Planted-Secret-7" not in str(err.value)


def test_stale_after_must_outlast_two_heartbeats(tmp_path):
    with pytest.raises(SpaceError, match="stale_after_s \\(4\\) must be at least twice heartbeat_s \\(3\\)"):
        make_spec(tmp_path, heartbeat_s=3, stale_after_s=4)


def test_the_last_worker_to_end_is_the_one_that_ends_the_parent_run(tmp_path):
    from draftlab.sweep.budget import Ledger

    clock = FakeClock()
    w = make_worker(tmp_path, make_spec(tmp_path), clock, SimLauncher(clock))
    a = Ledger(w.study, "a", clock, host="h1", pid=1, devices=["0"])
    b = Ledger(w.study, "b", clock, host="h2", pid=1, devices=["0"])
    gone = Ledger(w.study, "gone", clock, host="h3", pid=1, devices=["0"])
    for ledger in (a, b, gone):
        ledger.beat(force=True)
    clock.sleep(STALE_AFTER_S + 1)  # "gone" died long ago: it holds nothing open
    a.beat(force=True)
    b.beat(force=True)
    a.end()
    assert a.others_running(), "b still runs: a leaves the parent run to it"
    b.end()
    assert not b.others_running(), "b is the last: it ends the parent run"


@pytest.mark.parametrize("settled_at", [20, 40], ids=["settled", "redone"])
def test_a_calibration_ends_only_once_its_point_or_its_redo_is_in_the_study(tmp_path, settled_at):
    """A peer that finds no live calibration and no point ends its sweep ("no calibration
    available"). So when a calibration trial ends, its point is already saved, or the redo with
    twice the steps already queued: a second worker on the same storage, checking between the two,
    must not conclude that the calibration failed (seen with two workers on PostgreSQL)."""
    from optuna.trial import TrialState

    from draftlab.sweep import calibration

    clock = FakeClock()
    launcher = SimLauncher(clock, settled=lambda spec: (spec.params.train.max_steps or 40) >= settled_at)
    spec = make_spec(tmp_path, budget=900, space={"train.lr": {"low": 1e-3, "high": 1e-2, "log": True}})
    w = make_worker(tmp_path, spec, clock, launcher, n_trials=2)
    ended = []
    tell = w.study.tell

    def tell_seen_by_a_peer(trial, *args, **kwargs):
        number = trial if isinstance(trial, int) else trial.number
        if w.study.trials[number].user_attrs.get("role") == "calibration":
            others_live = [t for t in w.study.get_trials(states=(TrialState.WAITING, TrialState.RUNNING))
                           if t.user_attrs.get("role") == "calibration" and t.number != number]
            ended.append(bool(calibration.points(w.study)) or bool(others_live))
        return tell(trial, *args, **kwargs)

    w.study.tell = tell_seen_by_a_peer
    run_to_end(w, clock)
    assert len(ended) == (1 if settled_at == 20 else 2), ended
    assert all(ended), "a calibration ended while its GPU count had neither a point nor a live calibration"
    assert statuses(w.study).count("completed") >= 1


def test_a_worker_killed_mid_append_leaves_the_journal_writable(tmp_path, monkeypatch):
    """`draftlab sweep --out sweeps` names the journal by a relative path in a subfolder. A worker
    killed -9 while it holds the journal's append lock must not stop the next one from writing:
    Optuna's default symlink lock, left behind there, is never forced (its link dangles) and every
    later append spins on it for good."""
    import os
    import signal
    import subprocess
    import sys

    import optuna

    from draftlab.sweep.storage import StudyStorage

    monkeypatch.chdir(tmp_path)
    rel = "sweeps/it/journal.log"
    optuna.create_study(study_name="it", storage=StudyStorage(rel).optuna)
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time\n"
        "from draftlab.sweep.storage import StudyStorage\n"
        f"StudyStorage({rel!r}).optuna._backend._lock.acquire()\n"
        "print('held', flush=True)\n"
        "time.sleep(600)\n")], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        os.kill(holder.pid, signal.SIGKILL)
    finally:
        holder.kill()
        holder.wait()
    # the next worker's append, in a process of its own so that a lock never freed fails the test
    # (after a bound far above any wait a freed lock can cause) instead of hanging the suite
    nxt = subprocess.run([sys.executable, "-c", (
        "import optuna\n"
        "from draftlab.sweep.storage import StudyStorage\n"
        "optuna.logging.set_verbosity(optuna.logging.ERROR)\n"
        f"study = optuna.load_study(study_name='it', storage=StudyStorage({rel!r}).optuna)\n"
        "study.tell(study.ask(), 1.0)\n"
        "print(len(study.trials))\n")], capture_output=True, text=True, timeout=240)
    assert nxt.returncode == 0 and nxt.stdout.strip() == "1", nxt.stderr
    assert not (tmp_path / "sweeps/it/journal.log.lock").exists(), "Optuna's symlink lock is not used"
