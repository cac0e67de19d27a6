"""draftlab.plan.costmodel: the one wall-clock model (plan, ETA, sweep) and its one MLflow lookup."""

from __future__ import annotations

import pytest

from draftlab.plan import costmodel as cm
from tests.conftest import tiny_params

BASE = tiny_params()


def test_a_point_reproduces_the_run_it_was_measured_on():
    timing = {"steps": 21, "epochs": 2, "step_s": 0.5, "epoch_s": 3.0, "tokens_per_s": 800.0, "wall_s": 60.0}
    p = cm.Point.from_timing(1, timing, source="calibration trial 0")
    assert p.fixed_s == pytest.approx(60 - 21 * 0.5 - 1 * 3.0)
    assert p.train_s(21, 2) == pytest.approx(60.0)
    assert p.train_s(200, 5) == pytest.approx(p.fixed_s + 200 * 0.5 + 4 * 3.0)


def test_step_timing_separates_steps_epoch_boundaries_and_start_up():
    # a calibration: 20 steps, an epoch boundary (validation + checkpoint: 3 s), 1 step
    ends, t = {}, 40.0  # 40 s of start-up before the first step ends
    for step in range(21):
        ends[step] = t
        t += 0.5 + (3.0 if step == 19 else 0.0)
    timing = cm.step_timing(ends, [20, 1], [100] * 21, wall_s=ends[20] + 5.0)
    assert timing["step_s"] == pytest.approx(0.5) and timing["epoch_s"] == pytest.approx(3.0)
    assert timing["steps"] == 21 and timing["epochs"] == 2 and timing["stable"]
    assert timing["tokens_per_s"] == pytest.approx(200.0)
    point = cm.Point.from_timing(1, timing)
    assert point.fixed_s == pytest.approx(40.0 - 0.5 + 5.0)  # before step 0 (whose 0.5 s is a step) and after the last


def test_settled_needs_the_median_of_the_last_ten_to_hold_within_two_percent():
    assert not cm.settled([0.5] * 10)  # too few to tell
    assert cm.settled([0.9, 0.8, 0.7] + [0.5] * 18)
    assert not cm.settled([0.5 + 0.02 * i for i in range(21)])  # still slowing down: 2.5 % per step


def test_cost_model_scales_from_the_nearest_count_holding_s_per_step():
    point = cm.Point(1, 30.0, 0.5, 4.0, 900.0, 21, 2, 44.5, source="calibration trial 0", after_s=10.0)
    p3 = BASE.model_copy(update={"train": BASE.train.model_copy(update={"epochs": 3})})
    p2 = p3.model_copy(update={"train": p3.train.model_copy(update={"gpus": 2})})
    model = cm.CostModel({1: point}, lambda p: 60 // p.train.gpus)
    pred = model.predict(p3)
    assert pred.wall_s == pytest.approx(30 + 60 * 0.5 + 2 * 4 + 10) and pred.point is point
    two = model.predict(p2)
    assert two.wall_s == pytest.approx(30 + 30 * 0.5 + 2 * 4 + 10) and "s/step held" in two.basis
    assert cm.CostModel({1: point}, lambda p: 60, with_after=False).predict(p3).wall_s == pytest.approx(68.0)


def test_one_lookup_finds_calibrations_and_finished_runs_with_the_same_rule(store_uri):
    import mlflow
    from mlflow.entities import Metric, Param, RunTag

    from draftlab.params import flatten
    from draftlab.tracking import param_str

    client = mlflow.MlflowClient(store_uri)
    exp = client.create_experiment("draftlab")
    timing = {"steps": 21, "epochs": 2, "step_s": 1.5, "epoch_s": 0.5, "tokens_per_s": 700.0, "wall_s": 80.0}

    def train_run(params, world_size, *, store="abc", device="cpu-x", finished=True, calibration=True,
                  after_s=None):
        rid = client.create_run(exp).info.run_id
        metrics = [Metric(f"timing/{k}", float(v), 0, 0) for k, v in timing.items()]
        if after_s is not None:
            metrics.append(Metric("timing/after_s", after_s, 0, 0))
        client.log_batch(rid, params=[Param(k, param_str(v)) for k, v in flatten(params).items()]
                         + [Param("world_size", str(world_size))],
                         tags=[RunTag("data.hidden_states_hash", store), RunTag("device.model", device),
                               RunTag("draftlab.calibration", str(calibration).lower())], metrics=metrics)
        if finished:
            client.set_terminated(rid, "FINISHED")
        return rid

    other_len = BASE.model_copy(update={"train": BASE.train.model_copy(update={"total_seq_len": 2048})})
    cal = train_run(BASE, 1, after_s=12.0)
    plain = train_run(BASE, 4, calibration=False)  # an ordinary training: also a measurement
    train_run(other_len, 2)  # another packing length: not this cost
    train_run(BASE, 2, store="other")  # another hidden-state store
    train_run(BASE, 2, device="gpu-y")  # another device model
    train_run(BASE, 2, finished=False)  # still running (or killed)
    found = cm.points_from_mlflow(BASE, [1, 2, 4], store_hash="abc", device_model="cpu-x", client=client)
    assert set(found) == {1, 4}
    assert found[1].source == f"mlflow run {cal} (calibration, cpu-x)" and found[1].after_s == 12.0
    assert found[4].source == f"mlflow run {plain} (cpu-x)" and found[4].after_s is None
    assert found[1].fixed_s == pytest.approx(80 - 21 * 1.5 - 1 * 0.5)
    assert found[1].measured_at > 0
    # plan on another host: no store, no device to match, every matching run counts
    assert set(cm.points_from_mlflow(BASE, client=client)) == {1, 2, 4}


def test_a_runs_tail_reaches_its_end_and_several_runs_are_kept_newest_first(tmp_path, store_uri):
    import time

    import mlflow
    from mlflow.entities import Metric, Param

    from draftlab.params import flatten
    from draftlab.tracking import param_str

    client = mlflow.MlflowClient(store_uri)
    exp = client.create_experiment("draftlab")
    ids = []
    for i, tail in enumerate((2.0, 4.0, 3.0)):
        rid = client.create_run(exp, start_time=int((time.time() + i) * 1000)).info.run_id
        logged_at = time.time()
        timing = {"steps": 21, "epochs": 2, "step_s": 1.5, "epoch_s": 0.5, "tokens_per_s": 700.0, "wall_s": 80.0,
                  "tail_s": tail, "ended_at": logged_at}
        client.log_batch(rid, params=[Param(k, param_str(v)) for k, v in flatten(BASE).items()]
                         + [Param("world_size", "1")], metrics=[Metric(f"timing/{k}", float(v), 0, 0)
                                                               for k, v in timing.items()])
        client.set_terminated(rid, "FINISHED", end_time=int((logged_at + 0.5) * 1000))  # closed 0.5 s later
        ids.append(rid)
    pts = cm.matching_points(BASE, [1], client=client, per_count=5)[1]
    assert [p.source.split()[2] for p in pts] == ids[::-1]
    assert [p.tail_s for p in pts] == pytest.approx([3.5, 4.5, 2.5], abs=0.01)
    assert [p.wall_s for p in pts] == pytest.approx([80.5] * 3, abs=0.01)
    assert cm.points_from_mlflow(BASE, [1], client=client)[1].source == pts[0].source


def test_a_steps_cost_is_the_mean_without_compile_outliers():
    skewed = [0.1] * 7 + [0.4] * 3  # under load: most steps quick, some stalled; their sum is 10 × the mean
    assert cm.typical_step_s(skewed) == pytest.approx(sum(skewed) / 10)
    assert cm.typical_step_s([30.0] + skewed) == pytest.approx(sum(skewed) / 10), "a compile step is start-up"


def test_the_plan_finds_online_runs_for_an_online_profile_and_store_runs_for_an_offline_one(
        store_uri, tmp_path, monkeypatch):
    """`draftlab plan` matches past runs by the identity of the hidden states `train.source` reads,
    as training recorded it (tag data.hidden_states_hash = source.identity()): an online profile
    finds the online runs of its target and layers, an offline one the store's runs, never the other."""
    import json

    import mlflow
    from mlflow.entities import Metric, Param, RunTag

    from draftlab.params import flatten
    from draftlab.plan.inputs import measured_points
    from draftlab.store.hidden_states import source_for
    from draftlab.tracking import param_str

    target = tmp_path / "target"  # the built tiny target, as far as its layers are concerned
    target.mkdir()
    tiny = BASE.target.tiny
    (target / "config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": tiny.num_layers,
                                                    "hidden_size": tiny.hidden_size}))
    online = BASE.model_copy(update={"train": BASE.train.model_copy(update={"source": "vllm"})})
    other_layers = online.model_copy(update={"extract": online.extract.model_copy(update={"layer_ids": [1, 3, 5]})})
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store_uri)
    client = mlflow.MlflowClient(store_uri)
    exp = client.create_experiment("draftlab")
    timing = {"steps": 21, "epochs": 2, "step_s": 1.5, "epoch_s": 0.5, "tokens_per_s": 700.0, "wall_s": 80.0}

    def train_run(params, world_size, source_params: dict, hidden_states_hash: str) -> str:
        rid = client.create_run(exp).info.run_id
        client.log_batch(rid, params=[Param(k, param_str(v)) for k, v in flatten(params).items()]
                         + [Param("world_size", str(world_size))]
                         + [Param(k, v) for k, v in source_params.items()],
                         tags=[RunTag("data.hidden_states_hash", hidden_states_hash)],
                         metrics=[Metric(f"timing/{k}", float(v), 0, 0) for k, v in timing.items()])
        client.set_terminated(rid, "FINISHED")
        return rid

    # what the train stage records: source_for's source, its mlflow_params and identity()
    live = source_for(online, store_dir=None, target_dir=target, out_dir=tmp_path / "train")
    elsewhere = source_for(other_layers, store_dir=None, target_dir=target, out_dir=tmp_path / "train")
    online_run = train_run(online, 1, live.mlflow_params(), live.identity())
    train_run(other_layers, 2, elsewhere.mlflow_params(), elsewhere.identity())  # other layers: other hidden states
    store_run = train_run(BASE, 4, {"hidden_states.source": "store"}, "a-manifest-hash")
    old_run = train_run(BASE, 8, {}, "an-older-manifest")  # before online training: no source param, a store

    def run_ids(points) -> dict:
        return {n: p.source.split()[2] for n, p in points.items()}  # "mlflow run <id> (…)"

    points, _ = measured_points(online, tmp_path / "no-store", target)
    assert run_ids(points) == {1: online_run}
    points, _ = measured_points(BASE, tmp_path / "no-store", target)  # offline, no store here: every store run
    assert run_ids(points) == {4: store_run, 8: old_run}
