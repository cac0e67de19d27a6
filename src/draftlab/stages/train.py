"""The `train` stage: speculators' EAGLE-3 trainer under torchrun, accounted and tracked.

Before step one it computes, with the trainer's own packing sampler, the exact global steps of
every epoch, the drops and each rank's sample set; prints them; logs them to one MLflow run
(started here, its id handed to the ranks as MLFLOW_RUN_ID); and hands speculators the exact
total for its LR schedule. At the end it checks that the ranks did exactly that.

Nothing is lost: the run folder survives DVC (persist), a rerun resumes speculators' last
checkpoint in the same MLflow run, orphaned ranks of a killed launcher are stopped, and one
lock keeps two trainings out of one folder.

    draftlab train --params params.yaml --out runs/train
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

from draftlab.params import Params, flatten
from draftlab.plan import accounting as acc
from draftlab.plan import run_timing
from draftlab.rundir import AccountingCheck, AccountingRecord, Command, Launch, RankPlan, RunDir, RunState, TrainRecord
from draftlab.store import layout as store
from draftlab.training import checkpoint as checkpoint_files
from draftlab.training import launch
from draftlab.training.job import (
    TrainingFailed,
    TrainResult,
    accounting_table,
    failed_error,
    last_global_step,
    observed_samples,
    plan,
    preflight,
    run_key,
    speculators_argv,
    vocab_mappings,
)


def _versions() -> dict[str, str]:
    import importlib.metadata as md

    return {f"version.{p}": md.version(p) for p in ("torch", "speculators", "transformers", "mlflow", "draftlab")}


def _restore_step_metrics(rd: RunDir, run_id: str, console) -> None:
    """A resumed folder's metrics.jsonl (evaluate's input) gets the steps its MLflow run has and
    it lacks: a folder trained before the file existed trains nothing more and would never
    write them."""
    from draftlab import tracking
    from draftlab.training import metrics as train_metrics

    try:
        added = train_metrics.backfill(rd.path, tracking.client(), run_id)
    except Exception as err:  # noqa: BLE001 — the store may be down: training goes on without it
        console.print(f"[yellow]train[/]: {rd.step_metrics_path} not checked against MLflow run {run_id} "
                      f"({type(err).__name__}); rerun `draftlab train` once the store is reachable")
        return
    if added:
        console.print(f"[bold]train[/]: {added} steps of train/* metrics restored into {rd.step_metrics_path} "
                      f"from MLflow run {run_id}")


def _open_run(out_dir: Path, key: str, console, tags: dict[str, str] | None = None) -> tuple[str, bool]:
    """The MLflow run for this folder: the same one again after a kill, else a new one."""
    from draftlab import tracking

    client = tracking.client()
    state = RunDir(out_dir).run
    prev = state.read_or_none()
    if prev is not None and prev.key == key:
        try:
            client.get_run(prev.run_id)
            return prev.run_id, True
        except Exception:  # noqa: BLE001 — deleted or unreachable: start a new run
            console.print(f"[yellow]train[/]: MLflow run {prev.run_id} not found; starting a new one")
    tags = dict(tags or {})
    name = tags.pop("mlflow.runName", None) or tracking.run_name("train")
    run = client.create_run(tracking.experiment_id(client), tags=tags, run_name=name)
    state.write(RunState(key=key, run_id=run.info.run_id))
    return run.info.run_id, False


def _last_logged_step(run_id: str) -> int:
    from draftlab import tracking

    try:
        history = tracking.client().get_metric_history(run_id, "train/loss")
    except Exception:  # noqa: BLE001
        return -1
    return max((m.step for m in history), default=-1)


def _tracking_stall(rd: RunDir, tracker) -> dict | None:
    """The writing rank's tracking waits and outages (rank0-done.json)."""
    done = rd.rank_done.peek()
    if done is None or done.tracking is None:
        return None
    return {**done.tracking, "launcher_outages": tracker.outages}


def _say_spool(rd: RunDir, console) -> None:
    """One line, after the run's last write, if any of its records (the ranks' or the launcher's,
    its end included) wait in the spool."""
    spool = rd.spool_path
    if spool.exists():
        n = len(spool.read_text().splitlines())
        console.print(f"[yellow]tracking[/]: {n} record(s) of an MLflow outage are in {spool}; upload them with "
                      f"`draftlab tracking-import {spool}`", soft_wrap=True)


def _set_aside_if_stale(out_dir: Path, key: str, console) -> None:
    state = RunDir(out_dir).run.read_or_none()
    if state is not None and state.key != key:
        old = state.key[:12]
        aside = out_dir.parent / f".stale-{out_dir.name}-{old}"
        console.print(f"[yellow]train[/]: params or data changed; the previous run folder moves to {aside}")
        shutil.rmtree(aside, ignore_errors=True)
        out_dir.rename(aside)


def run(params: Params, *, target_dir: Path, data_dir: Path, store_dir: Path, out_dir: Path,
        run_tags: dict[str, str] | None = None, started_at: float | None = None) -> TrainResult:
    """`run_tags` go on the MLflow run when it is created (a sweep's parent id and trial number).
    `started_at`: when this training's process started (time.time()); default: now. Everything
    from then to the end counts as the cost model's start-up."""
    started_at = time.time() if started_at is None else started_at
    if params.train.node_rank > 0:
        from draftlab.training.nodes import join

        return join(params, target_dir=target_dir, data_dir=data_dir, store_dir=store_dir, out_dir=out_dir)
    import mlflow

    from draftlab import devices, procs, tracking
    from draftlab.console import console
    from draftlab.models import resolve
    from draftlab.tracking import MlflowTracker, git_tags

    layer_ids, source, device = preflight(params, data_dir, store_dir, console)
    manifest_sha = store.manifest_hash(store_dir)
    key = run_key(params, manifest_sha, data_dir)
    a, step_tokens = plan(params, data_dir)

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
        run_id, resumed = _open_run(out_dir, key, console, run_tags)
        tracker = MlflowTracker(run_id, spool=rd.spool_path)
        resumed_step = last_global_step(rd.checkpoints) if resumed else None
        if not resumed:
            tracker.log_params({**{k: v for k, v in flatten(params).items()}, **a.mlflow_params(),
                                "train.resolved_lr": params.train.resolved_lr(), "device": device,
                                **source.mlflow_params()})
            for e in a.epochs:  # per epoch, comparable across runs in the MLflow UI
                tracker.log_metrics({"accounting/steps_per_epoch": e.steps}, step=e.epoch)
            tracker.set_tags({**git_tags(), **_versions(), **devices.device_tags(device),
                              "data.hidden_states_hash": manifest_sha, "draftlab.stage": "train",
                              "draftlab.calibration": str(params.train.max_steps is not None).lower()})
        else:
            tracker.set_tags({"draftlab.resumed_from_step": resumed_step if resumed_step is not None else 0})
            console.print(f"[bold]train[/]: resuming MLflow run {run_id} from global step {resumed_step}")
            _restore_step_metrics(rd, run_id, console)
        from draftlab.registry import lineage  # the data as MLflow datasets (again on a resume: adds nothing)

        lineage.log_inputs(tracker, [lineage.prepared_dataset(data_dir, split="train", context="training",
                                                              train_ratio=params.data.train_ratio),
                                     lineage.store_dataset(store_dir, context="training")])
        rd.accounting.write(AccountingRecord(**a.to_json()))
        rd.plan.write(RankPlan(
            total_steps=a.total_steps, step_tokens=step_tokens, last_logged_step=_last_logged_step(run_id),
            # for the ETA: where epochs end (validation + checkpoint follow), and their cost
            epoch_steps=a.trained_steps if a.max_steps is not None else [e.steps for e in a.epochs],
            val_steps=run_timing.val_steps(params, data_dir), **run_timing.priors(params, manifest_sha, device),
            optimizer={"adamw": "AdamW", "muon": "Muon"}[params.train.optimizer],
            verify_reads=params.train.verify_reads, warmup_steps=params.train.warmup_steps,
            watch=params.train.watch.model_dump()))
        d2t, t2d = vocab_mappings(params, target_dir, data_dir, out_dir)
        argv = speculators_argv(params, verifier=resolve(params, target_dir), data_dir=data_dir,
                                source=source, out_dir=out_dir, layer_ids=layer_ids,
                                total_steps=a.total_steps, d2t=d2t, t2d=t2d, device=device)
        cmd = launch.torchrun_cmd(params, argv)
        rd.command.write(Command(cmd=cmd))
        rd.failure.unlink()
        rd.progress.unlink()
        rd.live_verdict_path.unlink(missing_ok=True)
        from draftlab import threads

        # the ranks on this node split this process's threads (torchrun would give each 1, or
        # torch each one per core of the machine)
        # everything else a rank needs is in the run folder's plan.json (rundir.RankPlan)
        env = dict(threads.thread_env(params.train.gpus), MLFLOW_RUN_ID=run_id, DRAFTLAB_RUN_DIR=str(out_dir),
                   DRAFTLAB_NODE_RANK="0",
                   DRAFTLAB_PARENT_CMD="draftlab.training.torchrun", MLFLOW_TRACKING_URI=tracking.tracking_uri(),
                   **tracking.RANK_HTTP_ENV)
        started = time.perf_counter()
        launcher_cpu = time.process_time()  # this process only: the launcher's share of the harness
        mlflow.set_system_metrics_sampling_interval(2)
        from draftlab.observe import bottleneck, telemetry
        from draftlab.observe.live import LiveVerdict

        with tracking.system_metrics(run_id):
            threads.yield_cpu_of("SystemMetricsMonitor")  # MLflow's sampler, started just now
            sampler = telemetry.TelemetrySampler(store_dir, tracker).start()
            live_verdict = LiveVerdict(sampler, out_dir, tracker, console=console, device=device).start()  # observe.live
            try:
                procs.clear_recorded(out_dir)
                rd.rank_done.unlink()
                rc = procs.run_group(cmd, env=env, on_start=lambda p: rd.launch_file().write(Launch(pgid=p.pid)))
            finally:
                live_verdict.stop()
                sampler.stop()
                procs.kill_recorded(out_dir)  # a rank that outlived torchrun (it should not) goes now
        rd.launch_file().unlink()
        wall = time.perf_counter() - started
        launcher_cpu = time.process_time() - launcher_cpu
        if rc != 0:
            failure = rd.failure.peek()
            why = failure.message if failure is not None else f"torchrun exited with {rc}"
            if failure is not None and failure.reason in ("diverged", "stalled", "diverging"):
                tracker.set_tags({"draftlab.convergence": failure.reason})  # rank 0 may have been stopped first
            tracker.end("FAILED")
            _say_spool(rd, console)
            logs = rd.logs  # speculators creates it late: name it only if it is there
            see = f"see {logs} and MLflow run {run_id}" if logs.is_dir() else f"see the output above and MLflow run {run_id}"
            raise failed_error(failure)(f"train: {why}; {see}")

        if params.train.nnodes > 1:
            from draftlab.training.nodes import wait_for_writer

            wait_for_writer(rd, console)  # torch's rank 0 may be on another node, still saving
        observed_steps = last_global_step(rd.checkpoints)
        problems = acc.check_observed(a, observed_samples(out_dir), observed_steps or 0,
                                      checkpoint_files.epoch_end_steps(rd.checkpoints))
        rd.accounting_check.write(AccountingCheck(problems=problems, observed_steps=observed_steps))
        tracker.log_artifact(rd.accounting.path)
        tracker.log_artifact(rd.accounting_check.path)
        if problems:
            tracker.end("FAILED")
            _say_spool(rd, console)
            raise TrainingFailed("train: accounting mismatch: " + "; ".join(problems))
        checkpoint = checkpoint_files.newest_complete(rd.checkpoints)
        if checkpoint is None:
            tracker.end("FAILED")
            raise TrainingFailed(f"train: no complete checkpoint in {rd.checkpoints}; rerun `draftlab train`")
        tracker.set_tags({"draftlab.checkpoint": str(checkpoint), "draftlab.accounting": "verified"})
        for f in ("config.json", "model.safetensors"):
            tracker.log_artifact(checkpoint / f, "checkpoint")
        fpt = (bottleneck.draft_flops_per_token(json.loads((checkpoint / "config.json").read_text()),
                                               ttt_steps=params.train.ttt_steps) if device == "cuda" else None)
        verdict = bottleneck.conclude(sampler, out_dir, tracker, flops_per_token=fpt, device=device)
        console.print(f"[bold]bottleneck[/]: {verdict.overall.line()}")
        tokens_per_s = sum(step_tokens) / wall
        harness = run_timing.harness_cpu(out_dir, launcher_cpu, a.total_steps)
        tracker.log_metrics({"perf/harness_cpu_s_per_step": harness["per_step_s"]})
        ended = time.time()
        timing = None if resumed else run_timing.log_timing(a, step_tokens, out_dir, started_at, ended, tracker)
        # wall_clock_s is one span wherever it is named (plan, train.json, MLflow, timing.wall_s):
        # this process's start to the run's end; torchrun's (the ranks' alone) is torchrun_wall_s
        span = ended - started_at
        tracker.log_metrics({"perf/run_tokens_per_s": tokens_per_s, "perf/run_wall_clock_s": span,
                             "perf/torchrun_wall_s": wall})
        rd.train.write(TrainRecord(
            run_id=run_id, checkpoint=str(checkpoint), total_steps=a.total_steps, world_size=a.world_size,
            wall_clock_s=round(span, 2), torchrun_wall_s=round(wall, 2), tokens_per_s=round(tokens_per_s, 1),
            accounting="verified",
            bottleneck=verdict.overall.label, calibration=params.train.max_steps is not None, timing=timing,
            harness_cpu=harness, tracking=_tracking_stall(rd, tracker)))
        tracker.end("FINISHED")
        _say_spool(rd, console)
    console.print(f"[bold]train[/]: {a.total_steps} steps verified (disjoint, complete ranks) in {span:.1f} s "
                  f"(torchrun {wall:.1f} s); checkpoint {checkpoint}; MLflow run {run_id}")
    return TrainResult(run_id, out_dir, checkpoint, a.total_steps, span)
