"""`draftlab sweep` for real: the CLI, real trial processes (draftlab train under torchrun +
draftlab evaluate), a real Optuna journal, a real MLflow store written by concurrent trials;
kill -9 of the sweep mid-trial, then the same command again."""

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

from draftlab.rundir import TrialDir
from tests.conftest import trial_params
from tests.waiting import wait_for

_wait = functools.partial(wait_for, poll_s=1)  # a study is read from storage: poll it less often


BUDGET_S = 1800  # never the limit here: --n-trials ends the resumed sweep, whatever this host's speed


def _alive(pgid: int) -> bool:
    from draftlab.procs import group_alive

    return group_alive(pgid)  # a zombie left to pytest (the suite's subreaper) runs nothing


def test_sweep_kill9_resume_nested_runs_and_budget(built, tmp_path):
    import mlflow
    import optuna
    from optuna.storages.journal import JournalFileBackend

    params, target_dir, data_dir, store_dir = built
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(trial_params(params)))
    (tmp_path / "space.yaml").write_text(yaml.safe_dump({
        "study": "it", "params": "params.yaml", "budget": BUDGET_S, "devices": 2, "stop_grace_s": 5,
        "pruner": {"kind": "none"},
        # one calibration of 20 steps, never redone for an unsettled step time, never cut by its cap:
        # trial 0 is the calibration and the next ones are search trials, however loaded this host is
        "calibration": {"steps": 20, "max_steps": 20, "max_s": 1200},
        # one GPU count: two trials share the two slots, so two processes write the sqlite store at once
        "space": {"train.epochs": {"low": 1, "high": 2}, "train.lr": {"low": 1e-3, "high": 1e-2, "log": True},
                  "train.gpus": {"choices": [1]}}}))
    env = dict(os.environ, MLFLOW_TRACKING_URI=f"sqlite:///{tmp_path / 'mlflow.db'}", HF_HUB_OFFLINE="1")
    cmd = [sys.executable, "-m", "draftlab.cli", "sweep", "space.yaml", "--target", str(target_dir),
           "--data", str(data_dir), "--store", str(store_dir), "--out", "sweeps"]
    study_dir = tmp_path / "sweeps" / "it"

    first = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             start_new_session=True)
    t_first = time.time()
    # kill -9 once a search trial's ranks run (the calibration trial, number 0, has finished)
    victim = _wait(lambda: next((p.parent.parent for p in sorted(study_dir.glob("trial-*/train/launch.json"))
                                 if p.parent.parent.name != "trial-0000"), None), 200, "a search trial's torchrun")
    # kill -9 every process of the sweep worker's tree above the ranks (torchrun gives them
    # sessions of their own; they must go by themselves)
    from tests.conftest import descendants, train_ranks_of

    # its ranks run, and its MLflow run exists (a new run's is made once torchrun is started)
    _wait(lambda: train_ranks_of(victim / "train") and TrialDir(victim).train.run.exists(), 120,
          "the victim's ranks and MLflow run")
    tree = [first.pid] + sorted(pid for pid, cmd in descendants(first.pid).items() if "draftlab.training.rank" not in cmd)
    for pid in tree:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    first.wait()
    _wait(lambda: not train_ranks_of(victim / "train"), 10, "no rank of the killed trial alive")
    out_first = first.stdout.read().decode()
    wall_first = time.time() - t_first
    assert "calibration at 1 GPU(s)" in out_first, out_first
    torchrun_pgid = TrialDir(victim).train.launch_file().read().pgid
    time.sleep(3)  # downtime: not the sweep's time
    journal = optuna.storages.JournalStorage(JournalFileBackend(str(study_dir / "journal.log")))
    launched = sum(1 for t in optuna.load_study(study_name="it", storage=journal).get_trials()
                   if t.user_attrs.get("trial_dir"))

    t_second = time.time()  # the resumed sweep runs two trials more than were launched before the kill
    second = subprocess.run(cmd + ["--n-trials", str(launched + 2)], cwd=tmp_path, env=env, capture_output=True,
                            text=True, timeout=BUDGET_S + 200)
    wall_second = time.time() - t_second
    out = second.stdout + second.stderr
    assert second.returncode == 0, out
    assert "interrupted" in out

    storage = optuna.storages.JournalStorage(JournalFileBackend(str(study_dir / "journal.log")))
    study = optuna.load_study(study_name="it", storage=storage)
    trials = study.get_trials()
    killed = next(t for t in trials if Path(t.user_attrs.get("trial_dir", "")).name == victim.name)
    assert killed.state.name == "FAIL" and killed.user_attrs["status"] == "interrupted"
    assert not _alive(torchrun_pgid), "the killed sweep's orphaned ranks were stopped"
    assert not TrialDir(victim).result.exists() and not TrialDir(victim).train.train.exists(), \
        "the orphaned trial was stopped at the rerun's start, not left to finish on its own"
    assert not any(t.state.name == "RUNNING" for t in trials)
    calibrations = [t for t in trials if t.user_attrs.get("role") == "calibration"]
    assert len(calibrations) == 1, "calibration is cached, not redone"
    assert calibrations[0].state.name == "FAIL" and calibrations[0].user_attrs["status"] == "calibration", \
        "a calibration is timing: never told to the study as a completed trial"
    assert len({t.user_attrs.get("trial_dir") for t in trials if t.user_attrs.get("trial_dir")}) == \
        len([t for t in trials if t.user_attrs.get("trial_dir")]), "no trial folder is used twice"

    summary = json.loads((study_dir / "report" / "summary.json").read_text())
    assert summary["spent_s"] <= BUDGET_S + 5 + 10, summary  # budget + stated grace + a poll and a heartbeat
    assert summary["spent_s"] <= wall_first + wall_second + 1, "the downtime between the runs is not counted"
    assert summary["spent_s"] >= wall_first - 6, "the first run's time is still counted after the kill"
    rows = (study_dir / "report" / "trials.csv").read_text().splitlines()
    from draftlab.sweep.propose import rejected

    assert len(rows) == len(trials) + len(rejected(study)) + 1 and "interrupted" in "\n".join(rows)
    assert study.metric_names == ["eval/simulated_acc_len"]
    for t in trials:  # every trial that got an MLflow run (the killed one too) has its id in the study
        state = TrialDir(tmp_path / t.user_attrs["trial_dir"]).train.run.peek() if "trial_dir" in t.user_attrs else None
        if state is not None:
            assert t.user_attrs.get("run_id") == state.run_id, t.number
    assert killed.user_attrs.get("run_id") or TrialDir(victim).train.run.peek() is None
    assert summary["trials"]["completed"] >= 1 and summary["trials"]["calibration"] == 1
    # a search trial's ETA starts from the calibration's measured epoch: the priors a new run's
    # launcher asks MLflow for once the trial's torchrun is started reach its ranks' plan.json
    search = [t for t in trials if t.state.name == "COMPLETE"]
    plans = [TrialDir(tmp_path / t.user_attrs["trial_dir"]).train.plan.read() for t in search]
    assert plans and all(p.epoch_s_prior is not None for p in plans), [p.epoch_s_prior for p in plans]

    client = mlflow.MlflowClient(env["MLFLOW_TRACKING_URI"])
    exp = client.get_experiment_by_name("draftlab")
    parents = client.search_runs([exp.experiment_id], "tags.`draftlab.stage` = 'sweep'")
    assert len(parents) == 1 and parents[0].info.status == "FINISHED"
    parent = parents[0].info.run_id
    children = client.search_runs([exp.experiment_id], f"tags.`mlflow.parentRunId` = '{parent}'")
    assert len(children) >= len([t for t in trials if t.state.name == "COMPLETE"])
    statuses = {c.data.tags["draftlab.sweep.trial"]: c.info.status for c in children}
    assert statuses[str(killed.number)] == "KILLED"
    for t in trials:
        if t.state.name == "COMPLETE":
            assert statuses[str(t.number)] == "FINISHED"
            child = next(c for c in children if c.data.tags["draftlab.sweep.trial"] == str(t.number))
            assert float(child.data.params["train.resolved_lr"]) == pytest.approx(t.params["train.lr"])
            assert "eval/simulated_acc_len" in child.data.metrics
    artifacts = {a.path for a in client.list_artifacts(parent, "sweep")}
    assert {"sweep/trials.csv", "sweep/summary.json", "sweep/best_params.json", "sweep/pareto.png"} <= artifacts
    assert "sweep/best_value" in client.get_run(parent).data.metrics

    # a new study on the same host, store and params calibrates from those trials' MLflow runs
    third = subprocess.run(cmd + ["--study", "again", "--n-trials", "1", "--budget", "1000"], cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=400)
    out3 = third.stdout + third.stderr
    assert third.returncode == 0, out3
    assert "calibration at 1 GPU(s) from mlflow run" in out3, out3
    again = optuna.load_study(study_name="again", storage=optuna.storages.JournalStorage(
        JournalFileBackend(str(tmp_path / "sweeps" / "again" / "journal.log"))))
    assert [t.user_attrs.get("role") for t in again.get_trials()] == ["search"], "no calibration trial needed"

    # every completed search trial's draft is a version of the target's registered model, and the
    # best one holds the alias best-<study>, with the command that loads it printed
    versions = {v.run_id: v for v in client.search_model_versions("name='tiny-eagle3'")}
    completed = [t for t in trials if t.state.name == "COMPLETE"]
    assert {t.user_attrs["run_id"] for t in completed} <= set(versions)
    best = max(completed, key=lambda t: t.value)  # the objective is maximized (eval/simulated_acc_len)
    assert str(client.get_model_version_by_alias("tiny-eagle3", "best-it").version) == \
        str(versions[best.user_attrs["run_id"]].version)
    assert "mlflow artifacts download --artifact-uri 'models:/tiny-eagle3@best-it'" in " ".join(out.split())
