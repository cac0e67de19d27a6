"""The sweep's report, written into `<out>/<study>/report/` and logged to the parent MLflow run:
every trial with why it ended (trials.csv), best params, the Pareto front of quality vs
GPU-hours, parameter importances, the summary the CLI prints.
"""

from __future__ import annotations

import csv
import math
from pathlib import Path

from draftlab.rundir import StudyDir
from draftlab.sweep.space import SweepSpec
from draftlab.util import write_json_atomic




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
    """Every trial of the study, then every rejected proposal (never a trial: no number, no state)."""
    from draftlab.sweep.propose import rejected
    from draftlab.sweep.storage import interrupted

    stale = interrupted(study)
    rows = []
    for t in study.get_trials(deepcopy=False):
        a = dict(t.user_attrs)
        if t.number in stale:  # failed by Optuna's heartbeat check: its own attrs were frozen
            a.update(status="interrupted", reason=stale[t.number]["reason"])
            a["run_id"] = a.get("run_id") or stale[t.number].get("run_id") or ""
        elif t.state.name == "FAIL" and a.get("status") == "running":
            a.update(status="interrupted", reason="its worker stopped without recording why")
        rows.append({"number": t.number, "state": t.state.name, "status": a.get("status", t.state.name.lower()),
                     "role": a.get("role", ""), "reason": a.get("reason", ""),
                     **{k: v for k, v in t.params.items()}, "gpus": a.get("gpus"),
                     "resolved_lr": a.get("resolved_lr"), "predicted_s": a.get("predicted_s"),
                     "wall_s": a.get("wall_s"), "gpu_hours": a.get("gpu_hours"),
                     "value": t.value if t.state.name == "COMPLETE" else None,
                     "devices": ",".join(a.get("devices", [])), "run_id": a.get("run_id", ""),
                     "worker": a.get("worker", "")})
    for r in rejected(study):
        rows.append({"number": None, "state": "", "status": "rejected", "role": "search", "reason": r["reason"],
                     **r["values"], "gpus": r.get("gpus"), "resolved_lr": r.get("resolved_lr"),
                     "predicted_s": r.get("predicted_s"), "wall_s": None, "gpu_hours": None, "value": None,
                     "devices": "", "run_id": "", "worker": r.get("worker", "")})
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
               "interrupted", "not-started")}
    summary = {"study": spec.study, "objective": spec.objective.metric, "direction": spec.objective.direction,
               "budget_s": budget_s, "spent_s": round(spent_s, 1), "overrun_s": round(max(spent_s - budget_s, 0), 1),
               "ended": ended, "trials": counts, "calibration": model_points,
               # calibration's bound (calibration.budget_share) and what its trials took of the budget
               "calibration_budget": {"share": spec.calibration.budget_share,
                                      "bound_s": round(spec.calibration.budget_share * budget_s, 1),
                                      "spent_s": round(sum(r["wall_s"] or 0.0 for r in rows
                                                           if r["role"] == "calibration"), 1)},
               "scaling_efficiency": {str(k): v for k, v in efficiency.items()}}
    done = [r for r in rows if r["status"] == "completed"]
    if done:
        best = max(done, key=lambda r: r["value"]) if maximize else min(done, key=lambda r: r["value"])
        summary["best"] = {"trial": best["number"], "value": best["value"], "params": study.trials[best["number"]].params,
                           "resolved_lr": best["resolved_lr"], "gpu_hours": best["gpu_hours"],
                           "run_id": best["run_id"]}
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

        tracker = MlflowTracker(run_id, spool=StudyDir(out_dir).spool_path)
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
