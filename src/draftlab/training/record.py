"""What node 0's launcher records of a training, in its MLflow run and its run folder: the run's
params and tags at the start (or a resume's), the failure of a run that stopped, the accounting
check against what the ranks did, and at the end the checkpoint, the bottleneck verdict, the
timing and `train.json`. The train stage (`stages/train.py`) calls these in order.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

from draftlab.params import Params, flatten
from draftlab.plan import accounting as acc
from draftlab.plan import run_timing
from draftlab.rundir import AccountingCheck, AccountingRecord, RankPlan, RunDir, TrainRecord
from draftlab.training import checkpoint as checkpoint_files
from draftlab.training.job import TrainingFailed, TrainResult, failed_error, last_global_step, observed_samples


def _versions() -> dict[str, str]:
    import importlib.metadata as md

    return {f"version.{p}": md.version(p) for p in ("torch", "speculators", "transformers", "mlflow", "draftlab")}


@dataclass
class Tracking:
    """The training's MLflow run as node 0's launcher holds it: its id, whether it was resumed,
    the tracker, and the relay of rank 0's records (tracking.Relay)."""

    run_id: str
    resumed: bool
    tracker: object
    relay: object


def open_tracking(rd: RunDir, key: str, params: Params, a: acc.Accounting, *, source, device: str,
                  manifest_sha: str, run_tags: dict | None, log_inputs, console, clock,
                  late: bool = False) -> Tracking:
    """Open (or resume) the run folder's MLflow run and log what the run starts with (its params,
    tags, and `log_inputs(tracker)`: the data as MLflow datasets, the stage's). `late`: torchrun
    is started (a new run): the ranks read plan.json, and rank 0 writes its relay file, as soon as
    run.json is there, so the ETA's priors from earlier runs go into plan.json first."""
    from draftlab import tracking

    if late:
        with_priors(rd, params, manifest_sha, device)
        clock.mark("rank_plan")
    run_id, reopened = tracking.open_run(rd.run, key, console, run_tags)  # run.json: the ranks go on
    tracker = tracking.MlflowTracker(run_id, spool=rd.spool_path)
    # rank 0's records reach the run through the launcher; a killed launch's that were not
    # uploaded go now, before the resume asks the run for its last step
    relay = tracking.Relay(rd.relay_path, rd.relay_sent_path, tracker)
    if reopened:
        relay.pump()
    elif not late:
        relay.restart()  # a new run in a folder whose run is gone: its relay starts empty
    clock.mark("mlflow_run")
    if reopened:
        resumed(tracker, rd, run_id, console)
    else:
        started(tracker, params, a, source=source, device=device, manifest_sha=manifest_sha)
    log_inputs(tracker)  # again on a resume: adds nothing
    clock.mark("run_params")
    return Tracking(run_id, reopened, tracker, relay)


def started(tracker, params: Params, a: acc.Accounting, *, source, device: str, manifest_sha: str) -> None:
    """A new run: every param, the accounting (per epoch as a metric, comparable across runs), the tags."""
    from draftlab import devices
    from draftlab.tracking import git_tags

    tracker.log_params({**flatten(params), **a.mlflow_params(), "train.resolved_lr": params.train.resolved_lr(),
                        "device": device, **source.mlflow_params()})
    for e in a.epochs:
        tracker.log_metrics({"accounting/steps_per_epoch": e.steps}, step=e.epoch)
    tracker.set_tags({**git_tags(), **_versions(), **devices.device_tags(device),
                      "data.hidden_states_hash": manifest_sha, "draftlab.stage": "train",
                      "draftlab.calibration": str(params.train.max_steps is not None).lower()})


def resumed(tracker, rd: RunDir, run_id: str, console) -> None:
    """A run folder resumed in its MLflow run: from which step, and the step metrics it lacks."""
    step = last_global_step(rd.checkpoints)
    tracker.set_tags({"draftlab.resumed_from_step": step if step is not None else 0})
    console.print(f"[bold]train[/]: resuming MLflow run {run_id} from global step {step}")
    _restore_step_metrics(rd, run_id, console)


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


def rank_plan(params: Params, a: acc.Accounting, step_tokens: list[int], *, data_dir: Path, run_id: str | None,
              manifest_sha: str, device: str, resumed: bool = True, priors: bool = True) -> RankPlan:
    """What the ranks read of the launcher (plan.json): the steps and tokens, the ETA's priors, settings.
    `resumed`: False for a run just created, which has logged no step (its store is not asked).
    `priors`: False leaves the ETA's priors from earlier runs out (`with_priors` adds them later:
    they are MLflow's to say, and a new run asks MLflow once torchrun is started)."""
    from draftlab import tracking

    t = params.train
    return RankPlan(
        total_steps=a.total_steps, step_tokens=step_tokens,
        last_logged_step=tracking.last_step(run_id, "train/loss") if resumed else -1,
        # for the ETA: where epochs end (validation + checkpoint follow), and their cost
        epoch_steps=a.trained_steps if a.max_steps is not None else [e.steps for e in a.epochs],
        val_steps=run_timing.val_steps(params, data_dir),
        **(run_timing.priors(params, manifest_sha, device) if priors else {}),
        optimizer={"adamw": "AdamW", "muon": "Muon"}[t.optimizer],
        verify_reads=t.verify_reads, warmup_steps=t.warmup_steps, watch=t.watch.model_dump())


def with_priors(rd: RunDir, params: Params, manifest_sha: str, device: str) -> None:
    """plan.json with the ETA's priors from earlier matching runs (rank_plan's `priors`), written
    before run.json, which the ranks wait for before they read it."""
    rd.plan.write(rd.plan.read().model_copy(update=run_timing.priors(params, manifest_sha, device)))


def planned(rd: RunDir, a: acc.Accounting, plan: RankPlan) -> None:
    """The run folder before launch: the accounting and the ranks' plan; a previous launch's
    failure, progress and live verdict gone."""
    rd.accounting.write(AccountingRecord(**a.to_json()))
    rd.plan.write(plan)
    rd.failure.unlink()
    rd.progress.unlink()
    rd.live_verdict_path.unlink(missing_ok=True)


def say_spool(rd: RunDir, console) -> None:
    """One line, after the run's last write, if any of its records (the ranks' or the launcher's,
    its end included) wait in the spool."""
    spool = rd.spool_path
    if spool.exists():
        n = len(spool.read_text().splitlines())
        console.print(f"[yellow]tracking[/]: {n} record(s) of an MLflow outage are in {spool}; upload them with "
                      f"`draftlab tracking-import {spool}`", soft_wrap=True)


def failed(rd: RunDir, rc: int, tracker, run_id: str, console) -> TrainingFailed:
    """The run FAILED in MLflow, and the error that says why (the ranks' failure record, else torchrun's code)."""
    failure = rd.failure.peek()
    why = failure.message if failure is not None else f"torchrun exited with {rc}"
    if failure is not None and failure.reason in ("diverged", "stalled", "diverging"):
        tracker.set_tags({"draftlab.convergence": failure.reason})  # rank 0 may have been stopped first
    tracker.end("FAILED")
    say_spool(rd, console)
    logs = rd.logs  # speculators creates it late: name it only if it is there
    see = f"see {logs} and MLflow run {run_id}" if logs.is_dir() else f"see the output above and MLflow run {run_id}"
    return failed_error(failure)(f"train: {why}; {see}")


def check_accounting(rd: RunDir, a: acc.Accounting, tracker, console) -> None:
    """What the ranks did (steps, per-rank sample sets) against the accounting; raises on a mismatch."""
    observed_steps = last_global_step(rd.checkpoints)
    problems = acc.check_observed(a, observed_samples(rd.path), observed_steps or 0,
                                  checkpoint_files.epoch_end_steps(rd.checkpoints))
    rd.accounting_check.write(AccountingCheck(problems=problems, observed_steps=observed_steps))
    tracker.log_artifact(rd.accounting.path)
    tracker.log_artifact(rd.accounting_check.path)
    if problems:
        tracker.end("FAILED")
        say_spool(rd, console)
        raise TrainingFailed("train: accounting mismatch: " + "; ".join(problems))


def _tracking_stall(rd: RunDir, tracker) -> dict | None:
    """The writing rank's tracking waits and outages (rank0-done.json)."""
    done = rd.rank_done.peek()
    if done is None or done.tracking is None:
        return None
    return {**done.tracking, "launcher_outages": tracker.outages}


def _startup(rd: RunDir, clock, tracker, console) -> dict | None:
    """The time to the first step by phase (training.startup), printed and logged as startup/*."""
    from draftlab.observe import telemetry
    from draftlab.training import startup

    done = rd.rank_done.peek()
    phases = None if clock is None else startup.breakdown(
        clock, done.startup if done is not None else None,
        startup.first_step_record(telemetry.read_step_records(rd.path), after=clock.spawned_at))
    if phases is not None:
        tracker.log_metrics({f"startup/{k}": v for k, v in phases.items()})
        console.print(f"[bold]train[/]: start-up {startup.line(phases)}", soft_wrap=True)
    return phases


def finished(rd: RunDir, params: Params, a: acc.Accounting, step_tokens: list[int], ranks, tracker, *,
             run_id: str, device: str, resumed: bool, started_at: float, console, clock=None,
             relay_cpu_s: float = 0.0) -> TrainResult:
    """The checkpoint, the bottleneck verdict, the timing and train.json; the MLflow run FINISHED."""
    from draftlab.observe import bottleneck

    checkpoint = checkpoint_files.newest_complete(rd.checkpoints)
    if checkpoint is None:
        tracker.end("FAILED")
        raise TrainingFailed(f"train: no complete checkpoint in {rd.checkpoints}; rerun `draftlab train`")
    tracker.set_tags({"draftlab.checkpoint": str(checkpoint), "draftlab.accounting": "verified"})
    for f in ("config.json", "model.safetensors"):
        tracker.log_artifact(checkpoint / f, "checkpoint")
    fpt = (bottleneck.draft_flops_per_token(json.loads((checkpoint / "config.json").read_text()),
                                           ttt_steps=params.train.ttt_steps) if device == "cuda" else None)
    verdict = bottleneck.conclude(ranks.sampler, rd.path, tracker, flops_per_token=fpt, device=device,
                                  wait=ranks.wait)
    console.print(f"[bold]bottleneck[/]: {verdict.overall.line()}")
    tokens_per_s = sum(step_tokens) / ranks.wall_s
    harness = run_timing.harness_cpu(rd.path, ranks.launcher_cpu_s, a.total_steps, relay_s=relay_cpu_s)
    tracker.log_metrics({"perf/harness_cpu_s_per_step": harness["per_step_s"]})
    phases = _startup(rd, clock, tracker, console)
    ended = time.time()
    timing = None if resumed else run_timing.log_timing(a, step_tokens, rd.path, started_at, ended, tracker)
    # wall_clock_s is one span wherever it is named (plan, train.json, MLflow, timing.wall_s):
    # this process's start to the run's end; torchrun's (the ranks' alone) is torchrun_wall_s
    span = ended - started_at
    tracker.log_metrics({"perf/run_tokens_per_s": tokens_per_s, "perf/run_wall_clock_s": span,
                         "perf/torchrun_wall_s": ranks.wall_s})
    rd.train.write(TrainRecord(
        run_id=run_id, checkpoint=str(checkpoint), total_steps=a.total_steps, world_size=a.world_size,
        wall_clock_s=round(span, 2), torchrun_wall_s=round(ranks.wall_s, 2), tokens_per_s=round(tokens_per_s, 1),
        accounting="verified",
        bottleneck=verdict.overall.label, calibration=params.train.max_steps is not None, timing=timing,
        harness_cpu=harness, tracking=_tracking_stall(rd, tracker), startup=phases))
    tracker.end("FINISHED")
    say_spool(rd, console)
    console.print(f"[bold]train[/]: {a.total_steps} steps verified (disjoint, complete ranks) in {span:.1f} s "
                  f"(torchrun {ranks.wall_s:.1f} s); checkpoint {checkpoint}; MLflow run {run_id}")
    return TrainResult(run_id, rd.path, checkpoint, a.total_steps, span)
