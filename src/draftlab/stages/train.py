"""The `train` stage: speculators' EAGLE-3 trainer under torchrun, accounted and tracked.

Before step one it computes, with the trainer's own packing sampler, the exact global steps of
every epoch, the drops and each rank's sample set; prints them; logs them to one MLflow run
(started here, a new one beside the ranks' start; its id in every rank's MLFLOW_RUN_ID, rank 0's
records uploaded from its relay file by this process); and hands speculators the exact
total for its LR schedule. At the end it checks that the ranks did exactly that.

Nothing is lost: the run folder survives DVC (persist), a rerun resumes speculators' last
checkpoint in the same MLflow run, orphaned ranks of a killed launcher are stopped, and one
lock keeps two trainings out of one folder.

`run` is the outline; each step is its concern's: the checks and the plan (training.job), the
folder's lock and the ranks' launch (training.launch), the MLflow run (tracking), what is
recorded at each step (training.record), a joining node (training.nodes).

    draftlab train --params params.yaml --out runs/train
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

from draftlab.params import Params
from draftlab.registry import lineage
from draftlab.rundir import Command, RunDir
from draftlab.training import checkpoint as checkpoint_files
from draftlab.training import launch, record, startup
from draftlab.training.job import TrainResult, accounting_table, plan, preflight, rank_command, run_key, vocab_mappings


def _set_aside_if_stale(out_dir: Path, key: str, console) -> None:
    state = RunDir(out_dir).run.read_or_none()
    if state is not None and state.key != key:
        old = state.key[:12]
        aside = out_dir.parent / f".stale-{out_dir.name}-{old}"
        console.print(f"[yellow]train[/]: params or data changed; the previous run folder moves to {aside}")
        shutil.rmtree(aside, ignore_errors=True)
        out_dir.rename(aside)


def run(params: Params, *, target_dir: Path, data_dir: Path, store_dir: Path | None, out_dir: Path,
        run_tags: dict[str, str] | None = None, started_at: float | None = None) -> TrainResult:
    """`run_tags` go on the MLflow run when it is created (a sweep's parent id and trial number).
    `started_at`: when this training's process started (time.time()); default: now. Everything
    from then to the end counts as the cost model's start-up."""
    started_at = time.time() if started_at is None else started_at
    clock = startup.Clock(started_at)  # the time to the first step, by phase (train.json `startup`)
    if params.train.node_rank > 0:
        from draftlab.training.nodes import join

        return join(params, target_dir=target_dir, data_dir=data_dir, store_dir=store_dir, out_dir=out_dir)
    from draftlab import tracking
    from draftlab.console import console

    # preflight and plan: every check, then the exact accounting, before anything is written
    layer_ids, source, device = preflight(params, data_dir, store_dir, console, target_dir=target_dir, out_dir=out_dir)
    clock.mark("preflight")
    manifest_sha = source.identity()  # what the hidden states are (a store's manifest, or the online server's)
    key = run_key(params, manifest_sha, data_dir)
    a, step_tokens = plan(params, data_dir)
    clock.mark("plan")

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    rd = RunDir(out_dir)
    with launch.exclusive(out_dir):  # beside the folder: taken before anything in it is moved or written
        if out_dir.exists():
            launch.stop_orphans(out_dir, console, locked=True)
            state = RunDir(out_dir).run.read_or_none()
            if params.train.nnodes > 1 and state is not None and state.key != key:
                from draftlab.training.nodes import refuse_if_nodes_run

                refuse_if_nodes_run(out_dir, params.train.nnodes)  # before the folder is set aside
            _set_aside_if_stale(out_dir, key, console)
        out_dir.mkdir(exist_ok=True)
        checkpoint_files.set_aside_torn(rd.checkpoints, console)  # speculators resumes the newest complete one
        console.print(accounting_table(a, params))
        clock.mark("folder")

        def log_inputs(tracker) -> None:  # the data as MLflow datasets
            lineage.log_inputs(tracker, [lineage.prepared_dataset(data_dir, split="train", context="training",
                                                                  train_ratio=params.data.train_ratio),
                                         *lineage.source_datasets(source, context="training")])

        def open_tracking(late: bool = False) -> record.Tracking:
            return record.open_tracking(rd, key, params, a, source=source, device=device, manifest_sha=manifest_sha,
                                        run_tags=run_tags, log_inputs=log_inputs, console=console, clock=clock,
                                        late=late)

        # A new run's MLflow run is made once torchrun is started, beside the ranks' own start (its
        # import and store are about a second of CPU; the ranks wait for run.json only if they get
        # there first). A folder with a run (maybe a resume: the store says), or a job of several
        # nodes (the others read run.json once node 0's rendezvous is open), opens it first.
        early = None
        if rd.run.exists() or params.train.nnodes > 1:
            early = open_tracking()
        else:
            tracking.Relay.clear(rd.relay_path, rd.relay_sent_path)  # a new run's relay starts empty
        run_id, resumed = (early.run_id, early.resumed) if early else (None, False)
        # launch: the run folder the ranks read, then torchrun under its observers
        record.planned(rd, a, record.rank_plan(params, a, step_tokens, data_dir=data_dir, run_id=run_id,
                                               manifest_sha=manifest_sha, device=device, resumed=resumed,
                                               priors=early is not None))
        clock.mark("rank_plan")
        vocab_mappings(params, target_dir, data_dir, out_dir)
        clock.mark("vocab")
        with source.opened(console) as live:  # online: the vLLM server the ranks ask, stopped on every exit
            clock.mark("source")
            cmd, env = rank_command(params, target_dir=target_dir, data_dir=data_dir, source=live, out_dir=out_dir,
                                    layer_ids=layer_ids, total_steps=a.total_steps, device=device, run_id=run_id)
            rd.command.write(Command(cmd=cmd))
            opening = (lambda: early) if early else (lambda: open_tracking(late=True))
            ranks = launch.run_ranks(cmd, env, rd, source=live, open_tracking=opening, console=console, device=device,
                                     clock=clock)
        t: record.Tracking = ranks.tracking
        # check what the ranks did, then record it
        if ranks.rc != 0:
            raise record.failed(rd, ranks.rc, t.tracker, t.run_id, console)
        if params.train.nnodes > 1:
            from draftlab.training.nodes import wait_for_writer

            wait_for_writer(rd, console)  # torch's rank 0 may be on another node, still saving
            t.relay.pump()  # and still writing
        record.check_accounting(rd, a, t.tracker, console)
        return record.finished(rd, params, a, step_tokens, ranks, t.tracker, run_id=t.run_id, device=device,
                               resumed=t.resumed, started_at=started_at, console=console, clock=clock,
                               relay_cpu_s=t.relay.cpu_s)

