"""Online training (`train.source: vllm`) against the real vLLM (the CPU build), started and stopped
by draftlab: 2 gloo ranks whose loaders each ask the one server for every sample's hidden states,
no store read or written, the step accounting checked, one MLflow run naming its source, `draftlab
status`, a kill -9 mid-training resumed in the same run with nothing left running, then `draftlab
evaluate` of the draft on hidden states from a server of its own.

Needs vLLM (DRAFTLAB_VLLM_PYTHON or the checkout's .venv-vllm); skips with the reason without it.
The session's tiny target has one head of size 32, the smallest vLLM's CPU attention serves."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from draftlab.rundir import RunDir
from draftlab.serve import vllm_env

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(vllm_env.vllm_unavailable_reason() is not None,
                                 reason=vllm_env.vllm_unavailable_reason() or "")]


def _ours(mark: str) -> list[int]:
    """Live processes started under this test's marker (the launcher, torchrun, the ranks, the vLLM
    server and its engine, which vLLM retitles: found by their environment)."""
    want, pids = f"DRAFTLAB_TEST_MARK={mark}".encode(), []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                env = (d / "environ").read_bytes().split(b"\0")
                state = (d / "stat").read_text().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue
            if want in env and state not in ("Z", "X"):
                pids.append(int(d.name))
    return pids


def _wait_for(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out after {timeout_s:.0f} s waiting for {what}"
        time.sleep(0.05)


def test_online_training_on_two_ranks_resumes_after_kill_9_and_its_draft_evaluates(built, tmp_path, mlflow_store):
    params, target_dir, data_dir, store_dir = built
    raw = params.model_dump()
    raw["train"].update({"source": "vllm", "gpus": 2, "epochs": 3, "total_seq_len": 128, "draft_vocab_size": 64})
    raw["evaluate"].update({"num_prompts": 2, "max_new_tokens": 8})
    params_path = tmp_path / "params.yaml"
    params_path.write_text(yaml.safe_dump(raw))
    out, no_store, mark = tmp_path / "run", tmp_path / "no-store", str(tmp_path)
    env = dict(os.environ, DRAFTLAB_TEST_MARK=mark)
    cli = [sys.executable, "-m", "draftlab.cli"]
    train = [*cli, "train", "--params", str(params_path), "--target", str(target_dir), "--data", str(data_dir),
             "--store", str(no_store), "--out", str(out)]

    # killed right after its first checkpoint: the server and both ranks go with the launcher
    proc = subprocess.Popen(train, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 600
    while not (out / "checkpoints" / "0" / "training_state.json").exists():
        assert proc.poll() is None, proc.stderr.read()[-3000:]
        assert time.monotonic() < deadline, "no checkpoint in 10 min"
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not RunDir(out).train.exists(), "killed before the end"
    _wait_for(lambda: not _ours(mark), 30, "the server and the ranks to die with their launcher")
    run_id = RunDir(out).run.read().run_id

    done = subprocess.run(train, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert not _ours(mark), "nothing left running"
    assert not no_store.exists() and not (tmp_path / ".vllm-run").exists(), "no store, no hidden-state file left"
    record = RunDir(out).train.read()
    assert record.run_id == run_id, "the resumed run is the killed one"
    runs = mlflow_store.search_runs([mlflow_store.get_experiment_by_name("draftlab").experiment_id])
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"
    run = runs[0]
    assert run.data.params["hidden_states.source"] == "vllm" and run.data.params["train.source"] == "vllm"
    assert int(run.data.params["world_size"]) == 2
    assert int(run.data.tags["draftlab.resumed_from_step"]) > 0
    check = json.loads((out / "accounting-check.json").read_text())
    assert check == {"problems": [], "observed_steps": record.total_steps}, "the plan's steps are the trainer's"
    steps = [m.step for m in mlflow_store.get_metric_history(run_id, "train/loss")]
    assert sorted(steps) == list(range(record.total_steps)), "each step logged once across the kill"
    status = json.loads(subprocess.run([*cli, "status", str(out), "--json"], env=env, capture_output=True,
                                       text=True, check=True).stdout)
    assert status["state"] == "finished" and status["step"] == record.total_steps
    assert status["convergence"]["trend"], "the convergence watch ran"

    reports = tmp_path / "reports"
    done = subprocess.run([*cli, "evaluate", "--params", str(params_path), "--target", str(target_dir), "--data",
                           str(data_dir), "--store", str(no_store), "--train", str(out), "--out", str(reports)],
                          env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert not _ours(mark), "evaluate's server is stopped"
    metrics = json.loads((reports / "metrics.json").read_text())
    assert metrics["run_id"] == run_id and metrics["eval/val_samples"] == 4
    assert 1.0 <= metrics["eval/simulated_acc_len"] <= 1 + params.train.ttt_steps
    assert metrics["eval/measured_acc_len"] >= 1.0


def test_dvc_repro_of_the_online_pipeline_trains_without_a_store(reproduced, tmp_path):
    """`dvc repro online/dvc.yaml` in a user's checkout where `dvc repro` already ran (a copy of the
    session's, tests/integration/conftest.py), with smaller train and evaluate params: the root
    pipeline's target and prepare are up to date, train, evaluate and export run online; no store
    read or made for them; a second repro has nothing to do."""
    from draftlab.params import merge
    from tests.checkout import COMMIT, copy_checkout, sh

    session_root, env, _ = reproduced
    root = copy_checkout(session_root, tmp_path / "repo")
    for made in (root / "data").iterdir():  # the offline store, its work folder and check: online needs none
        if made.name != "prepared":
            shutil.rmtree(made) if made.is_dir() else made.unlink()
    raw = merge(yaml.safe_load((root / "params.yaml").read_text()), {
        "train": {"epochs": 1, "total_seq_len": 128, "draft_vocab_size": 64},
        "evaluate": {"num_prompts": 2, "max_new_tokens": 8}})
    (root / "params.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    sh([*COMMIT, "smaller online run", "params.yaml"], root, env)
    env = dict(env, DRAFTLAB_TEST_MARK=str(tmp_path))
    done = sh(["dvc", "repro", "online/dvc.yaml"], root, env)
    ran = [line for line in done.stdout.splitlines() if line.startswith("Running stage")]
    assert "Stage 'target' didn't change, skipping" in done.stdout + done.stderr
    assert "Stage 'prepare' didn't change, skipping" in done.stdout + done.stderr
    assert ran == ["Running stage 'online/dvc.yaml:train':", "Running stage 'online/dvc.yaml:evaluate':",
                   "Running stage 'online/dvc.yaml:export':"]
    assert sorted(p.name for p in (root / "data").iterdir()) == ["prepared"], "no store, no store check"
    metrics = json.loads((root / "reports" / "online" / "metrics.json").read_text())
    assert metrics["run_id"] == RunDir(root / "runs" / "train-online").train.read().run_id
    assert (root / "models" / "draft-online" / "config.json").is_file()
    assert not _ours(str(tmp_path)), "every server stopped"
    again = sh(["dvc", "repro", "online/dvc.yaml"], root, env)
    assert "Running stage" not in again.stdout and "Data and pipelines are up to date." in again.stdout


@pytest.fixture(scope="module")
def users_server(built, tmp_path_factory):
    """The extraction server a user starts for `train.vllm_url` (the command docs/gpu-host.md gives,
    built by draftlab's own `server_command`, CPU connector), shared by this module's tests that
    use it; the fixture stops it and checks its process group is gone."""
    from draftlab import procs
    from draftlab.serve import serving
    from draftlab.store import vllm_extract

    params, target_dir, _, _ = built
    root = tmp_path_factory.mktemp("users-vllm")
    shared = root / "server-files"  # the server's connector writes here; a loader reads each file once
    shared.mkdir()
    cmd = vllm_extract.server_command(params, python=vllm_env.vllm_python(), model=str(target_dir),
                                      num_layers=params.target.tiny.num_layers, hidden_states_path=shared, cuda=False)
    with serving.running(vllm_extract.guard_command(cmd), log_path=root / "user-vllm.log", what="the user's vLLM",
                         startup_timeout_s=600, env=vllm_extract.server_env([]), api_key=False) as server:
        yield server, shared
    assert not procs.group_alive(server.pid), "the user's server is stopped"


def _online_params(params, server, tmp_path: Path) -> Path:
    raw = params.model_dump()
    raw["train"].update({"source": "vllm", "vllm_url": f"{server.base_url}/v1", "gpus": 1, "epochs": 1,
                         "total_seq_len": 128, "draft_vocab_size": 64})
    raw["evaluate"].update({"num_prompts": 2, "max_new_tokens": 8})
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def test_training_against_a_server_the_user_started_leaves_it_running(built, users_server, tmp_path, mlflow_store):
    """`train.vllm_url`: `draftlab train` trains against the user's server (1 rank, 1 epoch), starts
    no server of its own and leaves the user's answering."""
    params, target_dir, data_dir, _ = built
    server, shared = users_server
    params_path = _online_params(params, server, tmp_path)
    out, mark = tmp_path / "run", str(tmp_path)
    done = subprocess.run([sys.executable, "-m", "draftlab.cli", "train", "--params", str(params_path),
                           "--target", str(target_dir), "--data", str(data_dir), "--store",
                           str(tmp_path / "no-store"), "--out", str(out)],
                          env=dict(os.environ, DRAFTLAB_TEST_MARK=mark), capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "starting vLLM" not in done.stdout, "draftlab started no server of its own"
    assert not _ours(mark), "nothing of draftlab's left running"
    assert json.loads(server.get("/v1/models"))["data"][0]["id"] == str(target_dir), "the user's server still serves"
    record = RunDir(out).train.read()
    (run,) = mlflow_store.search_runs([mlflow_store.get_experiment_by_name("draftlab").experiment_id])
    assert run.info.run_id == record.run_id and run.info.status == "FINISHED"
    assert run.data.params["hidden_states.source"] == "vllm"
    assert run.data.params["hidden_states.vllm_server"] == "user"
    assert json.loads((out / "accounting-check.json").read_text())["problems"] == []
    assert not list(shared.iterdir()), "every sample's file was read once and deleted"
    assert not (tmp_path / "no-store").exists()


def test_a_sweep_online_shares_the_users_server(built, users_server, tmp_path, mlflow_store):
    """`draftlab sweep` with train.vllm_url and no store: the calibration and a search trial train and
    evaluate against the one server, a best draft is named, the server keeps serving."""
    import csv

    params, target_dir, data_dir, _ = built
    server, _ = users_server
    params_path = _online_params(params, server, tmp_path)
    space = tmp_path / "space.yaml"
    space.write_text(yaml.safe_dump({
        "study": "online", "params": str(params_path), "budget": "8m", "devices": 1, "stop_grace_s": 10,
        "pruner": {"kind": "none"}, "calibration": {"steps": 20, "max_s": 150},
        "space": {"train.lr": {"low": 1e-3, "high": 2e-2, "log": True}, "train.epochs": {"low": 1, "high": 1}}}))
    mark = str(tmp_path)
    done = subprocess.run([sys.executable, "-m", "draftlab.cli", "sweep", str(space), "--n-trials", "2",
                           "--target", str(target_dir), "--data", str(data_dir), "--store", str(tmp_path / "no-store"),
                           "--out", str(tmp_path / "sweeps")],
                          env=dict(os.environ, DRAFTLAB_TEST_MARK=mark), capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    with open(tmp_path / "sweeps" / "online" / "report" / "trials.csv") as f:
        rows = list(csv.DictReader(f))
    assert [(r["role"], r["state"]) for r in rows] == [("calibration", "FAIL"), ("search", "COMPLETE")]
    assert float(rows[1]["value"]) >= 1.0, "the trial's draft was evaluated"
    assert not _ours(mark), "nothing of the sweep's left running"
    assert json.loads(server.get("/v1/models"))["data"][0]["id"] == str(target_dir), "the user's server still serves"
    assert not (tmp_path / "no-store").exists()
