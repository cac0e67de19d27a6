"""`draftlab status [PATH]`: where a training or a sweep stands, from another shell, while it runs
or after it ended.

    draftlab status                      # runs/train
    draftlab status runs/sweeps/tiny     # a sweep's study folder
    draftlab status --json | --watch

It reads only what the job writes and never writes, locks or signals anything: for a run folder
its small records (progress.json, which rank 0 rewrites about once a second; failure.json,
train.json, the live bottleneck verdict, the checkpoints' training_state.json, the spool's size),
never the per-step files (metrics.jsonl, profile/*.jsonl), so it answers in well under a second
on a run of 10^5 steps (benchmarks/status_speed.py). Whether the job is alive is read from
/proc/locks (the launcher's flock on the folder) and the recorded process group, never by taking
the lock. A study folder is read through its Optuna journal (imported only then).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from draftlab.errors import UserError
from draftlab.rundir import Progress, RunDir

RUNNING, FINISHED, FAILED, DIVERGED, STOPPED, STALE, STARTING = (
    "running", "finished", "failed", "diverged", "stopped", "stale", "not started")


class StatusError(UserError):
    """A path that is neither a run folder nor a study folder, or a store that cannot be read."""


def _json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _lock_held(path: Path) -> bool:
    """Whether some process holds a flock on `path`, from /proc/locks (taking the lock to find out
    would, for an instant, refuse a launcher starting then)."""
    try:
        st = path.stat()
        locks = Path("/proc/locks").read_text()
    except OSError:
        return False
    ino = f":{st.st_ino} "
    dev = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino} "
    return any("FLOCK" in line and (dev in line + " " or ino in line + " ") for line in locks.splitlines())


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def is_run(path: Path) -> bool:
    rd = RunDir(path)
    return any(p.exists() for p in (rd.run.path, rd.plan.path, rd.train.path, rd.progress.path))


def is_study(path: Path) -> bool:
    return (path / "journal.log").is_file()


def _last_checkpoint(rd: RunDir) -> dict | None:
    best = None
    for state in rd.checkpoints.glob("[0-9]*/training_state.json"):
        rec = _json(state)
        if rec is None:
            continue
        if best is None or rec.get("global_step", -1) > best[0].get("global_step", -1):
            best = (rec, state.parent)
    if best is None:
        return None
    rec, folder = best
    weights = folder / "model.safetensors"
    mtime = (weights if weights.exists() else folder).stat().st_mtime
    return {"path": str(folder), "epoch": rec.get("epoch"), "global_step": rec.get("global_step"),
            "age_s": round(time.time() - mtime, 1)}


def _spool(rd: RunDir) -> dict:
    path = rd.spool_path
    if not path.exists():
        return {"spooling": False, "records_waiting": 0}
    with open(path, "rb") as f:
        n = sum(chunk.count(b"\n") for chunk in iter(lambda: f.read(1 << 20), b""))
    return {"spooling": True, "records_waiting": n, "spool": str(path),
            "upload": f"draftlab tracking-import {path}"}


def _last_step_record(rd: RunDir) -> dict | None:
    """The last line of metrics.jsonl (a run folder without progress.json), read from its end."""
    path = rd.step_metrics_path
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(size - 65536, 0))
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        try:
            return json.loads(line)
        except ValueError:
            continue
    return None


def run_status(path: Path) -> dict:
    """Everything `draftlab status` says about one run folder, as one JSON-able dict."""
    from draftlab import tracking

    path = Path(path)
    rd = RunDir(path)
    if not path.is_dir() or not is_run(path):
        raise StatusError(f"{path}: not a run folder (no run.json, plan.json or train.json) nor a study folder "
                          "(no journal.log); pass the train stage's --out or a sweep's study folder")
    launched = rd.plan.path.exists()  # plan.json holds every step's tokens: not read (10^5 steps: MBs)
    prog_raw = _json(rd.progress.path)
    try:
        prog = Progress.model_validate(prog_raw) if prog_raw else None
    except ValueError:
        prog = None
    failure = _json(rd.failure.path)
    done = _json(rd.train.path)
    launch = _json(rd.launch_file().path)
    alive = _lock_held(rd.lock_path()) or bool(launch and launch.get("pgid") and _group_alive(launch["pgid"]))
    plan_mtime = rd.plan.path.stat().st_mtime if launched else 0.0
    if alive:
        state = RUNNING
    elif failure is not None:
        reason = failure.get("reason")
        state = DIVERGED if reason == "diverged" else STOPPED if reason in ("stalled", "diverging") else FAILED
    elif done is not None and rd.train.path.stat().st_mtime >= plan_mtime:
        state = FINISHED
    elif launched:
        state = STALE  # launched, nothing alive, no end record: killed
    else:
        state = STARTING
    out: dict = {"kind": "run", "path": str(path), "state": state}
    if failure is not None and state != RUNNING:
        out["why"] = failure.get("message")
    total = (prog.total_steps if prog is not None else None) or (done or {}).get("total_steps") or \
        (_json(rd.accounting.path) or {}).get("total_steps")
    out["total_steps"] = total
    if prog is not None:
        age = time.time() - prog.updated_at
        out.update(step=prog.step + 1, epoch=prog.epoch, updated_s_ago=round(age, 1),
                   percent=round(100.0 * (prog.step + 1) / prog.total_steps, 1) if prog.total_steps else None)
        if prog.eta_s is not None and state == RUNNING:
            left = lambda x: None if x is None else round(max(x - age, 0.0), 1)  # noqa: E731
            out["eta"] = {"s": left(prog.eta_s), "p10_s": left(prog.eta_p10_s), "p90_s": left(prog.eta_p90_s)}
        out["losses"] = prog.losses
        convergence = prog.convergence
        if state == DIVERGED:
            convergence = "diverged"
        out["convergence"] = {"trend": convergence, "check": prog.trend}
    else:
        last = _last_step_record(rd)
        if last is not None:
            out.update(step=int(last["step"]) + 1, epoch=last.get("epoch"),
                       losses={k[6:]: v for k, v in last.items() if k.startswith("train/loss")})
    if state == FINISHED and done is not None:
        out["step"] = done.get("total_steps", out.get("step"))
        out["finished"] = {"wall_clock_s": done.get("wall_clock_s"), "tokens_per_s": done.get("tokens_per_s"),
                           "checkpoint": done.get("checkpoint")}
    verdict = _json(RunDir(path).live_verdict_path)
    final = _json(rd.bottleneck_path) if state == FINISHED else None
    if final is not None:
        o = final.get("overall", {})
        out["bottleneck"] = {"label": o.get("label"), "evidence": o.get("evidence"), "remedy": o.get("remedy"),
                             "window": "the run"}
    elif verdict is not None:
        out["bottleneck"] = verdict
    out["checkpoint"] = _last_checkpoint(rd)
    out["tracking"] = _spool(rd)
    run = _json(rd.run.path)
    if run is not None:
        exp = prog.experiment_id if prog is not None else None
        out["mlflow"] = {"run_id": run.get("run_id"),
                         "ui": tracking.ui_url(exp, run.get("run_id")) if exp else tracking.ui_url()}
    return out


def study_status(path: Path) -> dict:
    """A sweep's study folder: trials by outcome, the budget, the best trial so far."""
    import optuna

    from draftlab.sweep.report import trial_rows

    path = Path(path)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    try:
        from draftlab.sweep.storage import journal

        storage = journal(path / "journal.log")
        names = [s.study_name for s in optuna.get_all_study_summaries(storage, include_best_trial=False)]
        name = path.name if path.name in names else (names[0] if names else None)
        if name is None:
            raise StatusError(f"{path / 'journal.log'}: holds no study; pass the folder `draftlab sweep` wrote")
        study = optuna.load_study(study_name=name, storage=storage)
        rows = trial_rows(study)
    except StatusError:
        raise
    except Exception as err:  # noqa: BLE001 — a journal the job is writing, or not Optuna's
        raise StatusError(f"{path / 'journal.log'}: cannot be read ({type(err).__name__}: {err}); "
                          "check the path, or wait and retry if the sweep is writing it") from None
    counts: dict[str, int] = {}
    for r in rows:
        counts[r["status"]] = counts.get(r["status"], 0) + 1
    attrs = study.user_attrs
    budget = attrs.get("draftlab.budget_s")
    spent = _spent_s(study)
    complete = [t for t in study.get_trials(deepcopy=False) if t.state.name == "COMPLETE"]
    best = None
    if complete:
        b = max(complete, key=lambda t: t.value) if study.direction.name == "MAXIMIZE" else min(complete, key=lambda t: t.value)
        best = {"number": b.number, "value": b.value, "params": b.params, "run_id": b.user_attrs.get("run_id")}
    pruned = [{"number": r["number"], "reason": r["reason"]} for r in rows if r["status"] == "pruned"]
    return {"kind": "study", "path": str(path), "study": name, "metric": (study.metric_names or [None])[0],
            "direction": study.direction.name.lower(),
            "trials": {"completed": counts.get("completed", 0), "running": counts.get("running", 0),
                       "pruned": counts.get("pruned", 0), "rejected": counts.get("rejected", 0),
                       "failed": counts.get("failed", 0) + counts.get("interrupted", 0),
                       "other": {k: v for k, v in counts.items()
                                 if k not in ("completed", "running", "pruned", "rejected", "failed", "interrupted")}},
            "budget": {"budget_s": budget, "spent_s": spent,
                       "left_s": None if budget is None or spent is None else round(max(budget - spent, 0.0), 1)},
            "best": best, "pruned": pruned}


def _spent_s(study) -> float | None:
    """The budget spent: the workers' ledger (draftlab.sweep.budget) as recorded in the study."""
    from draftlab.sweep.budget import WORKER_ATTR, union_s

    spans = [(w["start"], w["last"]) for k, w in study.user_attrs.items()
             if k.startswith(WORKER_ATTR) and isinstance(w, dict) and "start" in w and "last" in w]
    return round(union_s(spans), 1) if spans else None


def status(path: Path) -> dict:
    path = Path(path)
    if not path.exists():
        raise StatusError(f"{path}: not found; pass a run folder (default runs/train) or a sweep's study folder")
    if is_study(path):
        return study_status(path)
    return run_status(path)


def to_json(info: dict) -> str:
    """One JSON object; a NaN or inf (a diverged run's last loss) as a string, which strict
    readers (jq) accept."""
    import math

    def fix(x):
        if isinstance(x, float) and not math.isfinite(x):
            return str(x)
        if isinstance(x, dict):
            return {k: fix(v) for k, v in x.items()}
        if isinstance(x, list):
            return [fix(v) for v in x]
        return x

    return json.dumps(fix(info), allow_nan=False)


# ------------------------------------------------------------------ rendering


def _pct(x: float) -> str:
    return f"{x * 100:+.0f}%".replace("-", "−")


def _dur(s: float | None) -> str:
    if s is None:
        return "?"
    return f"{s / 3600:.1f} h" if s >= 5400 else f"{s / 60:.1f} min" if s >= 90 else f"{s:.0f} s"


def render(info: dict):
    from rich.table import Table

    t = Table(show_header=False, box=None, pad_edge=False)
    t.add_column(style="bold", no_wrap=True)
    t.add_column(overflow="fold")
    if info["kind"] == "study":
        tr, b = info["trials"], info["budget"]
        t.add_row("study", f"{info['study']} ({info['path']})")
        t.add_row("trials", f"{tr['completed']} completed, {tr['running']} running, {tr['pruned']} pruned, "
                  f"{tr['rejected']} rejected, {tr['failed']} failed")
        t.add_row("budget", f"{_dur(b['spent_s'])} spent of {_dur(b['budget_s'])}, {_dur(b['left_s'])} left")
        if info["best"]:
            best = info["best"]
            t.add_row("best", f"trial {best['number']}: {info['metric']} = {best['value']:.4g}  {best['params']}")
        for p in info["pruned"]:
            t.add_row("pruned", f"trial {p['number']}: {p['reason']}")
        return t
    state = info["state"]
    colour = {"running": "green", "finished": "bold green", "diverged": "red", "failed": "red", "stale": "yellow",
              "stopped": "yellow"}.get(state, "")
    t.add_row("state", f"[{colour}]{state}[/]" if colour else state)
    if info.get("why"):
        t.add_row("why", info["why"])
    if info.get("step") is not None:
        pct = f" ({info['percent']}%)" if info.get("percent") is not None else ""
        t.add_row("step", f"{info['step']:,} / {info.get('total_steps') or '?':,}{pct}, epoch {info.get('epoch')}"
                  + (f", updated {info['updated_s_ago']:.0f} s ago" if state == RUNNING else ""))
    elif info.get("total_steps"):
        t.add_row("step", f"– / {info['total_steps']:,} (no step yet)")
    if "eta" in info:
        e = info["eta"]
        rng = f" ({_dur(e['p10_s'])}–{_dur(e['p90_s'])})" if e.get("p10_s") is not None else ""
        t.add_row("ETA", f"{_dur(e['s'])}{rng}")
    if info.get("losses"):
        conv = info.get("convergence") or {}
        check = (conv.get("check") or {}).get("positions", {})
        parts = []
        for k, v in info["losses"].items():
            trend = check.get(k)
            parts.append(f"{k} {v:.3f}" + (f" ({_pct(trend['change'])}, {trend['trend']})" if trend else ""))
        t.add_row("loss", ", ".join(parts))
        if conv:
            overall = (conv.get("check") or {}).get("overall_change")
            t.add_row("trend", conv["trend"] + (f" (loss {_pct(overall)} since warmup)" if overall is not None else ""))
    if info.get("bottleneck"):
        b = info["bottleneck"]
        ev = b.get("evidence") or {}
        figs = ", ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}" for k, v in ev.items()
                         if not isinstance(v, dict | list))
        t.add_row("bottleneck", f"{b.get('label')} ({b.get('window', 'last window')}){': ' + figs if figs else ''}")
    c = info.get("checkpoint")
    t.add_row("checkpoint", f"{c['path']} (global step {c['global_step']}, {_dur(c['age_s'])} ago)" if c else "none yet")
    tk = info["tracking"]
    t.add_row("tracking", f"[yellow]spooling[/]: {tk['records_waiting']} record(s) wait; `{tk['upload']}`"
              if tk["spooling"] else "MLflow reachable (nothing spooled)")
    if info.get("mlflow"):
        t.add_row("MLflow", f"run {info['mlflow']['run_id']}  {info['mlflow']['ui']}")
    return t


def watch(path: Path, every_s: float = 2.0) -> dict:
    """Refresh in place until the job is no longer running (or Ctrl-C); the last status."""
    from rich.console import Console
    from rich.live import Live

    info = status(path)
    with Live(render(info), console=Console(highlight=False), refresh_per_second=4) as live:
        try:
            while info.get("state") == RUNNING or (info["kind"] == "study" and info["trials"]["running"]):
                time.sleep(every_s)
                info = status(path)
                live.update(render(info))
        except KeyboardInterrupt:
            pass
    return info
