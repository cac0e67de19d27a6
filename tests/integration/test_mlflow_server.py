"""A team's MLflow server for real: compose.yaml's `mlflow server` command on 127.0.0.1 with a
PostgreSQL backend store and proxied artifacts. `dvc repro` (train, evaluate, export) and a
one-trial sweep log to it through MLFLOW_TRACKING_URI; the server is killed mid-training and
started again; everything is then read back through its REST API."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from tests.checkout import checkout_copy, sh
from tests.waiting import wait_for



@pytest.fixture
def mlflow_server(postgres_url, tmp_path, monkeypatch):
    """The server, and this test's processes (and those they start) logged in to it."""
    from tests.mlflow_server import MlflowServer

    server = MlflowServer(postgres_url, tmp_path / "mlartifacts").start()
    for key, value in server.login_env.items():
        monkeypatch.setenv(key, value)
    yield server
    server.stop()


def test_the_team_server_refuses_a_request_without_a_login(mlflow_server):
    """compose's server is closed by default: only /health answers without a login, and a
    wrong password is refused too. It starts none of MLflow's job runners (compose turns them
    off: 8 processes that serve nothing draftlab logs)."""
    import requests

    from tests.conftest import descendants

    started = list(descendants(mlflow_server.proc.pid).values())
    assert not [cmd for cmd in started if "mlflow.server.jobs" in cmd], f"MLflow's job runners run: {started}"

    api = f"{mlflow_server.url}/api/2.0/mlflow/experiments/search"
    assert requests.get(f"{mlflow_server.url}/health", timeout=30).status_code == 200
    assert requests.get(api, params={"max_results": 1}, timeout=30).status_code == 401
    assert requests.get(api, params={"max_results": 1}, auth=("admin", "wrong"), timeout=30).status_code == 401
    assert requests.get(api, params={"max_results": 1}, auth=mlflow_server.auth, timeout=30).status_code == 200


def _run(cmd, cwd, env, **kw):
    proc = sh(cmd, cwd, env, **kw)
    return proc.stdout + proc.stderr


def _repo_with_store(built, dest: Path, **train) -> Path:
    """The repo's tracked files in `dest` (a git repo), with the session's target, dataset and
    store where dvc.yaml expects them and its tiny params as params.yaml: `dvc repro
    --downstream train` then runs train, evaluate and export only."""
    params, target_dir, data_dir, store_dir = built
    raw = params.model_dump()
    raw["train"].update(train)
    raw["evaluate"].update({"num_prompts": 4, "max_new_tokens": 12})
    return checkout_copy(dest, whole_params=raw, placed={"models/target": target_dir, "data/prepared": data_dir,
                                                         "data/hidden_states": store_dir})[0]


def _repro_until_the_server_dies(built, tmp_path: Path, mlflow_server):
    """`dvc repro --downstream train` (train, evaluate, export) of a checkout on the session's store,
    logging to the server, which is killed after epoch 1's checkpoint while the rank is held
    (SIGSTOP), so the steps after it certainly meet the outage. (the dvc process, repo, env)."""
    from tests.conftest import train_ranks_of

    env = dict(os.environ, MLFLOW_TRACKING_URI=mlflow_server.url, HF_HUB_OFFLINE="1",
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    repo = _repo_with_store(built, tmp_path / "repo", epochs=2, total_seq_len=96, draft_vocab_size=64,
                            num_workers=0)
    out = repo / "runs/train"
    dvc = subprocess.Popen(["dvc", "repro", "--downstream", "train"], cwd=repo, env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True)
    wait_for(lambda: (out / "checkpoints" / "0" / "training_state.json").exists(), 300, "epoch 1's checkpoint", dvc)
    ranks = wait_for(lambda: train_ranks_of(out), 30, "the rank")
    for pid in ranks:
        os.kill(pid, signal.SIGSTOP)
    mlflow_server.kill()
    for pid in ranks:
        os.kill(pid, signal.SIGCONT)
    return dvc, repo, env


def _hold(root: int) -> list[int]:
    """SIGSTOP `root` and every process under it (twice over: one forking meanwhile is caught)."""
    from tests.conftest import descendants

    held: list[int] = []
    for _ in range(2):
        for pid in [root, *descendants(root)]:
            if pid not in held:
                try:
                    os.kill(pid, signal.SIGSTOP)
                    held.append(pid)
                except ProcessLookupError:
                    pass
    return held


def _release(held: list[int]) -> None:
    for pid in held:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass


def _spooled_steps(spool: Path) -> list[int]:
    if not spool.exists():
        return []
    recs = [json.loads(line) for line in spool.read_text().splitlines()]
    return [r["step"] for r in recs if r["kind"] == "metrics" and "train/loss" in r["metrics"]]


def test_dvc_repro_and_a_sweep_log_to_a_shared_server_through_an_outage(built, tmp_path, mlflow_server, monkeypatch):
    import mlflow
    import requests

    # --- dvc repro: train, evaluate, export; the server dies after epoch 1's checkpoint
    dvc, repo, env = _repro_until_the_server_dies(built, tmp_path, mlflow_server)
    out, spool = repo / "runs/train", repo / "runs/train/tracking-spool.jsonl"
    wait_for(lambda: _spooled_steps(spool), 120, "the launcher to keep an outage step of rank 0 in the spool", dvc)
    # the server comes back (same port, same PostgreSQL store) while the pipeline is held: the
    # rank no longer waits on the server, and would otherwise race its restart to evaluate's writes
    held = _hold(dvc.pid)
    try:
        mlflow_server.start()
    finally:
        _release(held)
    output = dvc.communicate(timeout=600)[0]
    assert dvc.returncode == 0, output[-4000:]
    assert "upload them with `draftlab tracking-import" in output

    client = mlflow.MlflowClient(mlflow_server.url)
    result = json.loads((out / "train.json").read_text())
    run_id, total = result["run_id"], result["total_steps"]
    stall = result["tracking"]
    print(f"\ntracking during the outage: {stall}")  # the measured stall (README, MLflow)
    # rank 0's records reach the server through the launcher (tracking.Relay): it met the outage,
    # and the rank, which writes only its relay file, drained it before each checkpoint all the same
    assert stall["launcher_outages"] >= 1 and stall["drains"] >= 1 and stall["outages"] == 0, stall
    logged = [m.step for m in client.get_metric_history(run_id, "train/loss")]
    missing = sorted(set(range(total)) - set(logged))
    assert missing and set(missing) <= set(_spooled_steps(spool)), "what the server missed is in the spool"

    _run(["draftlab", "tracking-import", str(spool)], repo, env)
    steps = sorted(m.step for m in client.get_metric_history(run_id, "train/loss"))
    assert steps == list(range(total)), "after the import: every step, once"
    assert not spool.exists() and (out / "tracking-spool.imported.jsonl").exists()

    # --- everything is readable through the server's REST API
    api = f"{mlflow_server.url}/api/2.0/mlflow"
    run = requests.get(f"{api}/runs/get", params={"run_id": run_id}, auth=mlflow_server.auth, timeout=30).json()["run"]
    assert run["info"]["status"] == "FINISHED"
    assert run["info"]["artifact_uri"].startswith("mlflow-artifacts:"), "artifacts go through the server"
    params = {p["key"]: p["value"] for p in run["data"]["params"]}
    assert int(params["world_size"]) == 1 and int(params["total_steps"]) == total
    metrics = {m["key"] for m in run["data"]["metrics"]}
    assert {"train/loss", "val/loss_epoch", "perf/tokens_per_s", "eval/simulated_acc_len",
            "eval/measured_acc_len"} <= metrics
    tags = {t["key"]: t["value"] for t in run["data"]["tags"]}
    assert tags["draftlab.accounting"] == "verified" and tags["draftlab.export"]

    def listed(path=None):
        body = requests.get(f"{api}/artifacts/list", auth=mlflow_server.auth,
                            params={"run_id": run_id, **({"path": path} if path else {})},
                            timeout=30).json()
        return {f["path"] for f in body.get("files", [])}

    assert {"accounting.json", "accounting-check.json", "checkpoint", "evaluate", "export"} <= listed()
    assert {"checkpoint/config.json", "checkpoint/model.safetensors"} <= listed("checkpoint")
    assert {"evaluate/acceptance_by_position.png", "evaluate/loss_per_ttt_step.png"} <= listed("evaluate")
    fetched = mlflow.artifacts.download_artifacts(run_id=run_id, artifact_path="checkpoint/model.safetensors",
                                                  dst_path=str(tmp_path / "dl"), tracking_uri=mlflow_server.url)
    checkpoint = Path(result["checkpoint"])
    assert Path(fetched).read_bytes() == (checkpoint / "model.safetensors").read_bytes()
    account = json.loads(Path(mlflow.artifacts.download_artifacts(
        run_id=run_id, artifact_path="accounting.json", dst_path=str(tmp_path / "dl"),
        tracking_uri=mlflow_server.url)).read_text())
    assert account["total_steps"] == total
    assert list((tmp_path / "mlartifacts").rglob("model.safetensors")), "stored in --artifacts-destination"
    assert json.loads((repo / "reports/metrics.json").read_text())["run_id"] == run_id

    # --- a short sweep on the same server: the sweep's own writes (parent run, report artifacts,
    # trial run ids) are real; its trials are the injected fake launcher's, each a nested run
    from draftlab.params import load_params
    from draftlab.sweep import study as sweep_study
    from draftlab.sweep.space import read_spec

    (repo / "space.yaml").write_text(yaml.safe_dump({
        "study": "shared", "params": "params.yaml", "budget": "2h", "devices": 1, "pruner": {"kind": "none"},
        "calibration": {"steps": 20, "max_steps": 20, "max_s": 600},
        "space": {"train.epochs": {"low": 1, "high": 3}, "train.lr": {"low": 1e-3, "high": 1e-2, "log": True},
                  "train.gpus": {"choices": [1]}}}))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server.url)
    monkeypatch.chdir(repo)
    launcher = NestedRunLauncher(client, "shared")
    sweep_study.run(read_spec(repo / "space.yaml"), load_params(repo / "params.yaml"), target_dir=repo / "models/target",
                    data_dir=repo / "data/prepared", store_dir=repo / "data/hidden_states", out_dir=repo / "runs/sweeps",
                    n_trials=3, clock=launcher.clock, launcher=launcher)
    exp = client.get_experiment_by_name("draftlab").experiment_id
    parents = client.search_runs([exp], "tags.`draftlab.stage` = 'sweep'")
    assert len(parents) == 1 and parents[0].info.status == "FINISHED"
    parent = parents[0].info.run_id
    children = client.search_runs([exp], f"tags.`mlflow.parentRunId` = '{parent}'")
    assert sorted(c.info.run_id for c in children) == sorted(launcher.run_ids) and len(children) == 3, \
        "a calibration and 2 search trials, each nested under the sweep"
    summary = json.loads(Path(mlflow.artifacts.download_artifacts(
        run_id=parent, artifact_path="sweep/summary.json", dst_path=str(tmp_path / "dl"),
        tracking_uri=mlflow_server.url)).read_text())
    assert summary["trials"]["completed"] == 2 and summary["trials"]["calibration"] == 1
    assert {"sweep/trials.csv", "sweep/best_params.json"} <= {a.path for a in client.list_artifacts(parent, "sweep")}
    assert "sweep/best_value" in client.get_run(parent).data.metrics


def test_a_server_that_stays_down_to_the_end_costs_one_import(built, tmp_path, mlflow_server):
    """The server dies mid-training and is not back before `dvc repro` ends: train, evaluate and
    export still exit 0, each with one line naming its spool and `draftlab tracking-import`;
    started again, one import of those spools makes the run complete and FINISHED, no rerun."""
    import mlflow
    import requests

    dvc, repo, env = _repro_until_the_server_dies(built, tmp_path, mlflow_server)  # down until dvc repro ends
    out, spool = repo / "runs/train", repo / "runs/train/tracking-spool.jsonl"
    output = dvc.communicate(timeout=900)[0]
    assert dvc.returncode == 0, output[-4000:]
    flat = [" ".join(line.split()) for line in output.splitlines()]
    spools = {"train": spool, "evaluate": repo / ".reports.tracking-spool.jsonl",
              "export": repo / "models/.draft.tracking-spool.jsonl"}
    for stage, path in spools.items():
        rel = path.relative_to(repo)
        named = [line for line in flat if f"draftlab tracking-import {rel}" in line]
        assert len(named) == 1, f"{stage}: one line names {rel}: {named}"
        assert path.is_file(), f"{stage} kept its records in {rel}"
    assert "Traceback" not in output
    assert json.loads((repo / "reports/metrics.json").read_text())["run_id"] == json.loads(
        (out / "train.json").read_text())["run_id"]
    kinds = [json.loads(line)["kind"] for line in spool.read_text().splitlines()]
    assert kinds[-1] == "end" and {"metrics", "artifact", "tags"} <= set(kinds), "the launcher's end-of-run writes"

    mlflow_server.start()  # same port, same PostgreSQL store
    _run(["draftlab", "tracking-import", *(str(p.relative_to(repo)) for p in spools.values())], repo, env)
    assert not any(p.exists() for p in spools.values())
    client = mlflow.MlflowClient(mlflow_server.url)
    result = json.loads((out / "train.json").read_text())
    run_id, total = result["run_id"], result["total_steps"]
    steps = sorted(m.step for m in client.get_metric_history(run_id, "train/loss"))
    assert steps == list(range(total)), "every step, once"
    api = f"{mlflow_server.url}/api/2.0/mlflow"
    run = requests.get(f"{api}/runs/get", params={"run_id": run_id}, auth=mlflow_server.auth, timeout=30).json()["run"]
    assert run["info"]["status"] == "FINISHED" and int(run["info"]["end_time"]) > int(run["info"]["start_time"])
    metrics = {m["key"] for m in run["data"]["metrics"]}
    assert {"train/loss", "perf/run_wall_clock_s", "eval/simulated_acc_len", "eval/measured_acc_len"} <= metrics
    tags = {t["key"]: t["value"] for t in run["data"]["tags"]}
    assert tags["draftlab.accounting"] == "verified" and tags["draftlab.export"] and tags["draftlab.bottleneck"]
    top = {a.path for a in client.list_artifacts(run_id)}
    assert {"accounting.json", "accounting-check.json", "bottleneck.json", "checkpoint", "evaluate", "export"} <= top
    assert {"export/config.json"} <= {a.path for a in client.list_artifacts(run_id, "export")}


class _Clock:
    def __init__(self):
        self.t = time.time()

    def now(self):
        return self.t

    def sleep(self, seconds):
        self.t += seconds


class NestedRunLauncher:
    """Trials that take simulated time (a 20 s start-up + 1 s per epoch) and are each a nested
    MLflow run under the sweep's parent, with the objective the real trial logs."""

    def __init__(self, client, study: str):
        self.client, self.study, self.clock, self.run_ids = client, study, _Clock(), []

    def start(self, spec):
        from draftlab.sweep.budget import Outcome

        exp = self.client.get_experiment_by_name("draftlab").experiment_id
        parent = self.client.search_runs([exp], "tags.`draftlab.stage` = 'sweep'")[0].info.run_id
        run = self.client.create_run(exp, run_name=f"{self.study}-trial-{spec.number}", tags={
            "mlflow.parentRunId": parent, "draftlab.sweep.trial": str(spec.number), "draftlab.sweep.role": spec.role})
        self.run_ids.append(run.info.run_id)
        p, t0, clock = spec.params, self.clock.now(), self.clock
        wall = 20.0 + p.train.epochs
        value = None if spec.role == "calibration" else 1.0 + 0.1 * p.train.epochs
        if value is not None:
            self.client.log_metric(run.info.run_id, "sweep/objective", value)
        self.client.set_terminated(run.info.run_id, "FINISHED")
        timing = {"steps": 21 if spec.role == "calibration" else 20 * p.train.epochs, "epochs": p.train.epochs,
                  "step_s": 0.5, "epoch_s": 1.0, "tokens_per_s": 100.0, "wall_s": wall - 2, "stable": True}

        class Handle:
            pgids: list = []

            def poll(self):
                done = clock.now() - t0 >= wall
                return Outcome(True, value, wall, run_id=run.info.run_id, timing=timing) if done else None

            def intermediate(self):
                return {}

            def run_id(self):
                return run.info.run_id

            def terminate(self):
                pass

            def kill(self):
                pass

        return Handle()

    def reap(self, trial_dir, pgids, host):
        pass
