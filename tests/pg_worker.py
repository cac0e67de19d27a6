"""A sweep worker as a process of its own, on a real storage, with a launcher whose trials are
real processes held by the test: `python -m tests.pg_worker SPACE OUT --worker-id A …`.

Each trial is a `sleep` in a session of its own (so, like torchrun's ranks, it outlives a
SIGKILLed worker unless someone stops it). A calibration ends at once with a made-up timing; a
search trial runs until the test creates `OUT/release`, then ends with a value from its params.
What the tests assert is the order of events they cause, never how fast anything ran.

    --start-only   open the study and do what a starting worker does (recover, queue the
                   calibration), then exit: for two workers started at the same moment
    --at T         wait until unix time T first (the two processes start together)
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from draftlab.sweep.budget import Outcome, SystemClock

TIMING = {"steps": 21, "epochs": 2, "step_s": 0.05, "epoch_s": 0.05, "tokens_per_s": 1000.0, "wall_s": 1.2,
          "stable": True}


class HeldTrial:
    def __init__(self, spec, release: Path):
        self.spec, self.release = spec, release
        self.proc = subprocess.Popen(["sleep", "600"], start_new_session=True)
        self.pgids = [self.proc.pid]
        with open(release.parent / "trial-pgids", "a") as f:  # for the test's clean-up, whatever happens
            f.write(f"{self.proc.pid}\n")
        self.started = time.time()

    def poll(self):
        if self.proc.poll() is not None:  # stopped by the worker (SIGTERM/SIGKILL to its group)
            return Outcome(False, None, time.time() - self.started, message="stopped")
        if self.spec.role == "search" and not self.release.exists():
            return None
        self.kill()
        self.proc.wait()
        p = self.spec.params.train
        value = None if self.spec.role == "calibration" else 1 + 0.1 * p.epochs - abs(p.lr - 3e-3)
        return Outcome(True, value, 1.5, run_id=f"run-{self.spec.number}", timing=TIMING)

    def run_id(self):
        return f"run-{self.spec.number}"

    def intermediate(self):
        return {}

    def terminate(self):
        self._signal(signal.SIGTERM)

    def kill(self):
        self._signal(signal.SIGKILL)

    def _signal(self, sig):
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass


class HeldLauncher:
    def __init__(self, release: Path):
        self.release = release

    def start(self, spec):
        spec.trial_dir.mkdir(parents=True, exist_ok=True)
        return HeldTrial(spec, self.release)

    def reap(self, trial_dir, pgids, host):
        import socket

        if host == socket.gethostname():
            for pgid in pgids:
                try:
                    os.killpg(pgid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        return f"run-{int(Path(trial_dir).name.split('-')[1])}"


def main(argv=None) -> int:
    from draftlab.params import parse_params
    from draftlab.sweep.loop import Worker, drive
    from draftlab.sweep.space import read_spec
    from draftlab.sweep.study import open_storage, open_study

    ap = argparse.ArgumentParser()
    ap.add_argument("space", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--worker-id", required=True)
    ap.add_argument("--n-trials", type=int)
    ap.add_argument("--at", type=float)
    ap.add_argument("--start-only", action="store_true")
    a = ap.parse_args(argv)
    spec = read_spec(a.space)
    base = parse_params({"train": {"epochs": 2, "lr": 3e-3}})
    storage = open_storage(spec.storage, spec)
    study = open_study(spec, storage, base)
    study.user_attrs  # noqa: B018 — connected: what is left after the wait is the worker's own start
    if a.at:
        time.sleep(max(a.at - time.time(), 0))
    worker = Worker(spec, base, study, launcher=HeldLauncher(a.out / "release"), clock=SystemClock(),
                    devices=["cpu0"], out_dir=a.out, steps_fn=lambda p: 21 * p.train.epochs, n_trials=a.n_trials,
                    worker_id=a.worker_id, storage=storage, log=lambda line: print(line, flush=True))
    if a.start_only:
        worker.start()
        return 0
    print("ended:", drive(worker, poll_s=0.2), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
