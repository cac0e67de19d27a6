"""Experiment tracking behind one small interface.

`Tracker` has log_params / log_metrics(step) / log_artifact / set_tags. `MlflowTracker` writes
to an MLflow run (the default store is `sqlite:///mlflow.db` in the repo; `MLFLOW_TRACKING_URI`
points it at a team server); `NullTracker` is for non-zero ranks; `RecordingTracker` keeps
everything in memory for tests. One owner starts and ends a run: the launcher process.

If the tracking server cannot be reached, `MlflowTracker` keeps going: every call is appended
to a local JSONL spool (draftlab.rundir.SpoolRecord), and `draftlab tracking-import SPOOL`
replays it later.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path
from typing import Any, Protocol

DEFAULT_TRACKING_URI = "sqlite:///mlflow.db"


def tracking_uri() -> str:
    return os.environ.get("MLFLOW_TRACKING_URI") or DEFAULT_TRACKING_URI


class Tracker(Protocol):
    run_id: str | None

    def log_params(self, params: dict[str, Any]) -> None: ...
    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None: ...
    def log_artifact(self, path: Path, artifact_path: str | None = None) -> None: ...
    def set_tags(self, tags: dict[str, Any]) -> None: ...


class NullTracker:
    run_id = None

    def log_params(self, params):
        pass

    def log_metrics(self, metrics, step=None):
        pass

    def log_artifact(self, path, artifact_path=None):
        pass

    def set_tags(self, tags):
        pass


class RecordingTracker:
    """Keeps every call, for tests."""

    def __init__(self):
        self.run_id = "recording"
        self.params: dict[str, Any] = {}
        self.metrics: list[tuple[int | None, dict[str, float]]] = []
        self.artifacts: list[tuple[Path, str | None]] = []
        self.tags: dict[str, Any] = {}

    def log_params(self, params):
        self.params.update(params)

    def log_metrics(self, metrics, step=None):
        self.metrics.append((step, dict(metrics)))

    def log_artifact(self, path, artifact_path=None):
        self.artifacts.append((Path(path), artifact_path))

    def set_tags(self, tags):
        self.tags.update(tags)

    def series(self, key: str) -> list[tuple[int | None, float]]:
        return [(s, m[key]) for s, m in self.metrics if key in m]


def _param_str(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value)
    return text[:6000]  # MLflow's param value limit


class MlflowTracker:
    """Logs into one existing MLflow run by id; never raises on a tracking outage."""

    def __init__(self, run_id: str, *, spool: Path | None = None):
        from mlflow.tracking import MlflowClient

        self.run_id = run_id
        self.client = MlflowClient(tracking_uri())
        self.spool = Path(spool) if spool else None
        self.offline = False

    def _call(self, kind: str, payload: dict, fn) -> None:
        if not self.offline:
            for attempt in range(3):
                try:
                    fn()
                    return
                except Exception as err:  # noqa: BLE001 — any outage: keep training, keep the record
                    if "locked" in str(err) and attempt < 2:
                        time.sleep(0.2 * (attempt + 1))
                        continue
                    self.offline = True
                    self._warn(err)
                    break
        if self.spool:
            from draftlab.rundir import append_spool

            append_spool(self.spool, {"run_id": self.run_id, "kind": kind, **payload})

    def _warn(self, err: Exception) -> None:
        from draftlab.console import console

        where = self.spool or "nowhere (no spool configured)"
        console.print(f"[yellow]tracking[/]: MLflow unreachable ({type(err).__name__}); metrics kept in {where}")

    def log_params(self, params):
        from mlflow.entities import Param

        items = [Param(k, _param_str(v)) for k, v in params.items()]
        for lo in range(0, len(items), 100):
            chunk = items[lo : lo + 100]
            self._call("params", {"params": {p.key: p.value for p in chunk}},
                       lambda c=chunk: self.client.log_batch(self.run_id, params=c))

    def log_metrics(self, metrics, step=None):
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        items = [Metric(k, float(v), now, step or 0) for k, v in metrics.items()]
        self._call("metrics", {"metrics": metrics, "step": step, "timestamp": now},
                   lambda: self.client.log_batch(self.run_id, metrics=items))

    def log_metrics_many(self, records):
        """[(metrics, step, timestamp_ms)] in as few store writes as MLflow allows (1,000 values
        each); during an outage every record goes to the spool as its own `metrics` line."""
        from mlflow.entities import Metric

        if not records:
            return
        items = [Metric(k, float(v), ts, step or 0) for metrics, step, ts in records for k, v in metrics.items()]

        def send():
            for lo in range(0, len(items), 1000):
                self.client.log_batch(self.run_id, metrics=items[lo : lo + 1000])

        def payload(rec):
            return {"metrics": rec[0], "step": rec[1], "timestamp": rec[2]}

        self._call("metrics", payload(records[0]), send)
        if self.offline:  # the batch did not go: keep every record, not only the first
            for rec in records[1:]:
                self._call("metrics", payload(rec), lambda: None)

    def log_artifact(self, path, artifact_path=None):
        self._call("artifact", {"path": str(path), "artifact_path": artifact_path},
                   lambda: self.client.log_artifact(self.run_id, str(path), artifact_path))

    def set_tags(self, tags):
        from mlflow.entities import RunTag

        items = [RunTag(k, str(v)) for k, v in tags.items()]
        self._call("tags", {"tags": {k: str(v) for k, v in tags.items()}},
                   lambda: self.client.log_batch(self.run_id, tags=items))


def replay_spool(spool: Path) -> int:
    """Upload a spool written during an outage; returns the number of records replayed. The
    whole file is read first: a bad line is one RunFileError and nothing is uploaded."""
    from mlflow.entities import Metric, Param, RunTag
    from mlflow.tracking import MlflowClient

    from draftlab.rundir import read_spool

    records = read_spool(spool)
    client = MlflowClient(tracking_uri())
    for rec in records:
        if rec.kind == "metrics":
            client.log_batch(rec.run_id, metrics=[
                Metric(k, float(v), rec.timestamp, rec.step or 0) for k, v in rec.metrics.items()])
        elif rec.kind == "params":
            client.log_batch(rec.run_id, params=[Param(k, v) for k, v in rec.params.items()])
        elif rec.kind == "tags":
            client.log_batch(rec.run_id, tags=[RunTag(k, v) for k, v in rec.tags.items()])
        else:
            client.log_artifact(rec.run_id, rec.path, rec.artifact_path)
    return len(records)


def git_tags(root: Path = Path(".")) -> dict[str, str]:
    """git.commit and git.dirty (changes to tracked files other than dvc.lock and outputs)."""
    import subprocess

    def git(*args):
        return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True).stdout

    commit = git("rev-parse", "HEAD").strip() or "unknown"
    changed = [line[3:] for line in git("status", "--porcelain", "--untracked-files=no").splitlines() if line]
    ignored_prefixes = ("dvc.lock", "reports/", "data/", "models/", "runs/")
    dirty = any(not path.startswith(ignored_prefixes) for path in changed)
    return {"git.commit": commit, "git.dirty": str(dirty).lower()}


def run_id_of(train_dir: Path) -> str:
    """The training run id the train stage wrote into its outputs (evaluate/export log there)."""
    from draftlab.rundir import RunDir

    return RunDir(train_dir).train.read().run_id


@contextlib.contextmanager
def stage_run(stage: str, *, experiment: str = "draftlab"):
    """An MLflow run owned by one stage process (extract): FINISHED on success, FAILED otherwise."""
    import mlflow

    mlflow.set_tracking_uri(tracking_uri())
    mlflow.set_experiment(experiment)
    client = mlflow.MlflowClient()
    run = client.create_run(mlflow.get_experiment_by_name(experiment).experiment_id,
                            run_name=f"{stage}-{time.strftime('%Y%m%d-%H%M%S')}")
    tracker = MlflowTracker(run.info.run_id)
    tracker.set_tags({**git_tags(), "draftlab.stage": stage})
    status = "FAILED"
    try:
        with mlflow.start_run(run_id=run.info.run_id, log_system_metrics=True):
            yield tracker
        status = "FINISHED"
    finally:
        client.set_terminated(run.info.run_id, status)
