"""The study around a sweep worker: Optuna storage, the parent MLflow run, the live progress
line, and `draftlab sweep` itself (its report: draftlab.sweep.report).

    draftlab sweep experiments/sweep-tiny.yaml --budget 8m
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict
from pathlib import Path

from draftlab import redact
from draftlab.params import Params
from draftlab.plan.costmodel import Point
from draftlab.sweep import calibration
from draftlab.sweep.budget import SystemClock, steps_from_lengths
from draftlab.sweep.loop import PARENT_RUN_ATTR, Worker, drive
from draftlab.sweep.propose import sampler
from draftlab.sweep.report import report
from draftlab.sweep.space import SpaceError, SweepSpec, check_spec
from draftlab.sweep.storage import StudyStorage


def storage_url(spec: SweepSpec, out_dir: Path) -> str:
    return spec.storage or str(out_dir / "journal.log")


def open_storage(url: str, spec: SweepSpec | None = None) -> StudyStorage:
    """A journal file (default, many processes on one host) or an RDB URL (PostgreSQL: many hosts)."""
    if spec is None:
        return StudyStorage(url)
    return StudyStorage(url, heartbeat_s=spec.heartbeat_s, stale_after_s=spec.stale_after_s)


def open_study(spec: SweepSpec, storage: StudyStorage, base: Params):
    import warnings

    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    p = spec.pruner
    lo, hi = spec.epochs_range(base)
    pruner = {"median": lambda: optuna.pruners.MedianPruner(n_startup_trials=p.startup_trials,
                                                            n_warmup_steps=p.warmup_epochs),
              "hyperband": lambda: optuna.pruners.HyperbandPruner(min_resource=1, max_resource=max(hi, 1)),
              "none": lambda: optuna.pruners.NopPruner()}[p.kind]()
    # search values come from draftlab.sweep.propose; this sampler only serves popped (enqueued) trials
    study = optuna.create_study(study_name=spec.study, storage=storage.optuna, direction=spec.objective.direction,
                                sampler=sampler(spec), pruner=pruner, load_if_exists=True)
    if study.direction.name.lower() != spec.objective.direction:
        raise SpaceError(f"objective: study {spec.study!r} already {study.direction.name.lower()}s; use another "
                         "study name for a different objective")
    if study.metric_names != [spec.objective.metric]:
        with warnings.catch_warnings():  # "experimental" since Optuna 3.2
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            study.set_metric_names([spec.objective.metric])
    return study


def resolve_devices(spec: SweepSpec, base: Params, flag: str | None) -> tuple[list[str], bool]:
    """(device slot ids, are they GPUs). A count or ids from --devices / devices:, else every
    visible GPU, else one slot per CPU core."""
    gpu = base.train.device == "cuda"
    if base.train.device == "auto":
        import torch

        gpu = torch.cuda.is_available()
    given = flag if flag is not None else spec.devices
    if given is None:
        if gpu:
            import torch

            return [str(i) for i in range(torch.cuda.device_count())], True
        return [f"cpu{i}" for i in range(os.cpu_count() or 1)], False
    if isinstance(given, str):
        given = int(given) if given.strip().isdigit() else [d.strip() for d in given.split(",") if d.strip()]
    if isinstance(given, int):
        if given < 1:
            raise SpaceError("devices: must be at least 1")
        return ([str(i) for i in range(given)] if gpu else [f"cpu{i}" for i in range(given)]), gpu
    return [str(d) for d in given], gpu


def parent_run(study, spec: SweepSpec, storage_text: str) -> str:
    """The sweep's MLflow run: created by the first worker, found again by the others and reruns."""
    from draftlab import tracking

    client = tracking.client()
    run_id = study.user_attrs.get(PARENT_RUN_ATTR)
    if run_id:
        try:
            if client.get_run(run_id).info.status != "RUNNING":
                client.update_run(run_id, status="RUNNING")
            return run_id
        except Exception:  # noqa: BLE001 — deleted: make a new one
            pass
    run = client.create_run(tracking.experiment_id(client), run_name=f"sweep-{spec.study}",
                            tags={**tracking.git_tags(), "draftlab.stage": "sweep", "optuna.study": spec.study,
                                  "optuna.storage": redact.url(storage_text)})
    from draftlab.tracking import MlflowTracker

    MlflowTracker(run.info.run_id).log_params(
        {"sweep.objective": f"{spec.objective.direction} {spec.objective.metric}", "sweep.params": spec.params,
         "sweep.space": json.dumps({k: v.model_dump(exclude_none=True) for k, v in spec.space.items()}),
         "sweep.safety_margin": spec.safety_margin, "sweep.stop_grace_s": spec.stop_grace_s,
         "sweep.pruner": spec.pruner.kind})
    study.set_user_attr(PARENT_RUN_ATTR, run.info.run_id)
    return study.user_attrs[PARENT_RUN_ATTR]


def run(spec: SweepSpec, base: Params, *, target_dir: Path, data_dir: Path, store_dir: Path, out_dir: Path,
        devices_flag: str | None = None, n_trials: int | None = None, clock=None, launcher=None) -> dict:
    """`draftlab sweep`: check, open the study and its parent run, run this worker, report."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from draftlab import tracking
    from draftlab.console import console
    from draftlab.sweep.trial import ProcessLauncher
    from draftlab.training.job import train_split

    devices, gpu = resolve_devices(spec, base, devices_flag)
    out_dir = out_dir / spec.study
    url = storage_url(spec, out_dir)
    from draftlab.store import layout as store

    needed = [(data_dir, "prepared dataset")]
    if base.train.source == "store":  # online (train.vllm_url): the trials share the user's server, no store
        needed.append((store.manifest_path(store_dir), "hidden-state store"))
    for path, what in needed:
        if not path.exists():
            raise SpaceError(f"{path}: no {what}; run `dvc repro extract` first (every trial trains on it)")
    check_spec(spec, base, num_devices=len(devices), calibrated=set(spec.gpu_counts(base)))  # all but the budget
    if base.train.source == "vllm":  # the one server every trial asks answers and serves the target, or one line
        from draftlab.plan.inputs import target_config
        from draftlab.store.hidden_states import planned_source

        config, _ = target_config(base, target_dir)
        if (source := planned_source(base, store_dir=store_dir, target_dir=target_dir, config=config)) is not None:
            source.check()
    reused: dict[int, Point] = {}
    if spec.calibration.reuse:
        from draftlab.devices import device_tags
        from draftlab.plan.costmodel import points_from_mlflow
        from draftlab.plan.inputs import source_identity

        found = points_from_mlflow(base, spec.gpu_counts(base), source=base.train.source,
                                   store_hash=source_identity(base, store_dir, target_dir),
                                   device_model=device_tags("cuda" if gpu else "cpu")["device.model"],
                                   client=tracking.client())
        reused = {n: p for n, p in found.items() if p.after_s is not None}  # a trial's: evaluate timed too
    if "://" not in url and not Path(url).exists():  # a new study: every check before anything is written
        check_spec(spec, base, num_devices=len(devices), calibrated=set(reused))
    storage = open_storage(url, spec)
    study = open_study(spec, storage, base)
    with storage.lock(spec.study):
        calibrated = set(calibration.points(study))
        for n, point in reused.items():
            if n not in calibrated:
                calibration.save(study, point)
                console.print(f"[bold]sweep[/]: calibration at {n} GPU(s) from {point.source}: start-up "
                              f"{point.fixed_s:,.1f} s + {point.step_s:.3f} s/step + {point.epoch_s:.1f} s/epoch")
    calibrated |= set(reused)
    check_spec(spec, base, num_devices=len(devices), calibrated=calibrated)
    lengths, _ = train_split(data_dir, base.data.train_ratio)
    study.set_user_attr("draftlab.budget_s", spec.budget_s)
    study.set_user_attr("draftlab.space", {**json.loads(spec.model_dump_json()), "storage": redact.url(spec.storage)})
    with storage.lock(spec.study):  # workers starting together: one parent run
        parent = parent_run(study, spec, url)
    shown = redact.url(url)  # the dashboard command names the password the user's own way, not ours
    console.print(f"[bold]sweep[/]: study [cyan]{spec.study}[/] in {shown}  (optuna-dashboard {shown})")
    console.print(f"[bold]sweep[/]: budget {spec.budget_s:,.0f} s, trial cap "
                  f"{'—' if spec.trial_cap_s is None else f'{spec.trial_cap_s:,.0f} s'}, devices {devices}, "
                  f"objective {spec.objective.direction} {spec.objective.metric}; MLflow parent run {parent}")
    launcher = launcher or ProcessLauncher(study=spec.study, metric=spec.objective.metric, target_dir=target_dir,
                                           data_dir=data_dir, store_dir=store_dir, parent_run_id=parent,
                                           gpu_slots=gpu, total_slots=len(devices))
    worker = Worker(spec, base, study, launcher=launcher, clock=clock or SystemClock(), devices=devices,
                    out_dir=out_dir, steps_fn=steps_from_lengths(lengths), n_trials=n_trials, storage=storage,
                    log=lambda line: console.print(f"[bold]sweep[/]: {line}", soft_wrap=True))
    status = "FAILED"
    started = time.time()
    with Progress(TextColumn("[bold]budget[/]"), BarColumn(), TextColumn("{task.fields[text]}"),
                  TimeElapsedColumn(), console=console, transient=True) as bar:
        task = bar.add_task("budget", total=worker.budget_s, text="")

        def tick(w: Worker) -> None:
            bar.update(task, completed=min(w.spent, w.budget_s),
                       text=f"{w.spent:,.0f}/{w.budget_s:,.0f} s, {len(w.running)} running")

        try:
            ended = drive(worker, on_tick=tick)
            status = "FINISHED"
        finally:
            model = worker.model()
            summary = report(study, spec, out_dir, parent, spent_s=worker.ledger.spent_s(), budget_s=worker.budget_s,
                             ended=worker.done_reason or "interrupted",
                             model_points={n: asdict(p) for n, p in model.points.items()},
                             efficiency=model.scaling_efficiency())
            with storage.lock(spec.study):  # the last worker to end, ends the parent run
                worker.ledger.end()
                last = not worker.ledger.others_running()
            if last:
                from draftlab.rundir import StudyDir

                parent_tracker = tracking.MlflowTracker(parent, spool=StudyDir(out_dir).spool_path)
                if (best := summary.get("best")) and best.get("run_id"):  # its draft's version: best-<study>
                    from draftlab.registry.drafts import name_best

                    name_best(parent_tracker, base, study=spec.study, metric=spec.objective.metric,
                              direction=spec.objective.direction, value=best["value"], run_id=best["run_id"])
                parent_tracker.end(status)
                if line := parent_tracker.spool_line("sweep"):
                    console.print(f"[yellow]tracking[/]: {line}", soft_wrap=True)
            else:
                console.print("[bold]sweep[/]: another worker of the study still runs: the parent run stays RUNNING")
    counts = summary["trials"]
    console.print(f"[bold]sweep[/]: ended: {ended} after {time.time() - started:,.0f} s here; spent "
                  f"{summary['spent_s']:,.0f} of {summary['budget_s']:,.0f} s (overrun {summary['overrun_s']:,.0f} s); "
                  + ", ".join(f"{v} {k}" for k, v in counts.items() if v))
    if "best" in summary:
        b = summary["best"]
        console.print(f"[bold]sweep[/]: best trial {b['trial']}: {spec.objective.metric} = {b['value']:.4f} with "
                      f"{b['params']} (lr resolved {b['resolved_lr']:.3g}) → {out_dir / 'report'}")
    else:
        console.print(f"[bold red]sweep[/]: no trial of study {spec.study!r} has completed ({ended}); "
                      f"see {out_dir / 'report' / 'trials.csv'}", soft_wrap=True)
    return summary
