"""The study around a sweep worker: Optuna storage, the parent MLflow run, the live progress
line, and the parent's artifacts (best params, all trials with why they ended, the Pareto front
of quality vs GPU-hours, parameter importances).

    draftlab sweep experiments/sweep-tiny.yaml --budget 8m
"""

from __future__ import annotations

import csv
import json
import math
import os
import time
from dataclasses import asdict
from pathlib import Path

from draftlab.params import Params
from draftlab.sweep import PARENT_RUN_ATTR, SystemClock, Worker, drive, save_calibration, steps_from_lengths
from draftlab.sweep_budget import Point
from draftlab.sweep_space import SpaceError, SweepSpec, check_spec
from draftlab.util import write_json_atomic

EXPERIMENT = "draftlab"


def storage_url(spec: SweepSpec, out_dir: Path) -> str:
    return spec.storage or str(out_dir / "journal.log")


def open_storage(url: str):
    """A journal file (default, many processes on one host) or an RDB URL (PostgreSQL: many hosts)."""
    import optuna

    if "://" not in url:
        from optuna.storages.journal import JournalFileBackend

        Path(url).parent.mkdir(parents=True, exist_ok=True)
        return optuna.storages.JournalStorage(JournalFileBackend(url))
    try:
        return optuna.storages.RDBStorage(url)
    except Exception as err:  # noqa: BLE001 — unreachable database, missing driver: one line
        raise SpaceError(f"storage: cannot open {url!r} ({type(err).__name__}: {str(err).splitlines()[0]})") from None


def open_study(spec: SweepSpec, storage, base: Params):
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    p = spec.pruner
    lo, hi = spec.epochs_range(base)
    pruner = {"median": lambda: optuna.pruners.MedianPruner(n_startup_trials=p.startup_trials,
                                                            n_warmup_steps=p.warmup_epochs),
              "hyperband": lambda: optuna.pruners.HyperbandPruner(min_resource=1, max_resource=max(hi, 1)),
              "none": lambda: optuna.pruners.NopPruner()}[p.kind]()
    # constant_liar: concurrent trials see each other as pending, so the sampler spreads them
    sampler = optuna.samplers.TPESampler(seed=spec.seed, constant_liar=True)
    study = optuna.create_study(study_name=spec.study, storage=storage, direction=spec.objective.direction,
                                sampler=sampler, pruner=pruner, load_if_exists=True)
    if study.direction.name.lower() != spec.objective.direction:
        raise SpaceError(f"objective: study {spec.study!r} already {study.direction.name.lower()}s; use another "
                         "study name for a different objective")
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
    import mlflow

    from draftlab.tracking import git_tags, tracking_uri

    mlflow.set_tracking_uri(tracking_uri())
    client = mlflow.MlflowClient()
    run_id = study.user_attrs.get(PARENT_RUN_ATTR)
    if run_id:
        try:
            if client.get_run(run_id).info.status != "RUNNING":
                client.update_run(run_id, status="RUNNING")
            return run_id
        except Exception:  # noqa: BLE001 — deleted: make a new one
            pass
    mlflow.set_experiment(EXPERIMENT)
    exp = mlflow.get_experiment_by_name(EXPERIMENT)
    run = client.create_run(exp.experiment_id, run_name=f"sweep-{spec.study}",
                            tags={**git_tags(), "draftlab.stage": "sweep", "optuna.study": spec.study,
                                  "optuna.storage": storage_text})
    from draftlab.tracking import MlflowTracker

    MlflowTracker(run.info.run_id).log_params(
        {"sweep.objective": f"{spec.objective.direction} {spec.objective.metric}", "sweep.params": spec.params,
         "sweep.space": json.dumps({k: v.model_dump(exclude_none=True) for k, v in spec.space.items()}),
         "sweep.safety_margin": spec.safety_margin, "sweep.stop_grace_s": spec.stop_grace_s,
         "sweep.pruner": spec.pruner.kind})
    study.set_user_attr(PARENT_RUN_ATTR, run.info.run_id)
    return study.user_attrs[PARENT_RUN_ATTR]


def _plot_pareto(rows: list[dict], front: list[dict], metric: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    done = [r for r in rows if r["status"] == "completed"]
    ax.scatter([r["gpu_hours"] for r in done], [r["value"] for r in done], c="tab:gray", label="completed")
    ax.plot([r["gpu_hours"] for r in front], [r["value"] for r in front], "o-", c="tab:red", label="Pareto front")
    for r in done:
        ax.annotate(f"#{r['number']} {r['gpus']}g", (r["gpu_hours"], r["value"]), fontsize=7)
    ax.set_xlabel("GPU-hours (wall-clock × GPUs)")
    ax.set_ylabel(metric)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def pareto_front(rows: list[dict], maximize: bool) -> list[dict]:
    """Completed trials no other beats on both quality and GPU-hours, cheapest first."""
    done = sorted((r for r in rows if r["status"] == "completed"),
                  key=lambda r: (r["gpu_hours"], -r["value"] if maximize else r["value"]))
    front, best = [], -math.inf if maximize else math.inf
    for r in done:
        if (r["value"] > best) if maximize else (r["value"] < best):
            front.append(r)
            best = r["value"]
    return front


def trial_rows(study) -> list[dict]:
    rows = []
    for t in study.get_trials(deepcopy=False):
        a = t.user_attrs
        rows.append({"number": t.number, "state": t.state.name, "status": a.get("status", t.state.name.lower()),
                     "role": a.get("role", ""), "reason": a.get("reason", ""),
                     **{k: v for k, v in t.params.items()}, "gpus": a.get("gpus"),
                     "resolved_lr": a.get("resolved_lr"), "predicted_s": a.get("predicted_s"),
                     "wall_s": a.get("wall_s"), "gpu_hours": a.get("gpu_hours"),
                     "value": t.value if t.state.name == "COMPLETE" else None,
                     "devices": ",".join(a.get("devices", [])), "run_id": a.get("run_id", ""),
                     "worker": a.get("worker", "")})
    return rows


def report(study, spec: SweepSpec, out_dir: Path, run_id: str | None, *, spent_s: float, budget_s: float,
           ended: str, model_points: dict, efficiency: dict[int, float]) -> dict:
    """Write the sweep's artifacts into out_dir/report and log them to the parent run."""
    import optuna

    rep = out_dir / "report"
    rep.mkdir(parents=True, exist_ok=True)
    rows = trial_rows(study)
    columns = list(dict.fromkeys(k for r in rows for k in r))
    with open(rep / "trials.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=columns)
        w.writeheader()
        w.writerows(rows)
    maximize = spec.objective.direction == "maximize"
    front = pareto_front(rows, maximize)
    write_json_atomic(rep / "pareto.json", front)
    counts = {s: sum(r["status"] == s for r in rows) for s in
              ("calibration", "completed", "pruned", "rejected", "stopped-cap", "stopped-budget", "failed",
               "interrupted")}
    summary = {"study": spec.study, "objective": spec.objective.metric, "direction": spec.objective.direction,
               "budget_s": budget_s, "spent_s": round(spent_s, 1), "overrun_s": round(max(spent_s - budget_s, 0), 1),
               "ended": ended, "trials": counts, "calibration": model_points,
               "scaling_efficiency": {str(k): v for k, v in efficiency.items()}}
    done = [r for r in rows if r["status"] == "completed"]
    if done:
        best = max(done, key=lambda r: r["value"]) if maximize else min(done, key=lambda r: r["value"])
        summary["best"] = {"trial": best["number"], "value": best["value"], "params": study.trials[best["number"]].params,
                           "resolved_lr": best["resolved_lr"], "gpu_hours": best["gpu_hours"]}
    write_json_atomic(rep / "best_params.json", summary.get("best", {}))
    write_json_atomic(rep / "summary.json", summary)
    artifacts = [rep / "trials.csv", rep / "pareto.json", rep / "best_params.json", rep / "summary.json"]
    if done:
        _plot_pareto(rows, front, spec.objective.metric, rep / "pareto.png")
        artifacts.append(rep / "pareto.png")
    try:  # needs ≥ 2 completed trials that differ in some parameter
        if len(done) < 2:
            raise ValueError("fewer than 2 completed trials")
        importances = optuna.importance.get_param_importances(study)
        write_json_atomic(rep / "importance.json", importances)
        artifacts.append(rep / "importance.json")
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(5, 3))
        ax.barh(list(importances)[::-1], list(importances.values())[::-1])
        ax.set_xlabel(f"importance for {spec.objective.metric} (Optuna's default evaluator)")
        fig.tight_layout()
        fig.savefig(rep / "importance.png", dpi=120)
        plt.close(fig)
        artifacts.append(rep / "importance.png")
    except Exception as err:  # noqa: BLE001 — e.g. fewer than 2 completed trials: say so, keep the rest
        write_json_atomic(rep / "importance.json", {"unavailable": f"{type(err).__name__}: {err}"})
        artifacts.append(rep / "importance.json")
    if run_id:
        from draftlab.tracking import MlflowTracker

        tracker = MlflowTracker(run_id)
        metrics = {"sweep/spent_s": spent_s, "sweep/budget_s": budget_s, "sweep/overrun_s": summary["overrun_s"],
                   **{f"sweep/trials_{k.replace('-', '_')}": v for k, v in counts.items()},
                   **{f"sweep/scaling_efficiency_{n}": e for n, e in efficiency.items()},
                   **{f"sweep/calibration_tokens_per_s_{n}": p["tokens_per_s"] for n, p in model_points.items()}}
        if "best" in summary:
            metrics["sweep/best_value"] = summary["best"]["value"]
            tracker.log_params({f"best.{k}": v for k, v in summary["best"]["params"].items()})
        tracker.log_metrics(metrics)
        for path in artifacts:
            tracker.log_artifact(path, "sweep")
    return summary


def run(spec: SweepSpec, base: Params, *, target_dir: Path, data_dir: Path, store_dir: Path, out_dir: Path,
        devices_flag: str | None = None, n_trials: int | None = None, clock=None, launcher=None) -> dict:
    """`draftlab sweep`: check, open the study and its parent run, run this worker, report."""
    import mlflow
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from draftlab.console import console
    from draftlab.stages.train import train_split
    from draftlab.tracking import tracking_uri
    from draftlab.trial import ProcessLauncher

    devices, gpu = resolve_devices(spec, base, devices_flag)
    out_dir = out_dir / spec.study
    url = storage_url(spec, out_dir)
    for path, what in ((data_dir, "prepared dataset"), (store_dir / "manifest.json", "hidden-state store")):
        if not path.exists():
            raise SpaceError(f"{path}: no {what}; run `dvc repro extract` first (every trial trains on it)")
    check_spec(spec, base, num_devices=len(devices), calibrated=set(spec.gpu_counts(base)))  # all but the budget
    mlflow.set_tracking_uri(tracking_uri())
    reused: dict[int, Point] = {}
    if spec.calibration.reuse:
        from draftlab import store
        from draftlab.stages.train import _device_tags

        from draftlab.costmodel import points_from_mlflow

        found = points_from_mlflow(base, spec.gpu_counts(base), store_hash=store.manifest_hash(store_dir),
                                   device_model=_device_tags("cuda" if gpu else "cpu")["device.model"],
                                   client=mlflow.MlflowClient())
        reused = {n: p for n, p in found.items() if p.after_s is not None}  # a trial's: evaluate timed too
    if "://" not in url and not Path(url).exists():  # a new study: every check before anything is written
        check_spec(spec, base, num_devices=len(devices), calibrated=set(reused))
    storage = open_storage(url)
    study = open_study(spec, storage, base)
    from draftlab.sweep import CALIBRATION_ATTR

    calibrated = {int(n) for n in study.user_attrs.get(CALIBRATION_ATTR, {})}
    for n, point in reused.items():
        if n not in calibrated:
            save_calibration(study, point)
            console.print(f"[bold]sweep[/]: calibration at {n} GPU(s) from {point.source}: start-up "
                          f"{point.fixed_s:,.1f} s + {point.step_s:.3f} s/step + {point.epoch_s:.1f} s/epoch")
    calibrated |= set(reused)
    check_spec(spec, base, num_devices=len(devices), calibrated=calibrated)
    lengths, _ = train_split(data_dir, base.data.train_ratio)
    study.set_user_attr("draftlab.budget_s", spec.budget_s)
    study.set_user_attr("draftlab.space", json.loads(spec.model_dump_json()))
    parent = parent_run(study, spec, url)
    console.print(f"[bold]sweep[/]: study [cyan]{spec.study}[/] in {url}  (optuna-dashboard {url})")
    console.print(f"[bold]sweep[/]: budget {spec.budget_s:,.0f} s, trial cap "
                  f"{'—' if spec.trial_cap_s is None else f'{spec.trial_cap_s:,.0f} s'}, devices {devices}, "
                  f"objective {spec.objective.direction} {spec.objective.metric}; MLflow parent run {parent}")
    launcher = launcher or ProcessLauncher(study=spec.study, metric=spec.objective.metric, target_dir=target_dir,
                                           data_dir=data_dir, store_dir=store_dir, parent_run_id=parent,
                                           gpu_slots=gpu, total_slots=len(devices))
    worker = Worker(spec, base, study, launcher=launcher, clock=clock or SystemClock(), devices=devices,
                    out_dir=out_dir, steps_fn=steps_from_lengths(lengths), n_trials=n_trials,
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
            mlflow.MlflowClient().set_terminated(parent, status)
    counts = summary["trials"]
    console.print(f"[bold]sweep[/]: ended: {ended} after {time.time() - started:,.0f} s here; spent "
                  f"{summary['spent_s']:,.0f} of {summary['budget_s']:,.0f} s (overrun {summary['overrun_s']:,.0f} s); "
                  + ", ".join(f"{v} {k}" for k, v in counts.items() if v))
    if "best" in summary:
        b = summary["best"]
        console.print(f"[bold]sweep[/]: best trial {b['trial']}: {spec.objective.metric} = {b['value']:.4f} with "
                      f"{b['params']} (lr resolved {b['resolved_lr']:.3g}) → {out_dir / 'report'}")
    return summary
