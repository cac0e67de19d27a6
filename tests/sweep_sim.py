"""A simulated machine for `draftlab sweep`'s worker: an injected clock and a launcher whose
trials take the durations the cost model would predict (start-up 20 s, 2 s per global step at 1
GPU, 2.2 s at 2, 3 s per epoch boundary; 40 packed rows per epoch sharded over the ranks). The
unit tests drive workers on a journal file with it, the PostgreSQL tests on a real server."""

from __future__ import annotations

import math
from pathlib import Path

import yaml

from draftlab.params import parse_params
from draftlab.sweep.budget import Outcome
from draftlab.sweep.loop import Worker
from draftlab.sweep.space import read_spec
from draftlab.sweep.study import open_storage, open_study
from draftlab.plan.sampler import steps_under_max_steps

GRACE = 10.0
POLL = 1.0


class FakeClock:
    def __init__(self, t: float = 1_000_000.0):
        self.t = t

    def now(self) -> float:
        return self.t

    def sleep(self, seconds: float) -> None:
        self.t += seconds


# The simulated machine: start-up 20 s, 2 s per global step at 1 GPU (2.2 s at 2: communication),
# 3 s per epoch boundary; 40 packed rows per epoch, sharded over the ranks.
FIXED, EPOCH_S = 20.0, 3.0
STEP_S = {1: 2.0, 2: 2.2}


def sim_steps(params) -> int:
    """What the trainer runs: 40 rows per epoch sharded, a calibration cut by max_steps as speculators cuts it."""
    per_epoch = [math.ceil(40 / params.train.gpus)] * params.train.epochs
    return sum(steps_under_max_steps(per_epoch, params.train.max_steps))


def sim_duration(params) -> float:
    n = params.train.gpus
    return FIXED + sim_steps(params) * STEP_S[n] + params.train.epochs * EPOCH_S


def sim_quality(params) -> float:  # more epochs help; lr best near 3e-3
    return 1 + 0.1 * params.train.epochs - 0.2 * abs(math.log10(params.train.lr / 3e-3))


class SimHandle:
    def __init__(self, launcher, spec, clock, duration, honors_sigterm):
        self.launcher, self.spec, self.clock = launcher, spec, clock
        self.start, self.duration, self.honors_sigterm = clock.now(), duration, honors_sigterm
        self.pgids = [10_000 + spec.number]
        self.terminated_at = self.killed_at = None

    def poll(self):
        now = self.clock.now()
        if self.killed_at is not None:
            return Outcome(False, None, self.killed_at - self.start, message="killed")
        if self.terminated_at is not None and self.honors_sigterm and now >= self.terminated_at + 2:
            return Outcome(False, None, now - self.start, message="stopped by the sweep (SIGTERM)")  # no run id: as the trial process
        if now - self.start >= self.duration:
            p = self.spec.params
            timing = {"steps": self.launcher.steps(p), "epochs": p.train.epochs, "step_s": STEP_S[p.train.gpus],
                      "epoch_s": EPOCH_S, "tokens_per_s": 1000.0 * p.train.gpus / STEP_S[p.train.gpus],
                      "wall_s": self.duration, "stable": self.launcher.settled(self.spec)}
            value = None if self.spec.role == "calibration" else sim_quality(p)  # as draftlab.sweep.trial reports
            return Outcome(True, value, self.duration, run_id=f"run{self.spec.number}", timing=timing)
        return None

    def run_id(self):  # the trial's MLflow run exists once its start-up is over
        return f"run{self.spec.number}" if self.clock.now() - self.start >= FIXED / 2 else None

    def intermediate(self):
        elapsed = self.clock.now() - self.start
        per_epoch = (self.duration - FIXED) / self.spec.params.train.epochs
        done = int(max(elapsed - FIXED / 2, 0) // per_epoch)
        return {e: self.launcher.epoch_value(self.spec.params, e) for e in range(min(done, self.spec.params.train.epochs))}

    def terminate(self):
        self.terminated_at = self.clock.now()

    def kill(self):
        if self.killed_at is None:
            self.killed_at = self.clock.now()


class SimLauncher:
    def __init__(self, clock, duration=sim_duration, honors_sigterm=True, epoch_value=None, settled=None,
                 steps=sim_steps):
        self.clock, self.duration, self.honors_sigterm, self.steps = clock, duration, honors_sigterm, steps
        self.settled = settled or (lambda spec: True)
        self.epoch_value = epoch_value or (lambda p, e: sim_quality(p) - 0.05 * (p.train.epochs - e))
        self.started: list = []  # (spec, start time, handle)
        self.reaped: list = []

    def start(self, spec):
        h = SimHandle(self, spec, self.clock, self.duration(spec.params), self.honors_sigterm)
        self.started.append((spec, self.clock.now(), h))
        return h

    def reap(self, trial_dir, pgids, host):
        self.reaped.append((Path(trial_dir).name, list(pgids), host))
        return f"run{int(Path(trial_dir).name.split('-')[1])}"

    def max_concurrent(self) -> int:
        events = sorted([(t, 1) for _, t, h in self.started] +
                        [(t + (h.killed_at or h.start + h.duration) - h.start, -1) for _, t, h in self.started],
                        key=lambda e: (e[0], e[1]))
        cur = best = 0
        for _, d in events:
            cur += d
            best = max(best, cur)
        return best


BASE = parse_params({"train": {"epochs": 2, "lr": 3e-3}})


def make_spec(tmp_path, **over):
    raw = {"study": "sim", "budget": 600, "stop_grace_s": GRACE, "safety_margin": 0.1,
           "pruner": {"kind": "none"}, "calibration": {"steps": 20, "max_s": 200},
           "space": {"train.epochs": {"low": 1, "high": 4}, "train.lr": {"low": 1e-3, "high": 1e-2, "log": True},
                     "train.gpus": {"choices": [1, 2]}}}
    raw.update(over)
    path = tmp_path / "space.yaml"
    path.write_text(yaml.safe_dump(raw))
    return read_spec(path)


def make_worker(tmp_path, spec, clock, launcher, *, devices=("cpu0", "cpu1"), host="hostA", pid=None,
                n_trials=None, journal="journal.log", storage_url=None, steps_fn=sim_steps, log=None):
    storage = open_storage(storage_url or str(tmp_path / journal), spec)
    study = open_study(spec, storage, BASE)
    return Worker(spec, BASE, study, launcher=launcher, clock=clock, devices=list(devices), out_dir=tmp_path / "sweep",
                  steps_fn=steps_fn, n_trials=n_trials, log=log or (lambda line: None), host=host, pid=pid,
                  storage=storage)


def run_to_end(worker, clock, limit=100_000):
    worker.start()
    for _ in range(limit):
        if worker.step():
            return worker.done_reason
        clock.sleep(POLL)
    raise AssertionError("the sweep did not end")


def run_side_by_side(workers, clock):
    """Step every worker each poll (as on separate hosts) until each says it is done."""
    done = {w: False for w in workers}
    while not all(done.values()):
        for w in workers:
            if not done[w]:
                done[w] = w.step()
        clock.sleep(POLL)


def dead_pid() -> int:
    """A pid no process has (a kill -9 victim's, as a peer sees it), found without starting one:
    the highest free pid, which the kernel hands out last."""
    pid = int(Path("/proc/sys/kernel/pid_max").read_text())
    while Path(f"/proc/{pid}").exists():
        pid -= 1
    return pid
