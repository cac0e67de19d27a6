"""Sweep workers on one study in a real PostgreSQL server (tests/postgres.py starts a throwaway
cluster): a shared budget and calibration, no trial launched twice, a calibration queue that
holds when workers start at the same moment, a kill -9'd worker found by Optuna's heartbeat and
its held processes stopped, a restarted worker that carries on, and one real trial.

The budget and no-duplicate checks use the sweep's simulated launcher and clock
(tests/sweep_sim.py); the process checks hold their trials until the test releases them, so no
assertion depends on how fast anything runs."""

from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO, trial_params
from tests.sweep_sim import GRACE, POLL, FakeClock, SimLauncher, make_spec, make_worker, run_side_by_side
from tests.waiting import wait_for

_wait = functools.partial(wait_for, poll_s=0.2)  # a study is read from storage: poll it less often


def _load(url: str, name: str):
    import optuna


    return optuna.load_study(study_name=name, storage=url)


def test_two_workers_share_one_budget_one_calibration_and_never_run_a_trial_twice(tmp_path, postgres_url):
    clock = FakeClock()
    launcher = SimLauncher(clock)
    spec = make_spec(tmp_path, budget=1200, storage=postgres_url,
                     space={"train.epochs": {"low": 1, "high": 3}, "train.gpus": {"choices": [1, 2]}})
    # two hosts: their own storage objects (engines), their own slots, the same study
    a = make_worker(tmp_path, spec, clock, launcher, host="hostA", devices=("0", "1"), storage_url=postgres_url)
    b = make_worker(tmp_path, spec, clock, launcher, host="hostB", devices=("0", "1"), storage_url=postgres_url)
    t0 = clock.now()
    a.start()
    b.start()  # the same moment: the calibration is queued once
    run_side_by_side((a, b), clock)
    for w in (a, b):
        w.close(w.done_reason)
    assert clock.now() - t0 <= 1200 + GRACE + 3 * POLL, "together inside the budget + grace"
    study = _load(postgres_url, "sim")
    trials = study.get_trials()
    numbers = [s.number for s, _, _ in launcher.started]
    assert len(set(numbers)) == len(numbers), "no trial launched twice"
    assert {t.number for t in trials} == set(numbers), "the study holds the launched trials, nothing else"
    cal = [t for t in trials if t.user_attrs.get("role") == "calibration"]
    assert sorted(t.user_attrs["gpus"] for t in cal) == [1, 2], "one calibration per GPU count for both workers"
    by_worker = {t.user_attrs["worker"] for t in trials if t.user_attrs.get("status") == "completed"}
    assert by_worker == {a.worker_id, b.worker_id}, "both ran search trials on the shared cost model"
    assert not [t for t in trials if t.state.name in ("RUNNING", "WAITING")]
    import sqlalchemy


    engine = sqlalchemy.create_engine(postgres_url)
    with engine.connect() as conn:
        beats = conn.execute(sqlalchemy.text("SELECT count(*) FROM trial_heartbeats")).scalar()
    engine.dispose()
    assert beats == len(trials), "every trial a worker held had Optuna's heartbeat"


def _space(tmp_path: Path, url: str, **over) -> Path:
    raw = {"study": "procs", "budget": 3600, "storage": url, "heartbeat_s": 1, "stale_after_s": 4,
           "pruner": {"kind": "none"}, "calibration": {"steps": 20, "max_s": 300},
           "space": {"train.epochs": {"low": 1, "high": 3}, "train.lr": {"low": 1e-3, "high": 1e-2, "log": True}}}
    raw.update(over)
    path = tmp_path / "space.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def _end(proc: subprocess.Popen, timeout_s: float = 120) -> int:
    try:
        return proc.wait(timeout=timeout_s)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        proc.log.close()


@pytest.fixture
def spawn(tmp_path):
    """Start `python -m tests.pg_worker` processes; whatever still runs at the end is killed."""
    started = []

    def start(space: Path, worker_id: str, *args: str) -> subprocess.Popen:
        log = open(tmp_path / f"{worker_id}.log", "w")  # noqa: SIM115 — closed by _end
        proc = subprocess.Popen([sys.executable, "-m", "tests.pg_worker", str(space), str(tmp_path), "--worker-id",
                                 worker_id, *args], cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        proc.log = log
        started.append(proc)
        return proc

    yield start
    for proc in started:
        if proc.poll() is None or not proc.log.closed:
            _end(proc, timeout_s=0.1)
    for pgid in (tmp_path / "trial-pgids").read_text().split() if (tmp_path / "trial-pgids").exists() else []:
        try:
            os.killpg(int(pgid), signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_workers_starting_together_queue_one_calibration_per_gpu_count(tmp_path, postgres_url, spawn):
    import optuna

    space = _space(tmp_path, postgres_url, devices=2, space={"train.gpus": {"choices": [1]},
                                                             "train.epochs": {"low": 1, "high": 3}})

    optuna.create_study(study_name="procs", storage=postgres_url, direction="maximize")  # schema once
    at = time.time() + 5  # after every process has imported and connected, on a loaded machine too
    procs = [spawn(space, f"w{i}", "--start-only", "--at", str(at)) for i in range(4)]
    codes = [_end(p) for p in procs]
    assert codes == [0, 0, 0, 0], [(tmp_path / f"w{i}.log").read_text() for i in range(4)]
    waiting = _load(postgres_url, "procs").get_trials(states=(optuna.trial.TrialState.WAITING,))
    assert [t.user_attrs["gpus"] for t in waiting] == [1], "four workers, one calibration queued"


def test_a_kill9_worker_is_found_by_the_heartbeat_and_a_restarted_one_carries_on(tmp_path, postgres_url, spawn):
    from optuna.trial import TrialState

    from draftlab.procs import group_alive
    from draftlab.sweep.report import trial_rows
    from draftlab.sweep.storage import interrupted

    space = _space(tmp_path, postgres_url)
    a = spawn(space, "A", "--n-trials", "6")
    b = spawn(space, "B", "--n-trials", "6")

    def held_by(worker_id):
        try:
            study = _load(postgres_url, "procs")
        except KeyError:  # not created yet
            return None
        return next((t for t in study.get_trials(states=(TrialState.RUNNING,))
                     if t.user_attrs.get("worker") == worker_id and t.user_attrs.get("role") == "search"
                     and t.user_attrs.get("pgids")), None)

    victim = _wait(lambda: held_by("A"), 120, "worker A to hold a search trial")
    pgid = victim.user_attrs["pgids"][0]
    os.kill(a.pid, signal.SIGKILL)
    a.wait()
    a.log.close()
    assert group_alive(pgid), "the held trial outlives its worker (as torchrun's ranks would)"
    found = _wait(lambda: interrupted(_load(postgres_url, "procs")).get(victim.number), 60,
                  "worker B to find A's trial stale")
    assert found["by"] == "B" and "no heartbeat" in found["reason"]
    assert _load(postgres_url, "procs").trials[victim.number].state == TrialState.FAIL
    _wait(lambda: not group_alive(pgid), 10, "B to stop the dead worker's trial on this host")

    a2 = spawn(space, "A2", "--n-trials", "6")
    _wait(lambda: held_by("A2"), 120, "the restarted worker to take a trial")
    (tmp_path / "release").touch()  # every held search trial may end now
    assert _end(a2) == 0 and _end(b) == 0, (tmp_path / "A2.log").read_text() + (tmp_path / "B.log").read_text()

    study = _load(postgres_url, "procs")
    trials = study.get_trials()
    assert not [t for t in trials if t.state in (TrialState.RUNNING, TrialState.WAITING)]
    assert len([t for t in trials if t.user_attrs.get("role") == "calibration"]) == 1
    dirs = [t.user_attrs["trial_dir"] for t in trials if "trial_dir" in t.user_attrs]
    assert len(dirs) == len(set(dirs)) == len(trials), "every trial launched once"
    assert {t.user_attrs["worker"] for t in trials if t.state == TrialState.COMPLETE} >= {"A2"}
    row = next(r for r in trial_rows(study) if r["number"] == victim.number)
    assert row["status"] == "interrupted" and row["run_id"] == f"run-{victim.number}"


@pytest.fixture
def tracking_server(postgres_cluster, tmp_path):
    """compose's MLflow server (tests/mlflow_server.py) on a database of its own: Optuna and
    MLflow each create an `alembic_version` table, so they cannot share one."""
    from tests.mlflow_server import MlflowServer

    server = MlflowServer(postgres_cluster.create_database("real_mlflow"), tmp_path / "mlartifacts").start()
    yield server
    server.stop()


def _sinks_holding(secrets: list[str], *, text: str, folders: list[Path], study, runs: list[dict]) -> list[str]:
    """Where any of `secrets` shows: the process's output, any file under `folders`, the study's
    and its trials' attributes, the MLflow runs' params and tags."""
    found = [f"output: {s}" for s in secrets if s in text]
    for folder in folders:
        for path in (p for p in folder.rglob("*") if p.is_file()):
            data = path.read_bytes()
            found += [f"{path}: {s}" for s in secrets if s.encode() in data]
    attrs = json.dumps([study.user_attrs, getattr(study, "system_attrs", {}),  # Optuna 5 keeps no study system attrs
                        *[[t.user_attrs, t.system_attrs, t.params] for t in study.get_trials()]], default=str)
    found += [f"Optuna attributes: {s}" for s in secrets if s in attrs]
    for run in runs:
        data = json.dumps(run["data"])
        found += [f"MLflow run {run['info']['run_id']} params/tags: {s}" for s in secrets if s in data]
    return found


def test_one_real_trial_on_postgresql_logs_to_a_shared_mlflow_server(built, tmp_path, postgres_url, tracking_server):
    """`draftlab sweep` with a postgresql:// storage runs a real trial (train under torchrun +
    evaluate) and logs it to compose's MLflow server (PostgreSQL store, proxied artifacts, a
    login): the nested trial run's params, metrics and artifacts are readable through the REST
    API. The calibration is given, so the one trial is the search trial. The database password
    (in the storage URL, as a user would type it) and the MLflow password (in the environment)
    are planted secrets: neither shows in any sink draftlab writes."""
    import optuna
    import requests

    from draftlab.plan.costmodel import Point
    from draftlab.sweep import calibration

    params, target_dir, data_dir, store_dir = built
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(trial_params(params)))
    (tmp_path / "space.yaml").write_text(yaml.safe_dump({
        "study": "real", "params": "params.yaml", "budget": 1800, "devices": 1, "storage": postgres_url,
        "pruner": {"kind": "none"}, "calibration": {"reuse": False},
        "space": {"train.lr": {"low": 1e-3, "high": 1e-2, "log": True}}}))

    study = optuna.create_study(study_name="real", storage=postgres_url, direction="maximize")
    calibration.save(study, Point(1, fixed_s=30, step_s=0.5, epoch_s=2, tokens_per_s=500, steps=21, epochs=2,
                                  wall_s=45, source="stated", after_s=10))
    env = dict(os.environ, MLFLOW_TRACKING_URI=tracking_server.url, HF_HUB_OFFLINE="1", **tracking_server.login_env)
    cmd = [sys.executable, "-m", "draftlab.cli", "sweep", "space.yaml", "--target", str(target_dir),
           "--data", str(data_dir), "--store", str(store_dir), "--out", "sweeps", "--n-trials", "1"]
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout + done.stderr
    from tests.postgres import PASSWORD

    assert f":{PASSWORD}@" in postgres_url, "the database password is in the URL the sweep was given"
    assert "postgresql://draftlab:***@127.0.0.1" in done.stdout + done.stderr, "the storage is named, its password hidden"
    trials = _load(postgres_url, "real").get_trials()
    assert [t.state.name for t in trials] == ["COMPLETE"]
    assert _load(postgres_url, "real").metric_names == ["eval/simulated_acc_len"]
    run_id = trials[0].user_attrs["run_id"]
    rows = (tmp_path / "sweeps" / "real" / "report" / "trials.csv").read_text()
    assert run_id in rows
    from draftlab.rundir import TrialDir

    result = TrialDir(tmp_path / trials[0].user_attrs["trial_dir"]).result.read()
    assert result.ok and result.run_id == run_id

    # --- the trial's run, read back through the server's REST API
    api = f"{tracking_server.url}/api/2.0/mlflow"
    auth = tracking_server.auth
    run = requests.get(f"{api}/runs/get", params={"run_id": run_id}, auth=auth, timeout=30).json()["run"]
    assert run["info"]["status"] == "FINISHED"
    assert run["info"]["artifact_uri"].startswith("mlflow-artifacts:"), "artifacts go through the server"
    tags = {t["key"]: t["value"] for t in run["data"]["tags"]}
    parent = tags["mlflow.parentRunId"]
    parent_run = requests.get(f"{api}/runs/get", params={"run_id": parent}, auth=auth, timeout=30).json()["run"]
    assert parent_run["info"]["status"] == "FINISHED", "the sweep's parent run, ended"
    assert {t["key"]: t["value"] for t in parent_run["data"]["tags"]}["optuna.storage"].startswith(
        "postgresql://draftlab:***@127.0.0.1:"), "the study's storage, recorded without its password"
    assert tags["draftlab.accounting"] == "verified"
    assert "train.resolved_lr" in {p["key"] for p in run["data"]["params"]}
    assert {"train/loss", "eval/simulated_acc_len", "eval/measured_acc_len"} <= {m["key"] for m in run["data"]["metrics"]}

    def listed(run, path=None):
        body = requests.get(f"{api}/artifacts/list", params={"run_id": run, **({"path": path} if path else {})},
                            auth=auth, timeout=30).json()
        return {f["path"] for f in body.get("files", [])}

    assert {"accounting.json", "checkpoint", "evaluate"} <= listed(run_id)
    assert "checkpoint/model.safetensors" in listed(run_id, "checkpoint")
    assert {"evaluate/acceptance_by_position.png", "evaluate/loss_per_ttt_step.png"} <= listed(run_id, "evaluate")
    assert "sweep/trials.csv" in listed(parent, "sweep")
    assert list((tmp_path / "mlartifacts").rglob("model.safetensors")), "stored in --artifacts-destination"

    # --- no secret left the shell: the sweep's output, its folders (report, trial folders, run
    # folders, spools), the artifacts it uploaded, the study's attributes, the runs' params and tags
    leaks = _sinks_holding([PASSWORD, tracking_server.auth[1]], text=done.stdout + done.stderr,
                           folders=[tmp_path / "sweeps", tmp_path / "mlartifacts"],
                           study=_load(postgres_url, "real"), runs=[run, parent_run])
    assert not leaks, leaks
