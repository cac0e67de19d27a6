"""Tracking: an unreachable server never stops training and loses no record; git tags."""

import subprocess

import pytest


def test_outage_spools_every_record_and_import_replays_it(tmp_path, monkeypatch):
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

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    client = mlflow.MlflowClient(uri)
    run = client.create_run(client.create_experiment("x"))
    spool.write_text(spool.read_text().replace("0123456789abcdef", run.info.run_id))
    assert replay_spool(spool) == 6
    history = client.get_metric_history(run.info.run_id, "train/loss")
    assert [(m.step, m.value) for m in history] == [(s, 5.0 - s) for s in range(5)]
    assert client.get_run(run.info.run_id).data.params["world_size"] == "2"


def test_git_dirty_ignores_pipeline_outputs(tmp_path):
    from draftlab.tracking import git_tags

    def git(*a):
        subprocess.run(["git", *a], cwd=tmp_path, check=True, capture_output=True)

    git("init", "-q")
    (tmp_path / "dvc.lock").write_text("a")
    (tmp_path / "src.py").write_text("a")
    git("add", "-A")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "x")
    (tmp_path / "dvc.lock").write_text("b")
    tags = git_tags(tmp_path)
    assert tags["git.dirty"] == "false" and len(tags["git.commit"]) == 40
    (tmp_path / "src.py").write_text("b")
    assert git_tags(tmp_path)["git.dirty"] == "true"
