"""One sweep trial as a process: `draftlab train` then `draftlab evaluate`, the very stage
functions, into a nested MLflow run under the sweep's parent run.

    python -m draftlab.sweep.trial --params trial-0003/params.yaml --out trial-0003 --parent-run-id <id> \
        --target models/target --data data/prepared --store data/hidden_states

The sweep starts it in its own session; `ProcessLauncher`/`ProcessHandle` are the sweep's side:
start with the trial's devices (CUDA_VISIBLE_DEVICES on GPU hosts), watch per-epoch values in
MLflow, stop both process groups (the trial's and torchrun's, which train.run starts in a
session of its own) with SIGTERM then SIGKILL, and mark a killed trial's MLflow run KILLED.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Sequence

from draftlab.rundir import TrialDir, TrialInfo, TrialResult
from draftlab.sweep.budget import Outcome, TrialSpec


def objective_of(metric: str, eval_metrics: dict, run_id: str) -> float:
    if metric == "val/loss":
        from draftlab import tracking

        hist = tracking.client().get_metric_history(run_id, "val/loss_epoch")
        return max(hist, key=lambda m: m.step).value
    return float(eval_metrics[metric])


def epoch_values(client, run_id: str, metric: str, ttt_steps: int) -> dict[int, float]:
    """Per-epoch values (epoch index → value) of the objective's validation proxy: val/loss_epoch,
    or 1 + Σ_k val/full_acc_k_epoch for acceptance lengths (speculators' draft-vocab metric).
    speculators logs them at the epoch's last global step; the i-th record is epoch i."""
    def by_epoch(key: str) -> dict[int, float]:
        history = sorted(client.get_metric_history(run_id, key), key=lambda m: m.step)
        return {i: m.value for i, m in enumerate(history)}

    if metric == "val/loss":
        return by_epoch("val/loss_epoch")
    per_k = [by_epoch(f"val/full_acc_{k}_epoch") for k in range(ttt_steps)]
    epochs = set.intersection(*(set(d) for d in per_k)) if per_k else set()
    return {e: 1 + sum(d[e] for d in per_k) for e in sorted(epochs)}


def _register(params, tracker, trial: TrialDir, *, target_dir: Path, store_dir: Path) -> None:
    """The trial's draft exported into its folder and registered (draftlab.registry.drafts), so
    every search trial's draft is a version users compare, and the sweep's best can be named."""
    from draftlab.console import console
    from draftlab.registry.drafts import register_export
    from draftlab.serve.draft_export import export_draft

    from draftlab.errors import UserError

    try:
        draft = export_draft(params, target_dir=target_dir, train_dir=trial.train.path, store_dir=store_dir,
                             out_dir=trial.draft)
    except UserError as err:  # the trial's objective stands; its draft is not a version
        console.print(f"[yellow]trial[/]: draft not exported, not registered: {err}", soft_wrap=True)
        return
    if line := register_export(params, tracker, draft_dir=draft.out_dir, train_dir=trial.train.path,
                               store_dir=store_dir, reports_dir=trial.reports):
        console.print(f"[bold]trial[/]: draft {line}", soft_wrap=True)


def _interrupt(signum, frame):
    raise KeyboardInterrupt  # train.run forwards it to torchrun's process group


def main(argv: Sequence[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m draftlab.sweep.trial")
    for name in ("--params", "--out", "--target", "--data", "--store", "--parent-run-id", "--study", "--metric"):
        ap.add_argument(name, required=name not in ("--parent-run-id",))
    ap.add_argument("--trial", type=int, required=True)
    ap.add_argument("--role", default="search")
    a = ap.parse_args(argv)
    signal.signal(signal.SIGTERM, _interrupt)
    from draftlab import threads

    threads.configure()  # the slot's share, set by the sweep in OMP_NUM_THREADS

    from draftlab.errors import UserError
    from draftlab.params import load_params
    from draftlab.stages import evaluate, train
    from draftlab.tracking import MlflowTracker, fail_fast_defaults, spool_beside

    fail_fast_defaults()
    out = Path(a.out)
    trial = TrialDir(out)
    started = time.time()
    try:
        params = load_params(a.params)
        tags = {"draftlab.sweep.study": a.study, "draftlab.sweep.trial": str(a.trial), "draftlab.sweep.role": a.role,
                "mlflow.runName": f"{a.study}-trial-{a.trial}"}
        if a.parent_run_id:
            tags["mlflow.parentRunId"] = a.parent_run_id
        tr = train.run(params, target_dir=Path(a.target), data_dir=Path(a.data), store_dir=Path(a.store),
                       out_dir=trial.train.path, run_tags=tags, started_at=started)
        # beside the reports evaluate logs: a spool uploads only files of its own folder (rundir.read_spool)
        tracker = MlflowTracker(tr.run_id, spool=spool_beside(trial.reports))
        # a calibration is evaluated too: its evaluate time is part of every trial's cost
        ev = evaluate.run(params, target_dir=Path(a.target), data_dir=Path(a.data), store_dir=Path(a.store),
                          train_dir=trial.train.path, out_dir=trial.reports, tracker=tracker)
        value = None if a.role == "calibration" else objective_of(a.metric, ev.metrics, tr.run_id)
        if a.role != "calibration":
            _register(params, tracker, trial, target_dir=Path(a.target), store_dir=Path(a.store))
        timing = trial.train.train.read().timing or {}
        wall = time.time() - started
        # timing/after_s lets later sweeps take this run as a calibration (costmodel.points_from_mlflow)
        tracker.log_metrics({"sweep/trial_wall_s": wall, "timing/after_s": max(wall - timing.get("wall_s", wall), 0.0),
                             **({} if value is None else {"sweep/objective": value})})
        result = TrialResult(ok=True, objective=value, run_id=tr.run_id, timing=timing, wall_s=wall)
        rc = 0
    except KeyboardInterrupt:
        result, rc = TrialResult(ok=False, message="stopped by the sweep (SIGTERM)"), 143
    except UserError as err:  # bad params, a training that failed its checks, …: its one line
        result, rc = TrialResult(ok=False, message=str(err)), err.exit_code
        failure = trial.train.failure.peek()
        if failure is not None and failure.reason in ("diverged", "stalled", "diverging"):
            result.convergence = failure.reason
    except Exception as err:  # noqa: BLE001 — the sweep records why and goes on
        result, rc = TrialResult(ok=False, message=f"{type(err).__name__}: {err}"), 1
    if result.wall_s is None:
        result.wall_s = time.time() - started
    trial.result.write(result)
    return rc


# ---------------------------------------------------------------- the sweep's side


def _signal_groups(pgids: Sequence[int], sig: int, trial_dir: Path | None = None) -> None:
    """`sig` to each process group; with SIGKILL also to the ranks recorded under `trial_dir`
    (torchrun gives each a session of its own, outside every group)."""
    if trial_dir is not None and sig == signal.SIGKILL:
        from draftlab import procs

        procs.kill_recorded(trial_dir / "train", wait_s=0)
    for pgid in pgids:
        try:
            os.killpg(pgid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def _torchrun_pgid(trial_dir: Path) -> int | None:
    launch = TrialDir(trial_dir).train.launch_file().peek()
    return launch.pgid if launch is not None else None


def _mark_run(trial_dir: Path, status: str) -> str | None:
    """A trial killed mid-training leaves its MLflow run RUNNING: end it as `status`; its id."""
    state = TrialDir(trial_dir).train.run.peek()
    if state is None:
        return None
    from draftlab import tracking

    run_id = state.run_id
    try:
        client = tracking.client()
        if client.get_run(run_id).info.status == "RUNNING":
            client.set_terminated(run_id, status)
    except Exception:  # noqa: BLE001 — tracking is best effort here; the study has the record
        pass
    return run_id


class ProcessHandle:
    def __init__(self, proc: subprocess.Popen, trial_dir: Path, metric: str, ttt_steps: int, log_file):
        self.proc, self.trial_dir, self.metric, self.ttt_steps = proc, trial_dir, metric, ttt_steps
        self.pgids = [proc.pid]
        self._log = log_file
        self._started = time.time()
        self._run_id: str | None = None

    def _groups(self) -> list[int]:
        torchrun = _torchrun_pgid(self.trial_dir)
        return self.pgids + ([torchrun] if torchrun else [])

    def poll(self) -> Outcome | None:
        rc = self.proc.poll()
        if rc is None:
            return None
        self._log.close()
        _signal_groups(self._groups(), signal.SIGKILL, self.trial_dir)  # ranks never outlive their trial
        trial = TrialDir(self.trial_dir)
        res = trial.result.peek() or TrialResult(ok=False)  # none, or torn: the process died first
        if not res.ok:
            _mark_run(self.trial_dir, "KILLED" if rc < 0 or rc == 143 else "FAILED")
        message = res.message or f"trial process exited with {rc}; see {trial.log_path}"
        wall = res.wall_s if res.wall_s is not None else time.time() - self._started
        return Outcome(res.ok, res.objective, float(wall), res.run_id or self.run_id(), message, res.timing,
                       convergence=res.convergence)

    def run_id(self) -> str | None:
        """The training's MLflow run, from the run folder as soon as the launcher wrote it."""
        if self._run_id is None and (state := TrialDir(self.trial_dir).train.run.peek()) is not None:
            self._run_id = state.run_id
        return self._run_id

    def intermediate(self) -> dict[int, float]:
        run_id = self.run_id()
        if run_id is None:
            return {}
        from draftlab import tracking

        try:
            return epoch_values(tracking.client(), run_id, self.metric, self.ttt_steps)
        except Exception:  # noqa: BLE001 — a busy store: try again next time
            return {}

    def terminate(self) -> None:
        _signal_groups(self._groups(), signal.SIGTERM)

    def kill(self) -> None:
        _signal_groups(self._groups(), signal.SIGKILL, self.trial_dir)


class ProcessLauncher:
    """Trials as `python -m draftlab.sweep.trial` processes, each in its own session."""

    def __init__(self, *, study: str, metric: str, target_dir: Path, data_dir: Path, store_dir: Path,
                 parent_run_id: str | None, gpu_slots: bool, total_slots: int = 1):
        self.study, self.metric = study, metric
        self.total_slots = total_slots  # this worker's device slots (the trials' threads split the CPUs)
        self.target_dir, self.data_dir, self.store_dir = target_dir, data_dir, store_dir
        self.parent_run_id, self.gpu_slots = parent_run_id, gpu_slots

    def env_for(self, spec: TrialSpec) -> dict:
        from draftlab import threads

        # the trial's share of this host's threads, so trials side by side never hold more
        # threads than there are CPUs: a CPU slot is one CPU; GPU slots split the CPUs evenly
        n = len(spec.devices)
        total = threads.budget()
        share = min(n, total) if not self.gpu_slots else max(total * n // max(self.total_slots, n), 1)
        env = threads.thread_env(1, dict(os.environ), total=share)
        if self.gpu_slots:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(spec.devices)
        return env

    def start(self, spec: TrialSpec) -> ProcessHandle:
        import yaml

        trial = TrialDir(spec.trial_dir)
        spec.trial_dir.mkdir(parents=True, exist_ok=True)
        params_path = trial.params_path
        params_path.write_text(yaml.safe_dump(spec.params.model_dump(), sort_keys=False))
        trial.info.write(TrialInfo(number=spec.number, values=spec.values, devices=spec.devices, role=spec.role))
        cmd = [sys.executable, "-m", "draftlab.sweep.trial", "--params", str(params_path), "--out", str(spec.trial_dir),
               "--target", str(self.target_dir), "--data", str(self.data_dir), "--store", str(self.store_dir),
               "--study", self.study, "--metric", self.metric, "--trial", str(spec.number), "--role", spec.role]
        if self.parent_run_id:
            cmd += ["--parent-run-id", self.parent_run_id]
        env = self.env_for(spec)
        log = open(trial.log_path, "ab")  # noqa: SIM115 — closed by the handle
        from draftlab import procs

        proc = procs.spawn(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)  # dies with this worker
        return ProcessHandle(proc, spec.trial_dir, self.metric, spec.params.train.ttt_steps, log)

    def reap(self, trial_dir: Path, pgids: Sequence[int], host: str) -> str | None:
        """A dead worker's trial: stop its processes (if they run here) and end its MLflow run
        (whose id it returns)."""
        if host == socket.gethostname():
            groups = list(pgids) + ([p] if (p := _torchrun_pgid(trial_dir)) else [])
            _signal_groups(groups, signal.SIGKILL, trial_dir)
        return _mark_run(trial_dir, "KILLED")


if __name__ == "__main__":
    sys.exit(main())
