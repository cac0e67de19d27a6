"""Two `draftlab train` launchers on one machine as two nodes of one job (train.nnodes 2, c10d
rendezvous on 127.0.0.1, one gloo rank each) on one shared run folder: node 0 owns the one
MLflow run and the accounting; kill -9 of either launcher stops the job on both nodes, and
starting both again resumes it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

from tests.conftest import train_command
from tests.waiting import wait_for


def test_two_nodes_one_job_kill9_of_either_launcher_then_both_resume(built, tmp_path, store_uri, monkeypatch):
    from tests.postgres import free_port

    uri = store_uri  # this test's own migrated store
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    params = built[0]
    raw = params.model_dump()
    raw["train"].update({"epochs": 3, "total_seq_len": 96, "draft_vocab_size": 64, "lr": 3e-3, "num_workers": 0,
                         "gpus": 1, "nnodes": 2, "rdzv_endpoint": f"127.0.0.1:{free_port()}"})
    out = tmp_path / "shared" / "run"  # the folder both "hosts" see
    cmd = train_command(built, raw, tmp_path / "params.yaml", out)  # node_rank 0: the owner's params
    cmds, logs = [cmd, cmd + ["--node-rank", "1"]], []  # what a user types on each host

    started = []

    def start_both(order=(1, 0)):
        procs = {}
        for node in order:  # node 1 first: it waits for node 0's rendezvous
            log = open(tmp_path / f"node{node}-{len(logs)}.log", "w")
            logs.append(log)
            procs[node] = subprocess.Popen(cmds[node], stdout=log, stderr=subprocess.STDOUT)
            started.append(procs[node])
        return procs

    try:
        _scenario(start_both, out, tmp_path, uri)
    finally:
        for p in started:  # a failed check leaves no launcher behind (their ranks die with them)
            if p.poll() is None:
                p.kill()
                p.wait()


def _scenario(start_both, out: Path, tmp_path: Path, uri: str) -> None:
    import mlflow

    from tests.conftest import train_ranks_of

    def until_checkpoint(procs, name: str):
        deadline = time.monotonic() + 400
        while not (out / "checkpoints" / name / "training_state.json").exists():
            for node, p in procs.items():
                assert p.poll() is None, f"node {node} ended before checkpoint {name}: {_tail(tmp_path)}"
            assert time.monotonic() < deadline, "no checkpoint"
            time.sleep(0.1)
        ranks = [pid for pid in train_ranks_of(out)  # torchrun's own command line names train_rank too
                 if b"torchrun" not in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[2]]
        assert len(ranks) == 2, "one rank per node"

    def killed(procs, victim: int):
        os.kill(procs[victim].pid, signal.SIGKILL)
        procs[victim].wait()
        wait_for(lambda: not train_ranks_of(out), 120, "every rank of both nodes to stop")
        other = procs[1 - victim]
        assert other.wait(timeout=180) != 0, "the other node's launcher reports the failed job"

    # the first run: node 1's launcher is killed after epoch 1
    procs = start_both()
    until_checkpoint(procs, "0")
    assert (out / "launch.json").exists() and (out / "launch-node1.json").exists(), "one launch file per node"
    assert list((out / "pids").glob("rank*.json")) and list((out / "node1" / "pids").glob("rank*.json"))
    killed(procs, victim=1)
    run_id = json.loads((out / "run.json").read_text())["run_id"]

    # both again: they resume; now node 0's launcher is killed after epoch 2
    procs = start_both(order=(0, 1))
    until_checkpoint(procs, "1")
    killed(procs, victim=0)

    # both again: the job finishes
    procs = start_both()
    for node, p in procs.items():
        assert p.wait(timeout=600) == 0, f"node {node} failed: {_tail(tmp_path)}"

    client = mlflow.MlflowClient(uri)
    runs = client.search_runs([client.get_experiment_by_name("draftlab").experiment_id])
    assert len(runs) == 1, "one MLflow run for the job: only node 0 opens it"
    run = runs[0]
    assert run.info.run_id == run_id and run.info.status == "FINISHED"
    assert int(run.data.params["world_size"]) == 2 and int(run.data.tags["draftlab.resumed_from_step"]) > 0
    total = int(run.data.params["total_steps"])
    steps = sorted(m.step for m in client.get_metric_history(run_id, "train/loss"))
    assert steps == list(range(total)), "each global step logged once, whichever node torch's rank 0 ran on"
    record = json.loads((out / "train.json").read_text())
    assert record["world_size"] == 2 and record["accounting"] == "verified" and record["total_steps"] == total
    check = json.loads((out / "accounting-check.json").read_text())
    assert check == {"problems": [], "observed_steps": total}, "both nodes' sample records, disjoint and complete"
    assert sorted(p.name for p in (out / "samples").glob("rank*.jsonl")) == ["rank0.jsonl", "rank1.jsonl"]
    writer = json.loads((out / "rank0-done.json").read_text())["node_rank"]
    print(f"\ntorch's rank 0 ran on node {writer}")
    assert not (out / "launch.json").exists() and not (out / "launch-node1.json").exists()


def _tail(tmp_path: Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text()[-1500:]}" for p in sorted(tmp_path.glob("node*.log")))
