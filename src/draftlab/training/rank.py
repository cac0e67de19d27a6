"""One training rank: speculators' trainer (patched for this machine's device by
`draftlab.training.compat`) plus draftlab's observers, configured by the launcher: `DRAFTLAB_RUN_DIR` names the run folder,
whose rank plan (draftlab.rundir.RankPlan) says the rest.

    torchrun --nproc-per-node N -m draftlab.training.rank <speculators train flags>

Observers (rank-local, no effect on what the trainer computes):
- every rank appends the sample ids its train sampler hands out per epoch to
  the run folder (RunDir.samples_file) — the launcher checks them disjoint and complete;
- global rank 0, on whichever node it runs, turns speculators' metric records into the MLflow run's
  (its id read from the shared run folder's run.json), with perf/* figures derived from the step
  accounting, skipping steps already logged before a resume; it writes them to the run folder's
  relay file, which node 0's launcher uploads into the run (draftlab.tracking.Relay: the rank
  imports no MLflow and opens no store); it also appends
  each step's train/* metrics to `$DRAFTLAB_RUN_DIR/metrics.jsonl` once (draftlab.training.metrics)
  and keeps `progress.json` (step, ETA, trend) for `draftlab status`;
- every rank runs the convergence watch (draftlab.training.watch) on the same all-reduced metrics:
  a NaN/inf loss stops every rank at the same step (exit 3), a trend in train.watch.stop_on too
  (exit 5), and no checkpoint with non-finite weights is written over the last good one.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path

from draftlab import pystack
from draftlab.plan.run_timing import Eta
from draftlab.rundir import Failure, Progress, RankDone, RankPlan, RunDir
from draftlab.training import compat, startup
from draftlab.training import metrics as train_metrics
from draftlab.training import watch as conv
from draftlab.store.hidden_states import HiddenStateFileError, clean_message, source_from_trainer_args
from draftlab.training.compat import run_trainer


class _Batched:
    """Rank 0's metric records, written in batches on the trainer's own thread: at most one write
    per FLUSH_S (a step's records wait in a list), each record keeping the time it was made. The
    tracker is the relay file (tracking.RelayWriter), so a write is a few lines to a file the
    rank holds open. The writer thread this replaced cost more than the writes (0.18 ms a step
    of its own, on the tiny default: a wake-up every step for a queue item). `drain()` (before
    every checkpoint) writes what waits and syncs it to disk. A write that fails (a full disk) is
    raised by that drain() or close(); what follows it is not written."""

    FLUSH_S = 1.0

    def __init__(self, tracker):
        self.tracker = tracker
        self.error: BaseException | None = None
        self.pending: list = []
        self.written_at = time.monotonic()
        self.drain_s: list[float] = []  # how long each drain() held the trainer (checkpoints)

    def _send(self) -> None:
        records, self.pending, self.written_at = self.pending, [], time.monotonic()
        if records:
            self._guarded(self._write, records)

    def _write(self, records: list) -> None:
        many = getattr(self.tracker, "log_metrics_many", None)
        if many is not None:
            many(records)
        else:
            for metrics, step, _ in records:
                self.tracker.log_metrics(metrics, step=step)

    def _guarded(self, fn, *args) -> None:
        if self.error is not None:  # the first failure stands; what follows is not written
            return
        try:
            fn(*args)
        except Exception as err:  # noqa: BLE001 — said by the next drain() or close()
            self.error = err

    def log_metrics(self, metrics, step=None):
        self.pending.append((metrics, step, int(time.time() * 1000)))
        if time.monotonic() - self.written_at >= self.FLUSH_S:
            self._send()

    def set_tags(self, tags: dict) -> None:
        self._send()  # in the order they were made
        self._guarded(self.tracker.set_tags, tags)

    def drain(self) -> None:
        """Write every record made so far (and sync it, where the tracker can)."""
        started = time.monotonic()
        self._send()
        if hasattr(self.tracker, "sync"):
            self._guarded(self.tracker.sync)  # the relay file: on disk before the checkpoint
        self.drain_s.append(time.monotonic() - started)
        if self.error is not None:
            raise self.error

    def stall_report(self) -> dict:
        """What tracking cost the trainer's thread in waits, and the outages behind them."""
        return {"drains": len(self.drain_s), "drain_s_max": max(self.drain_s, default=0.0),
                "drain_s_total": sum(self.drain_s), "outages": getattr(self.tracker, "outages", 0),
                "failed_call_s_max": getattr(self.tracker, "failed_call_s_max", 0.0)}

    def close(self):
        self._send()
        if hasattr(self.tracker, "close"):
            self._guarded(self.tracker.close)
        if self.error is not None:
            raise self.error


class CpuTimed(logging.Handler):
    """Runs another handler and adds up the CPU seconds it takes on the trainer's thread."""

    def __init__(self, inner: logging.Handler):
        super().__init__()
        self.inner, self.cpu_s = inner, 0.0

    def emit(self, record):
        t = time.thread_time()
        try:
            self.inner.emit(record)
        finally:
            self.cpu_s += time.thread_time() - t


class MetricsToTracker(logging.Handler):
    """speculators.metrics records → MLflow names, perf/* from the accounting plan.

    Every step's rates, ETA and train/* metrics go to MLflow; the step's phases (perf/fetch_ms …
    perf/step_ms) as their mean over each epoch, at its last step: every MLflow row costs the
    tracking writer ~56 µs of CPU, and each step's phases are in profile/rank<k>.jsonl already."""

    PHASES = ("fetch_ms", "fwd_ms", "bwd_ms", "opt_ms", "step_ms")
    # `train_mean/loss`: train/loss averaged over each THIN_STEPS global steps, the curve a user
    # reads at the reference's 177 k steps (the UI's raw train/loss chart then takes seconds)
    THIN_STEPS = 1000

    def __init__(self, tracker, plan: RankPlan, run_dir: Path):
        super().__init__()
        self.tracker = _Batched(tracker)
        self.optimizer = plan.optimizer
        self.run_dir = run_dir
        self.total_steps = plan.total_steps
        self.step_tokens = plan.step_tokens  # real (unpadded) tokens of every global step
        self.last_logged = plan.last_logged_step
        self.eta = Eta(plan)  # draftlab.plan.run_timing
        self.flatten = compat.metric_flattener()
        self.steps = train_metrics.StepWriter(run_dir)  # the run folder's own copy, for evaluate
        self.phases: dict[str, list[float]] = {}  # this epoch's step phases so far
        self.thin: list[float] = []  # train/loss since the last train_mean/loss point
        self.guard: ConvergenceGuard | None = None
        self.progress_at = 0.0
        self.experiment_id: str | None = None

    def emit(self, record):  # exceptions propagate on purpose: a NaN must stop training
        if getattr(record, "hparams", False):
            return
        step = getattr(record, "step", None)
        flat = self.flatten(record.msg)
        if "train/loss" in flat:
            self._train(step, flat)
        elif any(k.startswith("val/") for k in flat):
            self.tracker.log_metrics({k: v for k, v in flat.items() if k.startswith("val/")}, step=step)

    def _train(self, step: int, flat: dict) -> None:
        out = {k: v for k, v in flat.items() if k.startswith("train/")}
        out["epoch"] = flat.get("epoch", 0)
        self.steps.write(step, out)
        if step <= self.last_logged:  # redone after a resume: already in the run
            return
        for k, v in flat.items():
            if k == "lr":
                out[f"lr/{self.optimizer}"] = v
            elif k.startswith("lr/"):
                out[k] = v
        step_ms = flat.get("profile/step_ms")
        self.eta.step_ended(step, time.perf_counter(), (step_ms or 0) / 1000)
        if step_ms:
            steps_per_s = 1000.0 / step_ms
            tokens = self.step_tokens[step] if step < len(self.step_tokens) else 0
            out.update({
                "perf/steps_per_s": steps_per_s,
                "perf/tokens_per_s": tokens * steps_per_s,
                "perf/data_wait_frac": flat.get("profile/fetch_frac", 0.0),
            })
            out.update(self.eta.estimate(step))
            for k in self.PHASES:
                if f"profile/{k}" in flat:
                    self.phases.setdefault(k, []).append(flat[f"profile/{k}"])
            if step in self.eta.ends or step == self.total_steps - 1:  # an epoch's last step
                out.update({f"perf/{k}": sum(v) / len(v) for k, v in self.phases.items()})
                self.phases = {}
        self.thin.append(flat["train/loss"])
        if (step + 1) % self.THIN_STEPS == 0 or step == self.total_steps - 1:
            out["train_mean/loss"] = sum(self.thin) / len(self.thin)
            self.thin = []
        self.tracker.log_metrics(out, step=step)
        self.last_logged = step
        self._progress(step, flat, out)

    def _progress(self, step: int, flat: dict, out: dict) -> None:
        """progress.json, about once a second (and at each trend check and the last step): the
        trainer's thread writes it, so it stays fresh on a host whose CPUs the trainer fills."""
        now = time.time()
        checked = self.guard is not None and self.guard.checked_at == step
        if now - self.progress_at < 1.0 and not checked and step != self.total_steps - 1:
            return
        self.progress_at = now
        guard = self.guard
        rec = Progress(step=step, total_steps=self.total_steps, epoch=int(flat.get("epoch", 0)), updated_at=now,
                       eta_s=out.get("perf/eta_s"), eta_p10_s=out.get("perf/eta_p10_s"),
                       eta_p90_s=out.get("perf/eta_p90_s"),
                       losses={k[6:]: v for k, v in flat.items() if k.startswith("train/loss")},
                       convergence=guard.watch.state if guard is not None else conv.WARMING_UP,
                       trend=guard.watch.last.to_json() if guard is not None and guard.watch.last else None,
                       experiment_id=self.experiment_id)
        write_quick(RunDir(self.run_dir).progress.path, rec.model_dump(mode="json"))


def write_quick(path: Path, obj: dict) -> None:
    """Atomic (a reader sees the old file or the new one) without fsync: a progress record
    outlives no power cut, and an fsync a second would cost the trainer's thread."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(obj))
    os.replace(tmp, path)


class Diverged(FloatingPointError):
    """A NaN/inf loss (or weights about to be checkpointed): the run stops on every rank."""


class WatchStop(RuntimeError):
    """A trend in train.watch.stop_on: the run stops on every rank."""


class ConvergenceGuard(logging.Handler):
    """Every rank: the convergence watch on the step's all-reduced metrics (every rank sees the same
    values, so all stop at the same step), each writing the same failure.json. Rank 0 (`writer`)
    also sets the draftlab.convergence tag (`tags`) and prints one line per change of trend."""

    def __init__(self, plan: RankPlan, run_dir: Path, *, writer: bool):
        super().__init__()
        w = plan.watch or {}
        self.watch = conv.ConvergenceWatch(warmup_steps=plan.warmup_steps, total_steps=plan.total_steps,
                                           window_steps=w.get("window_steps"), stall_frac=w.get("stall_frac", 0.02),
                                           diverge_frac=w.get("diverge_frac", 0.10))
        self.stop_on = set(w.get("stop_on", ()))
        self.total_steps = plan.total_steps
        self.run_dir, self.writer = run_dir, writer
        self.tags = None  # rank 0: the tracker's set_tags
        self.checked_at = -1
        self.said = conv.WARMING_UP

    def emit(self, record):  # exceptions propagate on purpose: they stop training
        if getattr(record, "hparams", False) or not isinstance(record.msg, dict):
            return
        train = record.msg.get("train")
        if not isinstance(train, dict):
            return
        step = getattr(record, "step", -1)
        bad = conv.non_finite(train)
        if bad is not None:
            self._last_progress(step, train, record.msg.get("epoch"), conv.DIVERGED)
            self.stop(conv.DIVERGED, f"train/{bad[0]} is {bad[1]} at global step {step} "
                      f"(epoch {record.msg.get('epoch')}): training stopped; the last good checkpoint is kept")
        check = self.watch.observe(step, train)
        if check is None:
            return
        self.checked_at = step
        if check.state != self.said:
            self.said = check.state
            if self.writer:
                print(f"train: step {step + 1}/{self.total_steps} — {check.line()}", file=sys.stderr, flush=True)
                if self.tags is not None:
                    self.tags({conv.TAG: check.state})
        if check.state in self.stop_on:
            self._last_progress(step, train, record.msg.get("epoch"), check.state)
            self.stop(check.state, f"train: loss {check.state} at global step {step} ({check.line()}): "
                      f"stopped by train.watch.stop_on")

    def stop(self, state: str, msg: str) -> None:
        # every rank writes the same record: the first rank out ends torchrun's group, maybe before
        # rank 0 (slower: speculators' console handlers run there first) has seen the step
        self.watch.state = state
        RunDir(self.run_dir).failure.write(Failure(reason=state, message=msg))
        if self.writer and self.tags is not None:
            self.tags({conv.TAG: state})
        raise (Diverged if state == conv.DIVERGED else WatchStop)(msg)

    def _last_progress(self, step: int, train: dict, epoch, state: str) -> None:
        """progress.json at the step that stops the run (the tracker's handler never sees it)."""
        if not self.writer:
            return
        path = RunDir(self.run_dir).progress.path
        try:
            rec = json.loads(path.read_text())
        except (OSError, ValueError):
            rec = {"total_steps": self.total_steps}
        rec.update(step=step, epoch=int(epoch or 0), updated_at=time.time(), convergence=state,
                   losses={k: float(v) for k, v in train.items() if k == "loss" or k.startswith("loss_")},
                   trend=self.watch.last.to_json() if self.watch.last else None)
        write_quick(path, rec)

    def refuse_checkpoint(self) -> None:
        self.stop(conv.DIVERGED, "non-finite weights before a checkpoint: training stopped; the last good "
                  "checkpoint is kept")


def main(argv: list[str]) -> None:
    from draftlab import procs

    main_at = time.time()
    procs.die_with_parent()  # torchrun starts ranks in their own session: only this reaches them
    import speculators  # noqa: F401 — loaded here by name, so that start-up shows its cost apart

    speculators_at = time.time()
    run_dir = Path(os.environ["DRAFTLAB_RUN_DIR"]) if "DRAFTLAB_RUN_DIR" in os.environ else None
    rank = int(os.environ.get("RANK", "0"))
    node = int(os.environ.get("DRAFTLAB_NODE_RANK", "0"))  # train.node_rank: c10d's RANK order ignores it
    handlers = []
    # run.json first: a new run's launcher completes plan.json (the ETA's priors) before it
    state = await_run(RunDir(run_dir)) if run_dir is not None else None
    plan = RunDir(run_dir).plan.read() if run_dir is not None else None
    from draftlab.training import checkpoint

    checkpoint.install()  # every checkpoint written aside and renamed in whole, after a free-space check
    if run_dir is not None:
        procs.record_self(RunDir(run_dir).node_dir(node), f"rank{rank}")  # stopped by this node's launcher
        from draftlab.observe.telemetry import StepProfileRecorder

        compat.record_sampler_batches(RunDir(run_dir).samples_file(rank))
        handlers.append(CpuTimed(StepProfileRecorder(run_dir, rank)))
        guard = ConvergenceGuard(plan, run_dir, writer=rank == 0) if plan.watch is not None else None
        if guard is not None:
            handlers.append(CpuTimed(guard))  # before the tracker's: a NaN step is not logged
            compat.refuse_non_finite_checkpoint(guard.refuse_checkpoint)
        run_id = state.run_id
        os.environ.setdefault("MLFLOW_RUN_ID", run_id)  # the run's id in every rank's environment
        if rank == 0:
            from draftlab.tracking import RelayWriter

            # the records go to the run folder's relay file; node 0's launcher uploads them (tracking.Relay)
            metrics = MetricsToTracker(RelayWriter(RunDir(run_dir).relay_path, run_id), plan, run_dir)
            metrics.experiment_id = state.experiment_id
            metrics.guard = guard
            if guard is not None:
                guard.tags = metrics.tracker.set_tags
            handlers.append(CpuTimed(metrics))
            # every step up to a checkpoint is on disk in the relay file before the checkpoint exists:
            # a rank killed by SIGKILL (it dies with its launcher) loses only records of steps a resume
            # redoes, and the next launcher uploads what its predecessor had not
            compat.before_checkpoint(metrics.tracker.drain)
    source = source_from_trainer_args(argv) if plan is not None else None
    if source is not None:
        source.install_in_rank(plan.verify_reads)  # the store: every file read is checked first
    marks = startup.rank_marks(main_at, speculators_at, time.time())
    try:
        # the steps' calls inside one chunk of the frame stack, whatever depth they start at (pystack)
        pystack.call(run_trainer, argv, metric_handlers=handlers)
    except FloatingPointError as err:  # the launcher reads failure.json and says it once
        if run_dir is None or not isinstance(err, Diverged):
            print(f"draftlab: {err}", file=sys.stderr)
        sys.exit(conv.EXIT_DIVERGED)
    except WatchStop:
        sys.exit(conv.EXIT_STOPPED)
    except HiddenStateFileError as err:
        msg = clean_message(err)
        if run_dir is not None:
            RunDir(run_dir).failure.write(Failure(reason="bad hidden-state file", message=msg))
        print(f"draftlab: {msg}", file=sys.stderr)
        sys.exit(4)
    except checkpoint.CheckpointSpaceError as err:
        if run_dir is not None and rank == 0:  # the rank that checked the disk says why; the others follow it
            try:
                RunDir(run_dir).failure.write(Failure(reason="disk full", message=str(err)))
            except OSError:  # the disk is full: the launcher names torchrun's exit, the rank's line is below
                pass
        print(f"draftlab: {err}", file=sys.stderr)
        sys.exit(4)
    finally:
        for h in handlers:
            if isinstance(h.inner, MetricsToTracker):
                h.inner.tracker.close()  # every queued record reaches the store before the rank exits
    if run_dir is not None and rank == 0:
        # what draftlab's observers cost this rank (the launcher adds its own to train.json)
        cpu = {type(h.inner).__name__: h.cpu_s for h in handlers}
        tracking = next((h.inner.tracker.stall_report() for h in handlers if isinstance(h.inner, MetricsToTracker)),
                        None)
        RunDir(run_dir).rank_done.write(RankDone(harness_cpu_s=cpu, tracking=tracking, node_rank=node,
                                                 startup=marks))


def await_run(rd: RunDir, poll_s: float = 0.02):
    """The run folder's run.json (RunState): node 0's launcher writes it once the MLflow run
    exists, which for a new run is while torchrun and the ranks start (stages/train.py), so a
    rank may come here first and wait. A launcher that fails to make the run stops the ranks;
    one that dies takes them with it (procs.die_with_parent)."""
    while (state := rd.run.read_or_none()) is None:
        time.sleep(poll_s)
    return state


def _cmdline(proc) -> list[str]:
    try:
        return proc.cmdline()
    except Exception:  # noqa: BLE001 — gone or not ours to read: not a worker to stop
        return ["resource_tracker"]


def exit_now(code: int) -> None:
    """Leave without the interpreter's teardown of torch, speculators, transformers and mlflow
    (about 4 s per rank on a loaded 2-core VM, after the work is done: a tail every run, ETA
    and plan would pay, and whose length varies with the load). atexit handlers (logging's and
    MLflow's flushes) still run; DataLoader workers, which the loader's finalizer would stop,
    are stopped here."""
    import atexit
    import signal

    try:
        atexit._run_exitfuncs()
        import psutil

        signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # torch's handler would call a stopped worker a failure
        # multiprocessing's resource tracker (it ignores SIGTERM) is left to exit by itself once
        # this process is gone, after it has cleaned up what the workers left in shared memory
        kids = [k for k in psutil.Process().children() if "resource_tracker" not in " ".join(_cmdline(k))]
        for kid in kids:
            kid.kill()  # a loader worker holds nothing to save
        psutil.wait_procs(kids, timeout=5)
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


if __name__ == "__main__":
    # run the module `draftlab.training.rank`, not this second copy named __main__: its classes
    # are then the ones other modules (and tests/integration/test_watch.py's hold) see
    from draftlab.training.rank import exit_now, main

    try:
        main(sys.argv[1:])
        exit_code = 0
    except SystemExit as done:
        exit_code = done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
        if isinstance(done.code, str):
            print(done.code, file=sys.stderr)
    exit_now(exit_code)
