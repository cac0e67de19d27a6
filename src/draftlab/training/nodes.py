"""Multi-node training: one job, one launcher per node, one shared run folder.

Every node runs `draftlab train` with the same params but its own `train.node_rank`, on a run
folder all nodes see (a cluster's shared filesystem). Who does what is decided by that node
rank, never by torch's RANK (c10d's rendezvous orders ranks by participant, so torch's rank 0,
the one that logs metrics, may run on any node):

  node 0     the owner: sets a stale folder aside, opens (or resumes) the one MLflow run, writes
             run.json, plan.json, accounting.json and the vocab mappings, hosts the rendezvous,
             and at the end checks the accounting against every node's sample records
  node k>0   `join` here: the same checks, then only its own files: `.<run>.lock-node<k>` beside the folder,
             `launch-node<k>.json`, its ranks' pids under `node<k>/pids/`; no MLflow run

A kill -9 of any node's launcher takes its torchrun and ranks with it (procs: parent-death
signal); the other nodes' ranks lose their peer and fail, so the job stops everywhere, and a
rerun of every node resumes the last checkpoint in the same MLflow run. `stop_orphans` of a
node stops only that node's processes.
"""

from __future__ import annotations

import time
from pathlib import Path

from draftlab.errors import HostError
from draftlab.params import Params
from draftlab.rundir import RunDir

WRITER_WAIT_S = 120.0  # for torch's rank 0 on another node to finish (final checkpoint, records)
RENDEZVOUS_WAIT_S = 1800.0  # for node 0 to come up (a cluster's nodes start minutes apart)


class NodeBusy(HostError):
    """Another node's launcher is running in this run folder."""


def refuse_if_nodes_run(out_dir: Path, nnodes: int) -> None:
    """Node 0 sets a stale folder aside only while no other node's ranks run in it (a node still
    waiting for the rendezvous has written nothing but its lock). Checked for nodes on this host;
    another host's process group cannot be seen from here."""
    import socket

    from draftlab.procs import group_alive

    rd = RunDir(out_dir)
    here = socket.gethostname()
    busy = [k for k in range(1, nnodes) if (rec := rd.launch_file(k).peek()) is not None
            and rec.host in (None, here) and group_alive(rec.pgid)]
    if busy:
        raise NodeBusy(f"{out_dir}: node(s) {busy} have ranks running in this folder ({rd.launch_file(busy[0]).path}); "
                       "stop them, then start every node again")


def wait_for_writer(rd: RunDir, console, timeout_s: float = WRITER_WAIT_S) -> None:
    """After this node's torchrun ended well: torch's rank 0, wherever it ran, writes rank0-done.json
    last (after the final checkpoint); wait for it before checking what the ranks did."""
    deadline = time.monotonic() + timeout_s
    while not rd.rank_done.exists():
        if time.monotonic() > deadline:
            console.print(f"[yellow]train[/]: {rd.rank_done.path} did not appear in {timeout_s:.0f} s; checking anyway")
            return
        time.sleep(0.2)


def wait_for_rendezvous(endpoint: str, console, timeout_s: float = RENDEZVOUS_WAIT_S) -> None:
    """Until node 0's torchrun listens on the endpoint: a client that torchrun starts earlier gives
    up after 60 s, and node 0 may take longer to get there (its MLflow run, accounting, mappings)."""
    import socket

    host, _, port = endpoint.rpartition(":")
    deadline, said = time.monotonic() + timeout_s, False
    while True:
        try:
            socket.create_connection((host, int(port)), timeout=2).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise HostError(f"train.rdzv_endpoint: nothing listens on {endpoint} after {timeout_s:.0f} s; start "
                               "node 0 (its launcher hosts the rendezvous) or fix the address") from None
            if not said:
                console.print(f"[bold]train[/]: waiting for node 0's rendezvous at {endpoint}")
                said = True
            time.sleep(0.5)


def join(params: Params, *, target_dir: Path, data_dir: Path, store_dir: Path, out_dir: Path):
    """A node other than 0: run this node's ranks of the job node 0 owns."""
    import socket

    from draftlab import procs
    from draftlab.console import console
    from draftlab.params import ParamsError
    from draftlab.store import layout as store
    from draftlab.training import job as tr
    from draftlab.training import launch

    t = params.train
    node = t.node_rank
    layer_ids, source, device = tr.preflight(params, data_dir, store_dir, console, target_dir=target_dir,
                                             out_dir=out_dir)
    a, _ = tr.plan(params, data_dir)
    rd = RunDir(out_dir)
    with launch.exclusive(out_dir, node):  # before anything of this node's in the folder is touched
        out_dir.mkdir(parents=True, exist_ok=True)
        launch.stop_orphans(out_dir, console, node, locked=True)
        console.print(f"[bold]train[/]: node {node} of {t.nnodes}: {t.gpus} rank(s) joining the rendezvous at "
                      f"{t.rdzv_endpoint}; node 0 owns the MLflow run and checks the accounting "
                      f"(world size {a.world_size}, {a.total_steps} steps)")
        # node 0 writes the vocabulary maps before it launches; the run id reaches the writing rank by run.json
        cmd, env = tr.rank_command(params, target_dir=target_dir, data_dir=data_dir, source=source, out_dir=out_dir,
                                   layer_ids=layer_ids, total_steps=a.total_steps, device=device)
        wait_for_rendezvous(t.rdzv_endpoint, console)
        # node 0 wrote run.json before it opened the rendezvous: the same params and data, or no job
        state = rd.run.read_or_none()
        key = tr.run_key(params, source.identity(), data_dir)
        if state is None or state.key != key:
            raise ParamsError(f"{rd.run.path}: node 0 trains other params or data than this node's "
                              f"(run key {state.key[:12] if state else 'missing'} there, {key[:12]} here); give every "
                              "node the same params.yaml, store and dataset (only train.node_rank differs)")
        pids = rd.node_dir(node)
        procs.clear_recorded(pids)
        started = time.perf_counter()
        try:
            from draftlab.rundir import Launch

            rc = procs.run_group(cmd, env=env, on_start=lambda p: rd.launch_file(node).write(
                Launch(pgid=p.pid, host=socket.gethostname())))
        finally:
            procs.kill_recorded(pids)
        rd.launch_file(node).unlink()
        wall = time.perf_counter() - started
    state = rd.run.peek()
    run_id = state.run_id if state is not None else "unknown"
    if rc != 0:
        failure = rd.failure.peek()
        why = failure.message if failure is not None else f"torchrun exited with {rc}"
        raise tr.TrainingFailed(f"train: node {node}: {why}; node 0's launcher reports the job (MLflow run {run_id})")
    console.print(f"[bold]train[/]: node {node} done in {wall:.1f} s; node 0 checks the accounting and closes "
                  f"MLflow run {run_id}")
    return tr.TrainResult(run_id, out_dir, rd.checkpoints, a.total_steps, wall)
