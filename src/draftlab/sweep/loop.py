"""One sweep worker (`Worker`) and the loop that drives it (`drive`): calibration queued first,
then propose → predict → reject or launch → watch (cap, budget, pruner) → tell. The package
docstring (draftlab.sweep) says what each state means for the budget; draftlab.sweep.propose
why a proposal becomes a trial of the study only when it is launched; draftlab.sweep.storage
how workers on one study share a lock and, on RDB storage, Optuna's heartbeat.

A worker never leaves a trial of its own RUNNING when it returns: whatever ends it (done, a
failed calibration, an exception, Ctrl-C), `drive` stops what still runs and tells the study.
"""

from __future__ import annotations

import json
import os
import socket
import uuid
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from draftlab.params import Params
from draftlab.plan.costmodel import CostModel, Point
from draftlab.sweep import calibration
from draftlab.sweep import propose as proposals
from draftlab.sweep.budget import Clock, Handle, Launcher, Ledger, Outcome, TrialSpec, point_from_outcome
from draftlab.sweep.peers import Peers
from draftlab.sweep.space import SweepSpec, trial_params
from draftlab.sweep.storage import StudyStorage

PARENT_RUN_ATTR = "draftlab.mlflow_parent_run_id"
INTERMEDIATE_EVERY_S = 5.0
MAX_CONSECUTIVE_REJECTIONS = 25
# added to the safety margin of a trial predicted from a calibration whose step time had not
# settled (too few steps to tell, or the calibration share of the budget spent): a wider
# margin, not another calibration
UNSETTLED_MARGIN = 0.25
QUEUE_DEPTH = 2  # proposals and popped calibrations waiting for slots: the head, and one that may backfill


# ---------------------------------------------------------------- one worker


@dataclass
class Running:
    trial: Any  # optuna.Trial
    spec: TrialSpec
    handle: Handle
    started: float
    deadline: float
    deadline_reason: str  # "cap" | "budget" | "calibration cap"
    predicted_s: float | None
    stopping: str | None = None
    stop_at: float = 0.0
    killed: bool = False
    reported: set[int] = field(default_factory=set)
    checked: float = 0.0


@dataclass
class Pending:
    trial: Any | None  # optuna.Trial once it is in the study: a popped (calibration, enqueued) trial
    values: dict[str, Any]
    params: Params
    role: str
    distributions: dict = field(default_factory=dict)  # a proposal's, for its trial at launch


class Worker:
    """One sweep worker: its device slots, its trials, its share of the study's budget.
    `step()` is one pass of the loop (the CLI calls it every second; tests drive it with a
    simulated clock); it returns True when this worker is done."""

    def __init__(self, spec: SweepSpec, base: Params, study, *, launcher: Launcher, clock: Clock,
                 devices: list[str], out_dir: Path, steps_fn: Callable[[Params], int],
                 n_trials: int | None = None, budget_s: float | None = None, log: Callable[[str], None] = print,
                 worker_id: str | None = None, host: str | None = None, pid: int | None = None,
                 storage: StudyStorage | None = None):
        self.spec, self.base, self.study = spec, base, study
        self.storage = storage
        self.launcher, self.clock, self.devices = launcher, clock, list(devices)
        self.out_dir, self.steps_fn, self.n_trials, self.log = out_dir, steps_fn, n_trials, log
        self.budget_s = budget_s if budget_s is not None else spec.budget_s
        self.cap_s = spec.trial_cap_s
        self.worker_id = worker_id or uuid.uuid4().hex[:12]
        self.host = host or socket.gethostname()
        self.ledger = Ledger(study, self.worker_id, clock, host=self.host, pid=pid or os.getpid(), devices=self.devices,
                             heartbeat_s=spec.heartbeat_s, stale_after_s=spec.stale_after_s)
        self.running: list[Running] = []
        self.queue: list[Pending] = []  # proposed or popped, not yet started; the head has priority
        self.rejected: list[dict] = []  # this worker's rejected proposals (draftlab.sweep.propose)
        self.peers = Peers(study, self.ledger, storage, launcher, clock, worker_id=self.worker_id,
                           heartbeat_s=spec.heartbeat_s, stale_after_s=spec.stale_after_s, log=log)
        self.closing: str | None = None
        self.done_reason: str | None = None
        self.rejections_in_a_row = 0
        self.spent = 0.0

    # -------------------------------------------------------- study state

    def calibration(self) -> dict[int, Point]:
        return calibration.points(self.study)

    def model(self) -> CostModel:
        return CostModel(self.calibration(), self.steps_fn)

    def _save_calibration(self, point: Point) -> None:
        with self._locked():  # one dict for all GPU counts: two workers must not write it at once
            calibration.save(self.study, point)

    def _locked(self):
        import contextlib

        return self.storage.lock(self.study.study_name) if self.storage else contextlib.nullcontext()

    def start(self) -> None:
        self.ledger.beat(force=True)
        self.peers.recover()
        with self._locked():  # two workers starting at once queue one calibration per GPU count
            calibration.enqueue(self.study, self.spec, self.base, len(self.devices), self.log)

    def _held(self) -> list:
        return [r.trial for r in self.running] + [p.trial for p in self.queue if p.trial is not None]

    def _trials_started(self) -> int:
        return sum(1 for t in self.study.get_trials(deepcopy=False) if t.user_attrs.get("status") not in (None, "rejected"))

    def _held_by_me(self) -> list:
        from optuna.trial import TrialState

        return [t for t in self.study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
                if t.user_attrs.get("worker") == self.worker_id]

    # -------------------------------------------------------- the loop

    def free_devices(self) -> list[str]:
        used = {d for r in self.running for d in r.spec.devices}
        return [d for d in self.devices if d not in used]

    def min_prediction(self, model: CostModel) -> float | None:
        lo, _ = self.spec.epochs_range(self.base)
        preds = []
        for n in self.spec.gpu_counts(self.base):
            values = {"train.epochs": lo} if "train.epochs" in self.spec.space else {}
            if "train.gpus" in self.spec.space:
                values["train.gpus"] = n
            p = model.predict(trial_params(self.base, values))
            if p is not None:
                preds.append(p.wall_s)
        return min(preds) if preds else None

    def step(self) -> bool:
        now = self.clock.now()
        self.peers.beat(self._held())
        self.spent = self.ledger.spent_s()
        remaining = self.budget_s - self.spent
        for r in list(self.running):
            self._watch(r, now)
        if self.closing is None:
            self._start_trials(remaining)
        else:
            self._drop_queue(f"not started: {self.closing}")
        if not self.running and not self.queue:
            if remaining <= 0:
                self.done_reason = f"budget spent ({self.spent:,.0f} of {self.budget_s:,.0f} s)"
            elif self.closing:
                self.done_reason = self.closing
        if self.done_reason:
            self.ledger.beat(force=True)
            return True
        return False

    def _watch(self, r: Running, now: float) -> None:
        out = r.handle.poll()
        if out is not None:
            self._finish(r, out)
            return
        if "run_id" not in r.trial.user_attrs and (run_id := r.handle.run_id()):
            r.trial.set_user_attr("run_id", run_id)  # as soon as it exists: a killed worker's trial has it too
        if r.stopping is None:
            if now >= r.deadline:
                self._stop(r, r.deadline_reason, now)
            elif r.spec.role == "search" and now - r.checked >= INTERMEDIATE_EVERY_S:
                r.checked = now
                for epoch, value in sorted(r.handle.intermediate().items()):
                    if epoch not in r.reported:
                        r.trial.report(value, epoch)
                        r.reported.add(epoch)
                # calibration trials are never pruned (their timing is the cost model); after the
                # last epoch only evaluation is left, so stopping would save nothing
                more_epochs = r.reported and max(r.reported) < r.spec.params.train.epochs - 1
                if r.spec.role == "search" and more_epochs and r.trial.should_prune():
                    self._stop(r, "pruned", now)
        elif not r.killed and now >= r.stop_at + self.spec.stop_grace_s:
            r.handle.kill()
            r.killed = True

    def _stop(self, r: Running, reason: str, now: float) -> None:
        r.stopping, r.stop_at = reason, now
        r.handle.terminate()
        self.log(f"trial {r.trial.number}: stopping ({reason}) after {now - r.started:,.0f} s; SIGTERM, "
                 f"SIGKILL after {self.spec.stop_grace_s:g} s")

    def _finish(self, r: Running, out: Outcome) -> None:
        from optuna.exceptions import UpdateFinishedTrialError

        self.running.remove(r)
        try:
            self._record(r, out)
        except UpdateFinishedTrialError:  # failed meanwhile by another worker (no heartbeat from here?)
            self.log(f"trial {r.trial.number}: already ended in the study (another worker took this one for "
                     "dead); its result is not recorded")

    def calibration_bound_s(self) -> float:
        """The most of the budget calibration may take (calibration.budget_share)."""
        return self.spec.calibration.budget_share * self.budget_s

    def calibration_spent_s(self) -> float:
        """Wall-clock of this study's calibration trials so far (finished ones and running ones)."""
        spent = sum(float(t.user_attrs.get("wall_s") or 0.0) for t in self.study.get_trials(deepcopy=False)
                    if t.user_attrs.get("role") == "calibration")
        return spent + sum(self.clock.now() - r.started for r in self.running if r.spec.role == "calibration")

    def _record(self, r: Running, out: Outcome) -> None:
        from optuna.trial import TrialState

        n = r.spec.params.train.gpus
        t = r.trial
        t.set_user_attr("wall_s", round(out.wall_s, 2))
        t.set_user_attr("gpu_hours", out.wall_s * n / 3600)
        run_id = out.run_id or r.handle.run_id()
        if run_id:
            t.set_user_attr("run_id", run_id)
        if r.stopping is not None:
            status = {"pruned": "pruned", "cap": "stopped-cap", "budget": "stopped-budget"}.get(r.stopping, "stopped-cap")
            t.set_user_attr("status", status)
            t.set_user_attr("reason", f"stopped ({r.stopping}) after {out.wall_s:,.0f} s"
                            + (f"; predicted {r.predicted_s:,.0f} s" if r.predicted_s else ""))
            self.study.tell(t, state=TrialState.PRUNED)
            self.log(f"trial {t.number}: {status} after {out.wall_s:,.0f} s")
            if r.spec.role == "calibration":  # no cost model at this count: start nothing more
                self.closing = (f"calibration at {n} GPU(s) did not finish within {r.deadline - r.started:,.0f} s; "
                                "raise calibration.max_s or the budget, or lower calibration.steps")
            return
        if out.convergence is not None and r.spec.role == "search":  # the watch stopped it: pruned at once
            left = f"; {r.predicted_s - out.wall_s:,.0f} s of its predicted {r.predicted_s:,.0f} s released" \
                if r.predicted_s else ""
            t.set_user_attr("status", "pruned")
            t.set_user_attr("reason", f"loss {out.convergence} (train.watch): stopped after {out.wall_s:,.0f} s{left}")
            self.study.tell(t, state=TrialState.PRUNED)
            self.log(f"trial {t.number}: pruned, loss {out.convergence} after {out.wall_s:,.0f} s{left}")
            return
        if not out.ok or (out.objective is None and r.spec.role != "calibration"):
            t.set_user_attr("status", "failed")
            t.set_user_attr("reason", out.message or "trial process failed")
            self.study.tell(t, state=TrialState.FAIL)
            self.log(f"trial {t.number}: failed: {out.message}")
            return
        if r.spec.role == "calibration":
            self._calibrated(r, out)
            return
        t.set_user_attr("status", "completed")
        self.rejections_in_a_row = 0
        self.study.tell(t, out.objective)
        pred = f" (predicted {r.predicted_s:,.0f} s)" if r.predicted_s else ""
        self.log(f"trial {t.number}: {self.spec.objective.metric} = {out.objective:.4f} in {out.wall_s:,.0f} s{pred}")

    def _calibrated(self, r: Running, out: Outcome) -> None:
        """A calibration is timing, not a trained draft: never told to the study as a completed
        trial with a value (FAIL: samplers and pruners ignore it); its point feeds the cost model.
        An unsettled step time asks for a calibration with twice the steps only when this one
        trained every step it asked for (a tiny epoch holds fewer: twice the steps would train
        the same ones) and the redo fits the calibration share of the budget; otherwise the
        point is used and the margin of what it predicts widens (UNSETTLED_MARGIN)."""
        from optuna.trial import TrialState

        n, t = r.spec.params.train.gpus, r.trial
        point = point_from_outcome(n, t.number, out)
        steps = r.spec.params.train.max_steps or 0
        trained = point.steps
        fits = self.calibration_spent_s() + 2 * out.wall_s <= self.calibration_bound_s()
        again = (not point.stable and trained >= steps and 2 * steps <= self.spec.calibration.max_steps and fits)
        t.set_user_attr("status", "calibration")
        t.set_user_attr("reason", f"timing only ({steps} steps): " + (
            f"step time not settled, calibrating again with {2 * steps}" if again else
            f"start-up {point.fixed_s:,.1f} s + {point.step_s:.3f} s/step + {point.epoch_s:.1f} s/epoch"))
        # the redo is queued, or the point saved, before this calibration ends: a peer that finds
        # no live calibration for this GPU count then finds its point (calibration.live, then points)
        if again:
            with self._locked():
                calibration.enqueue(self.study, self.spec, self.base, len(self.devices), self.log, n, 2 * steps)
                popped = self._pop()
            self.study.tell(t, state=TrialState.FAIL)
            if popped is not None:
                self.queue.insert(0, popped)  # ahead of the search trials that wait for it
            self.log(f"calibration at {n} GPU(s): step time still moving after {steps} steps; again with {2 * steps}")
            return
        self._save_calibration(point)
        self.study.tell(t, state=TrialState.FAIL)
        self.rejections_in_a_row = 0
        why = (f"the epochs hold only {trained} of the {steps} steps asked" if trained < steps else
               "a redo would pass the calibration share of the budget" if not fits else f"{steps} steps")
        settled = "" if point.stable else (f" (step time not settled: {why}; trials predicted from it get "
                                           f"+{UNSETTLED_MARGIN:g} safety margin)")
        self.log(f"calibration at {n} GPU(s): start-up {point.fixed_s:,.1f} s + {point.step_s:.3f} s/step + "
                 f"{point.epoch_s:.1f} s/epoch + evaluate {point.after_s or 0:,.1f} s; "
                 f"{point.tokens_per_s:,.0f} tokens/s{settled}")

    def _next(self) -> Pending:
        """A waiting (calibration or enqueued) trial of the study if there is one, else a proposal."""
        self.peers.fail_stale()  # before each new trial: a dead worker's trials end first
        with self._locked():
            popped = self._pop()
        if popped is not None:
            return popped
        queued = [(p.values, p.distributions) for p in self.queue if p.trial is None]
        values, distributions = proposals.propose(self.study, self.spec, self.base, self.rejected, queued)
        return Pending(None, values, trial_params(self.base, values), "search", distributions)

    def _pop(self) -> Pending | None:
        """`ask()` for a WAITING trial (under the study lock: no other worker pops it too)."""
        from optuna.trial import TrialState

        if not self.study.get_trials(deepcopy=False, states=(TrialState.WAITING,)):
            return None
        with warnings.catch_warnings():  # "heartbeat … supposed to be used with Study.optimize": see storage
            warnings.filterwarnings("ignore", "Heartbeat of storage", UserWarning)
            trial = self.study.ask()
        trial.set_user_attr("worker", self.worker_id)
        trial.set_user_attr("host", self.host)
        self.peers.created(trial)
        role = "calibration" if trial.user_attrs.get("role") == "calibration" else "search"
        values = proposals.suggest(trial, self.spec, self.base)
        run_values = values
        if role == "calibration":  # a step-limited training: one timed epoch boundary (draftlab.training.compat)
            steps = int(trial.user_attrs.get("calibration_steps") or self.spec.calibration.steps)
            run_values = calibration.run_values(values, steps)
        params = trial_params(self.base, run_values)
        if role == "search" and not params.train.watch.stop_on:  # a stalled or diverging trial ends at once
            params = trial_params(self.base, {**run_values, "train.watch.stop_on": ["stalled", "diverging"]})
        self._describe(trial, role, params)
        return Pending(trial, values, params, role)

    def _describe(self, trial, role: str, params: Params) -> None:
        trial.set_user_attr("role", role)
        trial.set_user_attr("gpus", params.train.gpus)
        trial.set_user_attr("resolved_lr", params.train.resolved_lr())

    def _reject(self, p: Pending, reason: str, predicted: float | None) -> None:
        """A proposal that does not fit is recorded for the report (and the proposals that
        follow), never as a trial; a popped trial that cannot start ends FAIL, never started."""
        from optuna.distributions import distribution_to_json
        from optuna.trial import TrialState

        self.rejections_in_a_row += 1
        if p.trial is None:
            self.rejected.append({"id": f"{self.worker_id}-{len(self.rejected)}", "values": p.values,
                                  "distributions": {k: distribution_to_json(d) for k, d in p.distributions.items()},
                                  "reason": reason, "predicted_s": None if predicted is None else round(predicted, 1),
                                  "gpus": p.params.train.gpus, "resolved_lr": p.params.train.resolved_lr(),
                                  "worker": self.worker_id, "at": self.clock.now()})
            self.study.set_user_attr(proposals.REJECTED_ATTR + self.worker_id, self.rejected)
            self.log(f"proposal {json.dumps(p.values)}: rejected before start: {reason}")
            return
        p.trial.set_user_attr("status", "rejected")
        p.trial.set_user_attr("reason", reason)
        if predicted is not None:
            p.trial.set_user_attr("predicted_s", round(predicted, 1))
        self.study.tell(p.trial, state=TrialState.FAIL)
        self.log(f"trial {p.trial.number}: rejected before start: {reason}")

    def _drop_queue(self, reason: str) -> None:
        """Closing: queued proposals are dropped; queued trials of the study end FAIL, never started."""
        from optuna.trial import TrialState

        for p in list(self.queue):
            self.queue.remove(p)
            if p.trial is not None:
                p.trial.set_user_attr("status", "not-started")
                p.trial.set_user_attr("reason", reason)
                self.study.tell(p.trial, state=TrialState.FAIL, skip_if_finished=True)

    def _start_trials(self, remaining: float) -> None:
        """Launch queued trials that fit, reject those that cannot, ask for more while slots are
        free. The queue's head keeps priority; a later trial may backfill free slots only if it is
        predicted to end before the head's slots free up (EASY backfilling), so it never delays it."""
        model = self.model()
        margin = 1 + self.spec.safety_margin
        for _ in range(MAX_CONSECUTIVE_REJECTIONS + 1):
            for p in list(self.queue):
                if not self.free_devices():
                    return
                if self._admit(p, model, remaining, margin, head=p is self.queue[0]) == "stop":
                    return
            if not self.free_devices() or len(self.queue) >= QUEUE_DEPTH:
                return
            if self.n_trials is not None and self._trials_started() + len(self.queue) >= self.n_trials:
                if not self.queue:
                    self.closing = f"{self.n_trials} trial(s) run"
                return
            if remaining <= 0:
                return
            floor = self.min_prediction(model)
            calibrating = len(model.points) < len([n for n in self.spec.gpu_counts(self.base) if n <= len(self.devices)])
            if floor is not None and not calibrating and floor * margin > remaining:
                if not self.queue:
                    self.closing = (f"nothing fits the remaining {remaining:,.0f} s (the cheapest trial is predicted "
                                    f"{floor:,.0f} s × {margin:g})")
                return
            if self.rejections_in_a_row >= MAX_CONSECUTIVE_REJECTIONS:
                if not self.queue:
                    self.closing = f"{self.rejections_in_a_row} proposals in a row did not fit the remaining budget"
                return
            self.queue.append(self._next())

    def _head_start_at(self, gpus: int) -> float:
        """When `gpus` slots will be free, from the running trials' predicted ends (caps if unknown)."""
        free = len(self.free_devices())
        if free >= gpus:
            return self.clock.now()
        for end, n in sorted((r.started + r.predicted_s if r.predicted_s else r.deadline, len(r.spec.devices))
                             for r in self.running):
            free += n
            if free >= gpus:
                return end
        return float("inf")

    def _admit(self, p: Pending, model: CostModel, remaining: float, margin: float, *, head: bool) -> str:
        """Reject, launch, or leave `p` queued: "rejected" | "launched" | "wait" | "stop"."""
        n = p.params.train.gpus
        free = self.free_devices()
        if p.role == "calibration":
            predicted, cap, why = None, min(self.spec.calibration.max_s, remaining), "calibration cap"
        else:
            pred = model.predict(p.params)
            if pred is None:  # its calibration runs here or on another worker: wait for it
                # live first, then the points read again: a peer's calibration that ended since
                # `model` was built has saved its point before it ended
                if not self.running and not calibration.live(self.study) and not self.calibration():
                    self._wait_for_calibration(p)
                return "stop"
            predicted = pred.wall_s
            if not pred.point.stable:
                margin += UNSETTLED_MARGIN
            cap, why = (self.cap_s, "cap") if self.cap_s is not None and self.cap_s < remaining else (remaining, "budget")
            if predicted * margin > cap:
                self.queue.remove(p)
                self._reject(p, f"predicted {predicted:,.0f} s × {margin:g} does not fit the {why} "
                             f"({cap:,.0f} s left)" if why == "budget" else
                             f"predicted {predicted:,.0f} s × {margin:g} exceeds the per-trial cap {cap:,.0f} s",
                             predicted)
                return "rejected"
        if n > len(free):
            return "wait"
        if not head:
            first = self.queue[0]
            ends = self.clock.now() + (predicted * margin if predicted is not None else cap)
            if ends > self._head_start_at(first.params.train.gpus):
                return "wait"
        self.queue.remove(p)
        self._launch(p, free[:n], predicted, cap, why)
        return "launched"

    def _wait_for_calibration(self, p: Pending) -> None:
        self.closing = "no calibration available (another worker's calibration failed?); rerun to calibrate"
        self.queue.remove(p)
        self._reject(p, "no calibration for its GPU count", None)

    def _launch(self, p: Pending, devices: list[str], predicted: float | None, cap: float, why: str) -> None:
        now = self.clock.now()
        if p.trial is None:  # a proposal becomes a trial of the study now: RUNNING from its launch
            p.trial = proposals.create_running(self.study, p.values, p.distributions,
                                               {"worker": self.worker_id, "host": self.host})
            self.peers.created(p.trial)
            self._describe(p.trial, p.role, p.params)
        trial_dir = self.out_dir / f"trial-{p.trial.number:04d}"
        spec = TrialSpec(p.trial.number, p.values, p.params, devices, p.role, trial_dir)
        p.trial.set_user_attr("trial_dir", str(trial_dir))
        p.trial.set_user_attr("devices", devices)
        if predicted is not None:
            p.trial.set_user_attr("predicted_s", round(predicted, 1))
        handle = self.launcher.start(spec)
        p.trial.set_user_attr("pgids", list(handle.pgids))
        p.trial.set_user_attr("status", "running")
        self.running.append(Running(p.trial, spec, handle, now, now + cap, why, predicted))
        pred = f"predicted {predicted:,.0f} s, " if predicted is not None else ""
        self.log(f"trial {p.trial.number} ({p.role}) on {devices}: {json.dumps(p.values)}; lr resolved "
                 f"{p.params.train.resolved_lr():.3g}; {pred}stopped if still running at {cap:,.0f} s ({why})")

    def close(self, reason: str = "the sweep was interrupted") -> None:
        """Leave no trial of this worker RUNNING: stop what still runs (SIGKILL: an interrupted
        sweep must not wait for a grace) and fail it, end queued trials as never started."""
        from optuna.exceptions import UpdateFinishedTrialError
        from optuna.trial import TrialState

        for r in list(self.running):
            r.handle.kill()
            self.running.remove(r)
            try:
                if run_id := r.handle.run_id():
                    r.trial.set_user_attr("run_id", run_id)
                r.trial.set_user_attr("status", "interrupted")
                r.trial.set_user_attr("reason", reason)
                self.study.tell(r.trial, state=TrialState.FAIL, skip_if_finished=True)
            except UpdateFinishedTrialError:
                pass
        self._drop_queue(f"not started: {reason}")
        for t in self._held_by_me():  # a trial made but never tracked (an error between the two)
            try:
                self.study._storage.set_trial_user_attr(t._trial_id, "status", "interrupted")
                self.study._storage.set_trial_user_attr(t._trial_id, "reason", reason)
                self.study.tell(t.number, state=TrialState.FAIL, skip_if_finished=True)
            except UpdateFinishedTrialError:
                pass
        self.ledger.beat(force=True)


def drive(worker: Worker, poll_s: float = 1.0, on_tick: Callable[[Worker], None] | None = None) -> str:
    """Run a worker to the end; returns why it ended. Nothing of this worker stays RUNNING."""
    worker.start()
    reason = "the sweep was interrupted"
    try:
        while not worker.step():
            if on_tick:
                on_tick(worker)
            worker.clock.sleep(poll_s)
        reason = worker.done_reason or "done"
    finally:
        worker.close(reason)
    return reason
