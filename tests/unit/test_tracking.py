"""Tracking: an unreachable server never stops training and loses no record; git tags."""


def test_outage_spools_every_record_and_import_replays_it(tmp_path, monkeypatch, store_uri):
    import mlflow

    from draftlab.tracking import MlflowTracker, replay_spool

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "2")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:9")  # nothing listens on port 9
    spool = tmp_path / "spool.jsonl"
    tracker = MlflowTracker("0123456789abcdef", spool=spool)
    for step in range(5):
        tracker.log_metrics({"train/loss": 5.0 - step}, step=step)
    tracker.log_params({"world_size": 2})
    assert tracker.offline
    assert len(spool.read_text().splitlines()) == 6

    uri = store_uri
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    client = mlflow.MlflowClient(uri)
    run = client.create_run(client.create_experiment("x"))
    spool.write_text(spool.read_text().replace("0123456789abcdef", run.info.run_id))
    assert replay_spool(spool) == 6
    history = client.get_metric_history(run.info.run_id, "train/loss")
    assert [(m.step, m.value) for m in history] == [(s, 5.0 - s) for s in range(5)]
    assert client.get_run(run.info.run_id).data.params["world_size"] == "2"


def test_the_ranks_writer_batches_steps_and_keeps_their_times(tmp_path, monkeypatch, store_uri):
    import threading
    import time

    import mlflow

    from draftlab.tracking import MlflowTracker
    from draftlab.training.rank import _Batched

    uri = store_uri
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    client = mlflow.MlflowClient(uri)
    run_id = client.create_run(client.create_experiment("x")).info.run_id
    tracker = MlflowTracker(run_id)
    writes = []
    many = tracker.log_metrics_many
    tracker.log_metrics_many = lambda records: (writes.append(len(records)), many(records))
    threads = threading.active_count()
    bg = _Batched(tracker)
    made = []
    for step in range(40):
        made.append(int(time.time() * 1000))
        bg.log_metrics({"train/loss": 1.0 / (step + 1), "perf/eta_s": 40.0 - step}, step=step)
        time.sleep(0.005)
    assert threading.active_count() == threads, "the trainer's records need no thread of their own"
    bg.close()
    assert sum(writes) == 40 and len(writes) <= 3, f"{len(writes)} store writes for 40 steps"
    history = sorted(client.get_metric_history(run_id, "train/loss"), key=lambda m: m.step)
    assert [m.step for m in history] == list(range(40))
    assert all(abs(m.timestamp - t) <= 5 for m, t in zip(history, made)), "each record keeps when it was made"


def test_a_batch_during_an_outage_spools_every_record(tmp_path, monkeypatch):
    from draftlab.tracking import MlflowTracker

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "2")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:9")
    spool = tmp_path / "spool.jsonl"
    tracker = MlflowTracker("0123456789abcdef", spool=spool)
    tracker.log_metrics_many([({"train/loss": 1.0}, s, 1000 + s) for s in range(3)])
    lines = [__import__("json").loads(line) for line in spool.read_text().splitlines()]
    assert [(r["kind"], r["step"], r["timestamp"]) for r in lines] == [("metrics", s, 1000 + s) for s in range(3)]


def test_every_mlflow_link_opens_the_model_training_view(monkeypatch):
    from draftlab.tracking import ui_url

    monkeypatch.setenv("MLFLOW_TRACKING_URI", "sqlite:///mlflow.db")
    assert ui_url() == "http://127.0.0.1:5000/#/experiments?workflowType=machine_learning"
    assert ui_url("3") == "http://127.0.0.1:5000/#/experiments/3?workflowType=machine_learning"
    assert ui_url("3", "abc") == "http://127.0.0.1:5000/#/experiments/3/runs/abc?workflowType=machine_learning"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://mlflow:5000/")
    assert ui_url("3", "abc") == "http://mlflow:5000/#/experiments/3/runs/abc?workflowType=machine_learning"


def test_the_experiment_is_a_model_development_one(store_uri):
    from draftlab import tracking

    store = tracking.client(store_uri)
    made = tracking.experiment_id(store)
    assert store.get_experiment(made).tags[tracking.KIND_TAG] == "custom_model_development"
    old = store.create_experiment("older")  # made before draftlab tagged its experiments
    assert tracking.experiment_id(store, "older") == old
    assert store.get_experiment(old).tags[tracking.KIND_TAG] == "custom_model_development"
    assert tracking.experiment_id(store) == made


def test_the_summarys_mlflow_link_opens_the_model_training_view(tmp_path, monkeypatch):
    """`draftlab summary` (the end of ./quickstart.sh) prints the MLflow UI address with the switch."""
    import re

    from draftlab import console as console_module
    from draftlab import summary
    from draftlab.params import Params

    monkeypatch.chdir(tmp_path)  # nothing produced here: the summary still says where to look
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "sqlite:///mlflow.db")
    with console_module.console.capture() as captured:
        summary.show(Params())
    links = re.findall(r"https?://[^\s)]+", captured.get())
    assert links and all(link.endswith("?workflowType=machine_learning") for link in links), links


def test_after_an_outage_the_tracker_writes_again_and_a_second_import_adds_nothing(tmp_path, monkeypatch, store_uri):
    """The server comes back: the tracker finds it (every RETRY_ONLINE_S), the spool keeps only
    the outage's records, and importing them twice leaves each step once in the run."""
    import json

    import mlflow

    from draftlab import tracking
    from draftlab.tracking import RANK_HTTP_ENV, MlflowTracker, replay_spool

    for k, v in RANK_HTTP_ENV.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(tracking, "RETRY_ONLINE_S", 0.0)
    uri = store_uri
    client = mlflow.MlflowClient(uri)
    run_id = client.create_run(client.create_experiment("x")).info.run_id
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:9")  # the server is away
    spool = tmp_path / "spool.jsonl"
    tracker = MlflowTracker(run_id, spool=spool)
    tracker.log_metrics_many([({"train/loss": 10.0 - s}, s, 1000 + s) for s in range(3)])
    tracker.log_metrics({"train/loss": 7.0}, step=3)  # tried again at once (RETRY_ONLINE_S = 0): still away
    assert tracker.offline and tracker.outages == 1
    tracker.client = client  # back
    tracker.log_metrics({"train/loss": 6.0}, step=4)
    assert not tracker.offline
    assert [json.loads(line)["step"] for line in spool.read_text().splitlines()] == [0, 1, 2, 3]
    assert [m.step for m in client.get_metric_history(run_id, "train/loss")] == [4]

    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    assert replay_spool(spool) == replay_spool(spool) == 4
    history = sorted((m.step, m.value) for m in client.get_metric_history(run_id, "train/loss"))
    assert history == [(s, 10.0 - s) for s in range(5)], "each step once, after two imports"


def test_import_of_a_long_spool_of_two_runs_keeps_every_value_with_its_run_and_step(tmp_path, monkeypatch, store_uri):
    """tracking-import sends consecutive metric records together (1,000 values a write): records
    of two runs, interleaved with params, each land in their own run, every step once."""
    import mlflow

    from draftlab.rundir import append_spool
    from draftlab.tracking import replay_spool

    monkeypatch.setenv("MLFLOW_TRACKING_URI", store_uri)
    client = mlflow.MlflowClient(store_uri)
    exp = client.create_experiment("x")
    a, b = (client.create_run(exp).info.run_id for _ in range(2))
    spool = tmp_path / "spool.jsonl"
    for step in range(1200):  # 2,400 values of run a: more than one write
        append_spool(spool, {"run_id": a, "kind": "metrics", "metrics": {"train/loss": step, "epoch": 0},
                             "step": step, "timestamp": 1000 + step})
        if step == 600:
            append_spool(spool, {"run_id": a, "kind": "params", "params": {"world_size": "8"}})
        if step % 400 == 0:
            append_spool(spool, {"run_id": b, "kind": "metrics", "metrics": {"train/loss": -step}, "step": step,
                                 "timestamp": 5})
    assert replay_spool(spool) == 1200 + 1 + 3
    assert [(m.step, m.value) for m in client.get_metric_history(a, "train/loss")] == [(s, s) for s in range(1200)]
    assert sorted((m.step, m.value) for m in client.get_metric_history(b, "train/loss")) == [(0, 0), (400, -400),
                                                                                            (800, -800)]
    assert client.get_run(a).data.params == {"world_size": "8"} and not client.get_run(b).data.params


def test_a_run_whose_server_stays_away_to_its_end_is_finished_by_one_import(tmp_path, monkeypatch, store_uri):
    """The run's owner ends it during the outage: the end (status, time) and the artifact wait in
    the spool with the metrics; importing them makes the run complete and FINISHED, ended then."""
    import mlflow

    from draftlab.tracking import RANK_HTTP_ENV, MlflowTracker, replay_spool

    for k, v in RANK_HTTP_ENV.items():
        monkeypatch.setenv(k, v)
    client = mlflow.MlflowClient(store_uri)
    run_id = client.create_run(client.create_experiment("x")).info.run_id
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:9")  # away, and it stays away
    spool = tmp_path / "spool.jsonl"
    tracker = MlflowTracker(run_id, spool=spool)
    tracker.log_metrics({"train/loss": 1.0}, step=0)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "accounting.json").write_text("{}")
    tracker.log_artifact("accounting.json")  # relative to where the stage ran, not where the import runs
    tracker.set_tags({"draftlab.accounting": "verified"})
    tracker.end("FINISHED")
    assert client.get_run(run_id).info.status == "RUNNING", "nothing reached the store"
    line = tracker.spool_line("train")
    assert f"draftlab tracking-import {spool}" in line and "4 record(s)" in line

    monkeypatch.chdir("/")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store_uri)
    assert replay_spool(spool) == 4
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.info.end_time is not None
    assert run.data.tags["draftlab.accounting"] == "verified" and run.data.metrics["train/loss"] == 1.0
    assert [a.path for a in client.list_artifacts(run_id)] == ["accounting.json"]


def test_a_tracker_that_never_lost_the_server_says_nothing(monkeypatch, store_uri):
    import mlflow

    from draftlab.tracking import MlflowTracker

    monkeypatch.setenv("MLFLOW_TRACKING_URI", store_uri)
    client = mlflow.MlflowClient(store_uri)
    run_id = client.create_run(client.create_experiment("x")).info.run_id
    tracker = MlflowTracker(run_id, spool=None)
    tracker.end("FAILED")
    assert tracker.spool_line("evaluate") is None and client.get_run(run_id).info.status == "FAILED"


def test_rank_0s_relay_reaches_the_run_once_and_a_new_launcher_uploads_only_the_rest(tmp_path, monkeypatch, store_uri):
    """Rank 0 writes its records to the run folder's relay file and opens no store; the launcher
    uploads them into its run, a torn last line waits for its end, a launcher started after a
    kill uploads only what the killed one had not, and another run's records stay out."""
    import subprocess
    import sys

    import mlflow

    from draftlab.rundir import RunDir
    from draftlab.tracking import MlflowTracker, Relay, RelayWriter

    monkeypatch.setenv("MLFLOW_TRACKING_URI", store_uri)
    client = mlflow.MlflowClient(store_uri)
    exp = client.create_experiment("x")
    run_id, other = (client.create_run(exp).info.run_id for _ in range(2))
    rd = RunDir(tmp_path / "run")
    writer = RelayWriter(rd.relay_path, run_id)
    writer.log_metrics_many([({"train/loss": 4.0 - s}, s, 1000 + s) for s in range(3)])
    writer.set_tags({"draftlab.convergence": "learning"})
    RelayWriter(rd.relay_path, other).log_metrics({"train/loss": 9.0}, step=0)
    with open(rd.relay_path, "a") as f:
        f.write('{"run_id": "' + run_id + '", "kind": "metrics", "metr')  # a rank writing now

    relay = Relay(rd.relay_path, rd.relay_sent_path, MlflowTracker(run_id))
    assert relay.pump() == 4
    history = client.get_metric_history(run_id, "train/loss")
    assert sorted((m.step, m.value, m.timestamp) for m in history) == [(s, 4.0 - s, 1000 + s) for s in range(3)]
    assert client.get_run(run_id).data.tags["draftlab.convergence"] == "learning"
    assert client.get_metric_history(other, "train/loss") == [], "another run's record went into this one"

    writer = RelayWriter(rd.relay_path, run_id)  # a rank started after the kill: the torn line goes
    writer.log_metrics({"train/loss": 1.0}, step=3)
    writer.sync()
    again = Relay(rd.relay_path, rd.relay_sent_path, MlflowTracker(run_id))  # the next launcher
    assert again.pump() == 1
    assert again.pump() == 0
    history = client.get_metric_history(run_id, "train/loss")
    assert sorted(m.step for m in history) == [0, 1, 2, 3], "a record uploaded twice, or lost"

    # the rank's side costs it no MLflow import (about a second of CPU)
    code = ("import sys; from draftlab.tracking import RelayWriter; from draftlab.training.rank import _Batched; "
            f"bg = _Batched(RelayWriter({str(tmp_path / 'r.jsonl')!r}, 'x')); bg.log_metrics({{'a': 1.0}}, 0); "
            "bg.drain(); bg.close(); print(sorted(m for m in sys.modules if m.split('.')[0] == 'mlflow'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_the_relay_thread_uploads_while_the_rank_writes_and_everything_at_its_stop(tmp_path, monkeypatch, store_uri):
    import time

    import mlflow

    from draftlab.rundir import RunDir
    from draftlab.tracking import MlflowTracker, Relay, RelayWriter
    from draftlab.training.rank import _Batched

    monkeypatch.setenv("MLFLOW_TRACKING_URI", store_uri)
    client = mlflow.MlflowClient(store_uri)
    run_id = client.create_run(client.create_experiment("x")).info.run_id
    rd = RunDir(tmp_path / "run")
    relay = Relay(rd.relay_path, rd.relay_sent_path, MlflowTracker(run_id))
    monkeypatch.setattr(Relay, "POLL_S", 0.05)
    relay.start()
    bg = _Batched(RelayWriter(rd.relay_path, run_id))
    bg.log_metrics({"train/loss": 2.0}, step=0)
    bg.drain()  # before a checkpoint: on disk
    deadline = time.monotonic() + 30
    while not client.get_metric_history(run_id, "train/loss") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [m.step for m in client.get_metric_history(run_id, "train/loss")] == [0], "not uploaded while running"
    for step in range(1, 5):
        bg.log_metrics({"train/loss": 2.0 - step / 10}, step=step)
    bg.close()
    relay.stop()
    assert sorted(m.step for m in client.get_metric_history(run_id, "train/loss")) == list(range(5))
    assert relay.uploaded == 5 and rd.relay_sent_path.read_text() == str(rd.relay_path.stat().st_size)


def test_a_relay_write_that_fails_is_raised_at_the_next_drain_not_a_hang(tmp_path):
    """A full disk under the relay file: the checkpoint's drain says so instead of waiting forever."""
    import threading

    from draftlab.training.rank import _Batched

    class FullDisk:
        def log_metrics_many(self, records):
            raise OSError(28, "No space left on device")

        def log_metrics(self, metrics, step=None):
            self.log_metrics_many([(metrics, step, 0)])

        def set_tags(self, tags):
            pass

    bg = _Batched(FullDisk())
    bg.log_metrics({"train/loss": 1.0}, step=0)
    raised: list[BaseException] = []

    def drain():
        try:
            bg.drain()
        except OSError as err:
            raised.append(err)

    t = threading.Thread(target=drain, daemon=True)
    t.start()
    t.join(20)
    assert not t.is_alive(), "drain() waited for a writer thread that had died"
    assert raised and raised[0].errno == 28
