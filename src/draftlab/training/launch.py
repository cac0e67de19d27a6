"""How the train stage launches its ranks and keeps one training per run folder: the torchrun
command line, the folder's lock, and the clean-up of ranks a killed launcher left running.

torch's elastic launcher starts every worker with `start_new_session=True`: a signal to
torchrun's process group never reaches the ranks, and a SIGKILLed torchrun leaves them running
(they retry the dead TCPStore for 30 min); the ranks record their pids in the run folder and die
with their parent (draftlab.procs), and `stop_orphans` stops what is left."""

from __future__ import annotations

import os
import signal
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from draftlab import folder_lock, procs
from draftlab.params import Params
from draftlab.rundir import Launch, RunDir

TERM_GRACE_S = 10


def torchrun_cmd(params: Params, argv: list[str]) -> list[str]:
    t = params.train
    # draftlab.training.torchrun: torch.distributed.run, leaving without the interpreter's teardown
    cmd = [sys.executable, "-m", "draftlab.training.torchrun", "--nproc-per-node", str(t.gpus), "--nnodes", str(t.nnodes)]
    if t.rdzv_endpoint:
        # node 0 hosts the rendezvous store (its host is the endpoint's); the others connect to it.
        # c10d ignores --node-rank for torch's ranks: ownership is by train.node_rank, never RANK
        cmd += ["--node-rank", str(t.node_rank), "--rdzv-backend", "c10d", "--rdzv-endpoint", t.rdzv_endpoint,
                "--rdzv-conf", f"is_host={str(t.node_rank == 0).lower()}"]
    else:
        cmd.append("--standalone")
    return cmd + ["-m", "draftlab.training.rank", *argv]


@dataclass
class Ranks:
    """How node 0's torchrun ended: its exit code, its wall and the launcher's CPU seconds, and
    the telemetry sampler whose windows the bottleneck verdict reads, what the source said its
    loaders wait on (`HiddenStateSource.describe_wait`, for that verdict), and the run's tracking
    (what `open_tracking` returned)."""

    rc: int
    wall_s: float
    launcher_cpu_s: float
    sampler: object
    wait: object = None
    tracking: object = None


def run_ranks(cmd: list[str], env: dict[str, str], rd: RunDir, *, source, open_tracking, console, device: str,
              clock=None) -> Ranks:
    """Node 0's torchrun under its observers (MLflow's system metrics, draftlab's telemetry of the
    disk `source` reads from and the live verdict, told what the source's loaders wait on, and the
    relay of rank 0's records), recorded in the run folder (launch.json) while it runs; a rank that
    outlived it (it should not) is stopped after. `clock` (training.startup.Clock) notes torchrun's start.

    `open_tracking()` is called once torchrun is started, so that a new run's MLflow work (its
    import, store, run, params) runs beside the ranks' own start, and returns the run's tracking
    (stages/train.py: `.run_id`, `.tracker`, `.relay`); if it raises, the ranks are stopped and the
    error goes on."""
    from draftlab import threads, tracking
    from draftlab.observe import telemetry
    from draftlab.observe.live import LiveVerdict

    started = time.perf_counter()
    procs.clear_recorded(rd.path)
    rd.rank_done.unlink()
    if clock is not None:
        clock.spawned()
    proc = procs.spawn(cmd, env=env)
    rd.launch_file().write(Launch(pgid=proc.pid))
    try:
        opened = open_tracking()
    except BaseException:
        procs.stop_group(proc, TERM_GRACE_S)
        procs.kill_recorded(rd.path)
        rd.launch_file().unlink()
        raise
    # this process only, from here: the launcher's share of the harness while the ranks run (a new
    # run's MLflow work above is start-up, in its beside/ phases)
    launcher_cpu = time.process_time()
    opened.relay.start()
    try:
        with tracking.system_metrics(opened.run_id, interval_s=2):
            threads.yield_cpu_of("SystemMetricsMonitor")  # MLflow's sampler, started just now
            sampler = telemetry.TelemetrySampler(source.reads_from, opened.tracker).start()
            wait = source.describe_wait()
            live_verdict = LiveVerdict(sampler, rd.path, opened.tracker, console=console, device=device,
                                       wait=wait).start()  # observe.live
            if clock is not None:
                clock.mark("observers")
            try:
                rc = procs.wait_group(proc)
            finally:
                live_verdict.stop()
                sampler.stop()
                procs.kill_recorded(rd.path)  # a rank that outlived torchrun (it should not) goes now
    finally:
        opened.relay.stop()  # on every exit: what rank 0 wrote is in the run (or the spool)
    rd.launch_file().unlink()
    return Ranks(rc, time.perf_counter() - started, time.process_time() - launcher_cpu, sampler, wait, opened)


@contextmanager
def exclusive(out_dir: Path, node_rank: int = 0):
    """One training per run folder (per node): a second launcher is refused in one line naming
    the first one's pid and host, not interleaved. The lock lies beside the folder
    (draftlab.folder_lock): take it before anything in the folder is moved, written or deleted."""
    with folder_lock.hold(out_dir, "draftlab train", "" if node_rank == 0 else f"-node{node_rank}"):
        yield


def lock_held(out_dir: Path, node_rank: int = 0) -> bool:
    return folder_lock.held(out_dir, "" if node_rank == 0 else f"-node{node_rank}")


def stop_orphans(out_dir: Path, console, node_rank: int = 0, *, locked: bool = False) -> None:
    """Ranks of a launcher that was killed keep running (their own process group): stop them.
    A live launcher (it holds the folder's lock) is left alone: `exclusive` refuses the second.
    `locked`: the caller holds the lock (`exclusive`) itself, so no other launcher is alive.
    Per node: only this node's ranks (`node_rank`'s lock, launch file and pids), never another's."""
    if not locked and lock_held(out_dir, node_rank):
        return
    if ranks := procs.kill_recorded(RunDir(out_dir).node_dir(node_rank)):  # own sessions: by pid; this node's
        console.print(f"[yellow]train[/]: stopped orphaned ranks {ranks} of a killed run")
    launch_file = RunDir(out_dir).launch_file(node_rank)
    launch = launch_file.peek()  # torn by the kill: no group to stop
    if launch is None:
        launch_file.unlink()
        return
    pgid = launch.pgid
    if pgid and procs.group_alive(pgid):
        console.print(f"[yellow]train[/]: stopping orphaned ranks of a killed run (process group {pgid})")
        os.killpg(pgid, signal.SIGTERM)
        deadline = time.monotonic() + TERM_GRACE_S
        while procs.group_alive(pgid) and time.monotonic() < deadline:
            time.sleep(0.2)
        if procs.group_alive(pgid):
            os.killpg(pgid, signal.SIGKILL)
    launch_file.unlink()
