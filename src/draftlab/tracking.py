"""Experiment tracking behind one small interface.

`Tracker` has log_params / log_metrics(step) / log_artifact / set_tags. `MlflowTracker` writes
to an MLflow run (the default store is `sqlite:///mlflow.db` in the repo; `MLFLOW_TRACKING_URI`
points it at a team server). One owner starts and ends a run: the launcher process. Every
MLflow client is built here, with the tracking URI named (`client()`; tests/unit/test_contracts.py
holds that); `experiment_id()` makes the experiment a model-training one; `open_run()` opens a run
folder's run or finds it again after a kill; `ui_url()` is the link draftlab prints.

If the tracking server cannot be reached, `MlflowTracker` keeps going: every call is appended
to a local JSONL spool (draftlab.rundir.SpoolRecord), the server is tried again every
RETRY_ONLINE_S, and `draftlab tracking-import SPOOL` replays the spool later (MLflow skips metric
records it already has, so importing twice logs nothing twice). The run's end (its status) is a
spool record too (`MlflowTracker.end`): a server that stays down to the end costs nothing but
one import, after which the run is complete and FINISHED. MLflow's client would retry a dead
server 7 times with exponential back-off, minutes per call: a draftlab process fails almost at
once (PROCESS_HTTP_ENV, the CLI's default), and anything in a training rank that calls MLflow
at once (RANK_HTTP_ENV, in the ranks' environment).

A training's rank 0 opens no MLflow store: its records go as lines into the run folder's relay
file (`RelayWriter`, the spool's format), and node 0's launcher, which holds the run and MLflow
already, uploads them as they come (`Relay`). The rank so spends no CPU on MLflow's import, its
store or its writes (about 1.2 s a run and 1.6 ms a step here), and waits on no server before a
checkpoint: what it wrote is on disk, and a launcher started after a kill uploads what its
predecessor had not.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path
from typing import Any, Protocol

DEFAULT_TRACKING_URI = "sqlite:///mlflow.db"
EXPERIMENT = "draftlab"
# MLflow 3 opens the UI in its GenAI view unless a link asks for the model-training one (a
# per-browser switch that overrides the experiment's kind tag; the tag still says what it is)
KIND_TAG, KIND = "mlflow.experimentKind", "custom_model_development"
WORKFLOW_QUERY = "workflowType=machine_learning"
LOCAL_UI = "http://127.0.0.1:5000"  # `mlflow ui`'s address for a local store
RETRY_ONLINE_S = 10.0
# MLflow's REST client settings for a rank's writes (read by MLflow on every request): one try,
# 5 s at most; what fails goes to the spool.
RANK_HTTP_ENV = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "5"}
# A stage's own process (the launcher, extract, evaluate, export, a sweep): two retries a second
# apart, 10 s each; a user's MLFLOW_HTTP_* settings win.
PROCESS_HTTP_ENV = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
                    "MLFLOW_HTTP_REQUEST_TIMEOUT": "10"}


def fail_fast_defaults() -> None:
    """PROCESS_HTTP_ENV where the user set nothing (the CLI calls it before every command)."""
    for key, value in PROCESS_HTTP_ENV.items():
        os.environ.setdefault(key, value)


def tracking_uri() -> str:
    return os.environ.get("MLFLOW_TRACKING_URI") or DEFAULT_TRACKING_URI


def client(uri: str | None = None):
    """An MLflow client of the store draftlab writes (`uri`, else MLFLOW_TRACKING_URI, else ./mlflow.db)."""
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=uri or tracking_uri())


def experiment_id(mlflow_client, name: str = EXPERIMENT) -> str:
    """The id of experiment `name`, created on first use, tagged as model development."""
    from mlflow.exceptions import MlflowException

    exp = mlflow_client.get_experiment_by_name(name)
    if exp is None:
        try:
            return mlflow_client.create_experiment(name, tags={KIND_TAG: KIND})
        except MlflowException:  # another process created it first
            exp = mlflow_client.get_experiment_by_name(name)
    if exp.tags.get(KIND_TAG) != KIND:
        mlflow_client.set_experiment_tag(exp.experiment_id, KIND_TAG, KIND)
    return exp.experiment_id


def ui_url(experiment: str | None = None, run_id: str | None = None, uri: str | None = None) -> str:
    """The MLflow UI's page of an experiment (or one of its runs), in the model-training view.
    A server store's UI is the server itself; a local one's is where `mlflow ui` serves it."""
    from draftlab import redact

    uri = redact.url(uri or tracking_uri(), link=True)
    base = uri.rstrip("/") if uri.startswith(("http://", "https://")) else LOCAL_UI
    route = "experiments" if experiment is None else f"experiments/{experiment}"
    if experiment is not None and run_id is not None:
        route += f"/runs/{run_id}"
    return f"{base}/#/{route}?{WORKFLOW_QUERY}"


class Tracker(Protocol):
    run_id: str | None

    def log_params(self, params: dict[str, Any]) -> None: ...
    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None: ...
    def log_artifact(self, path: Path, artifact_path: str | None = None) -> None: ...
    def set_tags(self, tags: dict[str, Any]) -> None: ...
    def call(self, kind: str, payload: dict, fn) -> None: ...


def param_str(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value)
    return text[:6000]  # MLflow's param value limit


class MlflowTracker:
    """Logs into one existing MLflow run by id; never raises on a tracking outage."""

    def __init__(self, run_id: str, *, spool: Path | None = None):
        self.run_id = run_id
        self.client = client()
        self.spool = Path(spool) if spool else None
        self.offline = False
        self.offline_since = 0.0
        self.outages = 0  # times the server went away
        self.spooled = 0  # records this tracker kept in the spool
        self.failed_call_s_max = 0.0  # the longest call that ended in the spool (retries, timeouts)

    def _call(self, kind: str, payload: dict, fn) -> None:
        if self.offline and time.monotonic() - self.offline_since >= RETRY_ONLINE_S:
            self.offline = False  # try the server again; back in the spool at once if it is still away
            self.offline_since = time.monotonic()
            probing = True
        else:
            probing = False
        if not self.offline:
            started = time.monotonic()
            for attempt in range(3):
                try:
                    fn()
                    if probing:
                        self._say(f"MLflow reachable again; records of the outage stay in {self.spool} "
                                  f"(`draftlab tracking-import {self.spool}`)")
                    return
                except Exception as err:  # noqa: BLE001 — any outage: keep training, keep the record
                    if "locked" in str(err) and attempt < 2:
                        time.sleep(0.2 * (attempt + 1))
                        continue
                    self.offline, self.offline_since = True, time.monotonic()
                    self.failed_call_s_max = max(self.failed_call_s_max, self.offline_since - started)
                    if not probing:
                        self.outages += 1
                        self._warn(err)
                    break
        self._spool(kind, payload)

    def _spool(self, kind: str, payload: dict) -> None:
        if self.spool:
            from draftlab.rundir import append_spool

            append_spool(self.spool, {"run_id": self.run_id, "kind": kind, **payload})
            self.spooled += 1

    def call(self, kind: str, payload: dict, fn) -> None:
        """`fn()` now, or, while the server is away, the record `{run_id, kind, **payload}` in the
        spool for `draftlab tracking-import` (the registry's and lineage's writes: draftlab.registry)."""
        self._call(kind, payload, fn)

    def end(self, status: str = "FINISHED") -> None:
        """The run's end, as its one owner sets it; kept in the spool if the server is away."""
        now = int(time.time() * 1000)
        self._call("end", {"status": status, "end_time": now},
                   lambda: self.client.set_terminated(self.run_id, status, end_time=now))

    def spool_line(self, stage: str) -> str | None:
        """The one line a stage prints at its end if its records wait in the spool, else None."""
        if not self.spooled:
            return None
        return (f"{stage}: MLflow was unreachable; {self.spooled} record(s) of run {self.run_id} wait in "
                f"{self.spool}: upload them with `draftlab tracking-import {self.spool}`")

    def _warn(self, err: Exception) -> None:
        where = self.spool or "nowhere (no spool configured)"
        self._say(f"MLflow unreachable ({type(err).__name__}); metrics kept in {where}")

    @staticmethod
    def _say(line: str) -> None:
        from draftlab.console import console

        console.print(f"[yellow]tracking[/]: {line}")

    def log_params(self, params):
        from mlflow.entities import Param

        items = [Param(k, param_str(v)) for k, v in params.items()]
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
                self._spool("metrics", payload(rec))

    def log_artifact(self, path, artifact_path=None):
        self._call("artifact", {"path": str(Path(path).resolve()), "artifact_path": artifact_path},
                   lambda: self.client.log_artifact(self.run_id, str(path), artifact_path))

    def set_tags(self, tags):
        from mlflow.entities import RunTag

        items = [RunTag(k, str(v)) for k, v in tags.items()]
        self._call("tags", {"tags": {k: str(v) for k, v in tags.items()}},
                   lambda: self.client.log_batch(self.run_id, tags=items))


class RelayWriter:
    """Rank 0's side of the relay: its metric and tag records appended to `path` (the run folder's
    relay file, RunDir.relay_path) as spool lines of run `run_id`, which node 0's launcher uploads
    (`Relay`). Imports no MLflow. `sync()` makes what was written so far survive a power cut (the
    rank calls it before every checkpoint)."""

    def __init__(self, path: Path, run_id: str):
        from draftlab import appendlog

        self.path, self.run_id = Path(path), run_id
        self.lines = appendlog.Appender(self.path)
        self.lines.open()  # a killed rank's torn line goes now: never read as a record

    def _write(self, records: list[dict]) -> None:
        self.lines.write("".join(json.dumps(r) + "\n" for r in records))

    def log_metrics_many(self, records) -> None:
        """[(metrics, step, timestamp_ms)], each one line."""
        self._write([{"run_id": self.run_id, "kind": "metrics", "metrics": {k: float(v) for k, v in m.items()},
                      "step": step, "timestamp": ts} for m, step, ts in records])

    def log_metrics(self, metrics, step=None) -> None:
        self.log_metrics_many([(metrics, step, int(time.time() * 1000))])

    def set_tags(self, tags) -> None:
        self._write([{"run_id": self.run_id, "kind": "tags", "tags": {k: str(v) for k, v in tags.items()}}])

    def sync(self) -> None:
        self.lines.sync()

    def close(self) -> None:
        self.lines.close()


class Relay:
    """Node 0's launcher's side: uploads the records rank 0 appends to the relay file (`path`)
    into the run through the launcher's own `tracker` (an MlflowTracker: an outage puts them in
    its spool), every POLL_S in a thread at the lowest priority, and once more at `stop()`.
    How far it got is saved in `sent_path` after each upload, so a launcher started after a kill
    uploads only what the killed one had not (`pump()` before the ranks start). Records of
    another run (a folder whose run.json was deleted) are not this run's and are left out."""

    POLL_S = 1.0

    def __init__(self, path: Path, sent_path: Path, tracker):
        import threading

        self.path, self.sent_path, self.tracker = Path(path), Path(sent_path), tracker
        self.offset = self._sent()
        self.uploaded = 0  # records this relay has passed to the tracker
        self.cpu_s = 0.0  # its thread's CPU (train.json's harness_cpu: part of the launcher's)
        self.error: Exception | None = None
        self._stop = threading.Event()
        self.thread: threading.Thread | None = None

    def _sent(self) -> int:
        try:
            offset = int(self.sent_path.read_text())
        except (OSError, ValueError):  # never uploaded, or torn: from the start (MLflow keeps a metric once)
            return 0
        try:
            return offset if offset <= self.path.stat().st_size else 0
        except OSError:
            return 0

    def restart(self) -> None:
        """A new MLflow run in this folder: its relay starts empty (the records of the run that
        was are left to it)."""
        self.clear(self.path, self.sent_path)
        self.offset = 0

    @staticmethod
    def clear(path: Path, sent_path: Path) -> None:
        Path(path).unlink(missing_ok=True)
        Path(sent_path).unlink(missing_ok=True)

    def pump(self) -> int:
        """Upload what was appended since the last pump; returns how many records went."""
        from draftlab.rundir import read_relay

        records, end = read_relay(self.path, self.offset)
        batch: list = []

        def flush():
            if batch:
                self.tracker.log_metrics_many(batch)
                batch.clear()

        mine = [r for r in records if r.run_id == self.tracker.run_id]
        for rec in mine:
            if rec.kind == "metrics":
                batch.append((rec.metrics, rec.step, rec.timestamp))
                continue
            flush()
            if rec.kind == "tags":
                self.tracker.set_tags(rec.tags)
        flush()
        if end != self.offset:
            self.offset = end
            tmp = self.sent_path.with_name(f".{self.sent_path.name}.tmp-{os.getpid()}")
            tmp.write_text(str(end))
            os.replace(tmp, self.sent_path)
        self.uploaded += len(mine)
        return len(mine)

    def start(self) -> "Relay":
        import threading

        self._stop.clear()
        self.thread = threading.Thread(target=self._work, name="draftlab-relay", daemon=True)
        self.thread.start()
        return self

    def _work(self) -> None:
        from draftlab.threads import yield_cpu

        yield_cpu()  # the uploads wait for a CPU the ranks leave
        started = time.thread_time()
        try:
            while not self._stop.wait(self.POLL_S):
                self.pump()
            self.pump()
        except Exception as err:  # noqa: BLE001 — said once by stop(); the file keeps every record
            self.error = err
        finally:
            self.cpu_s += time.thread_time() - started

    def stop(self) -> None:
        """Upload what is left and end the thread (again: nothing). An error is one line: the
        relay file holds every record, for `draftlab tracking-import`."""
        if self.thread is not None:
            self._stop.set()
            self.thread.join()
            self.thread = None
        if self.error is not None:
            MlflowTracker._say(f"rank 0's records after byte {self.offset} of {self.path} were not uploaded "
                               f"({self.error}); upload them with `draftlab tracking-import {self.path}`")
            self.error = None


def replay_spool(spool: Path, *, replay_registry=None) -> int:
    """Upload a spool written during an outage; returns the number of records replayed. The
    whole file is read first: a bad line is one RunFileError and nothing is uploaded.
    `replay_registry(client, record)` uploads the registry's and lineage's records (the caller
    passes `draftlab.registry.replay`: the shared core imports no package)."""
    from mlflow.entities import Metric, Param, RunTag

    from draftlab.rundir import read_spool

    records = read_spool(spool)
    store = client()
    # consecutive metric records of one run go 1,000 values a store write (MLflow's batch limit):
    # one write per record took ~90 ms on a loaded 2-core VM, 4.4 h for the reference's 177 k steps
    pending: list = []
    pending_run: list = [None]

    def flush():
        for lo in range(0, len(pending), 1000):
            store.log_batch(pending_run[0], metrics=pending[lo : lo + 1000])
        pending.clear()

    for rec in records:
        if rec.kind == "metrics":
            if rec.run_id != pending_run[0]:
                flush()
                pending_run[0] = rec.run_id
            pending.extend(Metric(k, float(v), rec.timestamp, rec.step or 0) for k, v in rec.metrics.items())
            if len(pending) >= 1000:
                flush()
            continue
        flush()
        if rec.kind == "params":
            store.log_batch(rec.run_id, params=[Param(k, v) for k, v in rec.params.items()])
        elif rec.kind == "tags":
            store.log_batch(rec.run_id, tags=[RunTag(k, v) for k, v in rec.tags.items()])
        elif rec.kind == "end":
            store.set_terminated(rec.run_id, rec.status, end_time=rec.end_time)
        elif rec.kind in ("inputs", "register", "alias"):
            if replay_registry is None:
                raise TypeError("replay_spool: a registry record needs replay_registry (draftlab.registry.replay)")
            replay_registry(store, rec)
        else:
            store.log_artifact(rec.run_id, rec.path, rec.artifact_path)
    flush()
    return len(records)


def dvc_experiment() -> str | None:
    """The name of the `dvc exp run` experiment this process runs in (DVC sets DVC_EXP_NAME for
    its stage commands), else None."""
    return os.environ.get("DVC_EXP_NAME") or None


def git_tags(root: Path = Path(".")) -> dict[str, str]:
    """Provenance: git.commit and git.dirty (changes to tracked files other than dvc.lock and
    pipeline outputs). Inside `dvc exp run` also the experiment (dvc.exp.name, the baseline
    commit it started from, the sha256 of its params.yaml); params.yaml edits are then the
    experiment's (DVC applies `-S` there and commits them with it), not dirt."""
    import hashlib
    import subprocess

    def git(*args):
        return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True).stdout

    commit = git("rev-parse", "HEAD").strip() or "unknown"
    changed = [line[3:] for line in git("status", "--porcelain", "--untracked-files=no").splitlines() if line]
    outputs = ("dvc.lock", "reports/", "data/", "models/", "runs/")
    experiment = dvc_experiment()
    if experiment:
        outputs += ("params.yaml",)
    dirty = any(not path.startswith(outputs) for path in changed)
    tags = {"git.commit": commit, "git.dirty": str(dirty).lower()}
    if experiment:
        params = Path(root) / "params.yaml"
        tags.update({"dvc.exp.name": experiment,
                     "dvc.exp.baseline": os.environ.get("DVC_EXP_BASELINE_REV") or commit,
                     "dvc.exp.params_sha256": hashlib.sha256(params.read_bytes()).hexdigest()
                     if params.exists() else "none"})
    return tags


def run_name(stage: str) -> str:
    """`<stage>-<DVC experiment>` inside `dvc exp run`, else `<stage>-<local time>`."""
    return f"{stage}-{dvc_experiment() or time.strftime('%Y%m%d-%H%M%S')}"


def run_id_of(train_dir: Path) -> str:
    """The training run id the train stage wrote into its outputs (evaluate/export log there)."""
    from draftlab.rundir import RunDir

    return RunDir(train_dir).train.read().run_id


def spool_beside(out_dir: Path) -> Path:
    """The spool of a stage whose output DVC hashes (extract, evaluate, export): a hidden file
    beside that output, so neither an outage nor its import changes the output."""
    out_dir = Path(out_dir)
    return out_dir.parent / f".{out_dir.name}.tracking-spool.jsonl"


def open_run(state, key: str, console, tags: dict[str, str] | None = None,
             stage: str = "train") -> tuple[str, bool]:
    """The MLflow run of a run folder whose record is `state` (RunDir.run, run.json): the same one again after
    a kill (same key, run still in the store), else a new one, recorded there. (run id, resumed)."""
    from draftlab.rundir import RunState

    mlflow_client = client()
    prev = state.read_or_none()
    if prev is not None and prev.key == key:
        try:
            run = mlflow_client.get_run(prev.run_id)
            if prev.experiment_id is None:  # a folder from before run.json named it
                state.write(RunState(key=key, run_id=prev.run_id, experiment_id=run.info.experiment_id))
            return prev.run_id, True
        except Exception:  # noqa: BLE001 — deleted or unreachable: start a new run
            console.print(f"[yellow]{stage}[/]: MLflow run {prev.run_id} not found; starting a new one")
    tags = dict(tags or {})
    name = tags.pop("mlflow.runName", None) or run_name(stage)
    run = mlflow_client.create_run(experiment_id(mlflow_client), tags=tags, run_name=name)
    state.write(RunState(key=key, run_id=run.info.run_id, experiment_id=run.info.experiment_id))
    return run.info.run_id, False


def last_step(run_id: str, metric: str) -> int:
    """The last step of `metric` the run has logged; -1 when none, or the store cannot be read."""
    try:
        history = client().get_metric_history(run_id, metric)
    except Exception:  # noqa: BLE001
        return -1
    return max((m.step for m in history), default=-1)


@contextlib.contextmanager
def system_metrics(run_id: str, interval_s: float | None = None):
    """MLflow's system-metrics sampler on run `run_id` while the block runs (a fluent run), every
    `interval_s` (MLflow's default: 10 s). The
    run's status stays its owner's (MlflowTracker.end): an unreachable server at the start costs
    the samples, at the end nothing (MLflow's own end_run would raise there)."""
    import mlflow
    from mlflow.tracking import fluent

    if interval_s is not None:
        mlflow.set_system_metrics_sampling_interval(interval_s)
    try:
        mlflow.set_tracking_uri(tracking_uri())
        mlflow.start_run(run_id=run_id, log_system_metrics=True)
    except Exception as err:  # noqa: BLE001 — an outage: no system metrics, the work goes on
        MlflowTracker._say(f"no system metrics for run {run_id} (MLflow unreachable: {type(err).__name__})")
        yield
        return
    try:
        yield
    finally:
        monitor = fluent.run_id_to_system_metrics_monitor.pop(run_id, None)
        if monitor is not None:
            monitor.finish()  # MLflow's end_run finishes it only after a successful set_terminated
        with contextlib.suppress(Exception):  # the fluent stack is popped before MLflow's call fails
            mlflow.end_run()


@contextlib.contextmanager
def stage_run(stage: str, *, spool: Path | None = None, experiment: str = EXPERIMENT):
    """An MLflow run owned by one stage process (extract): FINISHED on success, FAILED otherwise.
    Writes after its start that find the server away go to `spool` (its end included)."""
    from draftlab.console import console

    store = client()
    run = store.create_run(experiment_id(store, experiment), run_name=run_name(stage))
    tracker = MlflowTracker(run.info.run_id, spool=spool)
    tracker.set_tags({**git_tags(), "draftlab.stage": stage})
    status = "FAILED"
    try:
        with system_metrics(run.info.run_id):
            yield tracker
        status = "FINISHED"
    finally:
        tracker.end(status)
        if line := tracker.spool_line(stage):
            console.print(f"[yellow]tracking[/]: {line}", soft_wrap=True)
