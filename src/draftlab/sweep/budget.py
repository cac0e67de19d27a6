"""What a sweep measures time, trials and budget with: the injectable clock and trial
interfaces, the calibrated cost model, and the ledger of spent budget shared by all workers of a
study (draftlab.sweep.loop uses them). The cost model itself is draftlab.plan.costmodel, shared with
`draftlab plan` and the training ETA.

Spent budget is the wall-clock during which at least one worker of the study was alive: each
worker keeps its own [start, last heartbeat] span in the study's user attributes, and spent is
the *union* of the spans. A second worker on the same storage therefore shares the budget
(neither counts the other's time twice), and a kill -9 stops the clock at the last heartbeat.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Protocol, Sequence

from draftlab import procs
from draftlab.params import Params
from draftlab.plan.costmodel import Point

WORKER_ATTR = "draftlab.worker."  # + worker id → {"host", "pid", "start", "last", "devices"}
HEARTBEAT_S = 5  # seconds between a worker's heartbeats (its span here; on RDB, its trials' too)
STALE_AFTER_S = 30  # a worker, and on RDB a trial, silent for this long is taken for dead


# ---------------------------------------------------------------- time and trials, injectable


class Clock(Protocol):
    def now(self) -> float: ...
    def sleep(self, seconds: float) -> None: ...


class SystemClock:
    def now(self) -> float:
        return time.time()

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)


@dataclass(frozen=True)
class TrialSpec:
    number: int
    values: dict[str, Any]  # the sampled dotted keys
    params: Params  # base params with the values merged in
    devices: list[str]
    role: str  # "calibration" | "search"
    trial_dir: Path


@dataclass(frozen=True)
class Outcome:
    ok: bool
    objective: float | None
    wall_s: float
    run_id: str | None = None
    message: str = ""
    timing: dict | None = None  # costmodel.step_timing of the trial's training (its timing/* metrics)
    convergence: str | None = None  # the convergence watch stopped its training: diverged, stalled, diverging


class Handle(Protocol):
    pgids: list[int]

    def poll(self) -> Outcome | None: ...
    def run_id(self) -> str | None: ...  # the trial's MLflow run, once it has one
    def intermediate(self) -> dict[int, float]: ...
    def terminate(self) -> None: ...
    def kill(self) -> None: ...


class Launcher(Protocol):
    def start(self, spec: TrialSpec) -> Handle: ...
    def reap(self, trial_dir: Path, pgids: Sequence[int], host: str) -> str | None: ...  # its run id


# ---------------------------------------------------------------- the cost model (draftlab.plan.costmodel)


def point_from_outcome(gpus: int, trial: int, out: Outcome) -> Point:
    """A calibration trial's point: its training's timing; evaluate and the trial process's
    own start-up are what the trial's wall-clock adds to the training's."""
    timing = out.timing or {}
    return Point.from_timing(gpus, timing, trial=trial, after_s=max(out.wall_s - float(timing["wall_s"]), 0.0))


def steps_from_lengths(lengths: Sequence[int]) -> Callable[[Params], int]:
    """Global steps of a trial: speculators' packing sampler over the train split's lengths at
    the trial's world size (plan_steps.plan_from_lengths: epoch 0 × epochs, as `plan` tables do)."""
    from draftlab.plan import steps as plan_steps

    cache: dict[tuple, int] = {}

    def steps(params: Params) -> int:
        t = params.train
        key = (t.world_size(), t.total_seq_len, t.seed)
        if key not in cache:
            cache[key] = plan_steps.plan_from_lengths(lengths, total_seq_len=t.total_seq_len, world_size=t.world_size(),
                                                      epochs=1, seed=t.seed, exact=False).central_total_steps
        return cache[key] * t.epochs

    return steps


# ---------------------------------------------------------------- the shared budget


def union_s(spans: Sequence[tuple[float, float]]) -> float:
    """Length of the union of [start, end] intervals."""
    total, cur_start, cur_end = 0.0, None, None
    for start, end in sorted(spans):
        if cur_end is None or start > cur_end:
            if cur_end is not None:
                total += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    if cur_end is not None:
        total += cur_end - cur_start
    return total


class Ledger:
    """This worker's span in the study, and the spent budget over all workers' spans."""

    def __init__(self, study, worker_id: str, clock: Clock, *, host: str, pid: int, devices: list[str],
                 heartbeat_s: float = HEARTBEAT_S, stale_after_s: float = STALE_AFTER_S):
        self.study, self.worker_id, self.clock = study, worker_id, clock
        self.heartbeat_s, self.stale_after_s = heartbeat_s, stale_after_s
        self.entry = {"host": host, "pid": pid, "start": clock.now(), "last": clock.now(), "devices": devices}
        self._others: dict[str, dict] = {}
        self._written = -1e18
        self._read = -1e18

    def beat(self, force: bool = False) -> None:
        now = self.clock.now()
        self.entry["last"] = now
        if force or now - self._written >= self.heartbeat_s:
            self.study.set_user_attr(WORKER_ATTR + self.worker_id, dict(self.entry))
            self._written = now

    def workers(self, refresh: bool = False) -> dict[str, dict]:
        now = self.clock.now()
        if refresh or now - self._read >= self.heartbeat_s:
            attrs = self.study.user_attrs
            self._others = {k[len(WORKER_ATTR):]: v for k, v in attrs.items()
                            if k.startswith(WORKER_ATTR) and k[len(WORKER_ATTR):] != self.worker_id}
            self._read = now
        return self._others

    def spent_s(self) -> float:
        spans = [(w["start"], w["last"]) for w in self.workers().values()]
        spans.append((self.entry["start"], self.clock.now()))
        return union_s(spans)

    def end(self) -> None:
        """This worker is done: its span ends here, and the others know it did not die."""
        self.entry["ended"] = True
        self.beat(force=True)

    def others_running(self) -> bool:
        """Another worker of the study has neither ended nor died (it still writes to the parent run)."""
        return any(not w.get("ended") and not self.is_dead(wid) for wid, w in self.workers(refresh=True).items())

    def is_dead(self, worker_id: str | None) -> bool:
        if worker_id == self.worker_id:
            return False
        entry = self.workers(refresh=True).get(worker_id or "")
        if entry is None:
            return True
        if entry["host"] == self.entry["host"] and procs.gone(entry["pid"]):
            return True
        return self.clock.now() - entry["last"] > self.stale_after_s
