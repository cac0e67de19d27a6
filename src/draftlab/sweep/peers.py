"""How a sweep worker notices the other workers of its study: its own liveness (the ledger
span, and on RDB storage Optuna's heartbeat of each trial it holds) and the death of others
(a dead worker's RUNNING trials end FAIL as interrupted, their processes on this host stopped,
their MLflow runs ended KILLED). draftlab.sweep.storage says which mechanism each storage has.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from draftlab.sweep.budget import Clock, Launcher, Ledger
from draftlab.sweep.storage import INTERRUPTED_ATTR, StudyStorage


class Peers:
    def __init__(self, study, ledger: Ledger, storage: StudyStorage | None, launcher: Launcher, clock: Clock, *,
                 worker_id: str, heartbeat_s: float, stale_after_s: float, log: Callable[[str], None]):
        self.study, self.ledger, self.storage, self.launcher, self.clock = study, ledger, storage, launcher, clock
        self.worker_id, self.heartbeat_s, self.stale_after_s, self.log = worker_id, heartbeat_s, stale_after_s, log
        self._beat_at = -1e18

    def recover(self) -> None:
        """RUNNING trials of dead workers (a killed predecessor of this one included): stop their
        processes, mark them failed. Done trials stay done. The ledger finds a dead worker by its
        pid (same host) or its silent span; on RDB storage Optuna's heartbeat also does."""
        from optuna.exceptions import UpdateFinishedTrialError
        from optuna.trial import TrialState

        for t in self.study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
            owner = t.user_attrs.get("worker")
            if not self.ledger.is_dead(owner):
                continue
            entry = self.ledger.workers().get(owner or "", {})
            run_id = self.reap(t, entry.get("host", t.user_attrs.get("host", "")))
            storage = self.study._storage
            try:
                if run_id and "run_id" not in t.user_attrs:
                    storage.set_trial_user_attr(t._trial_id, "run_id", run_id)
                storage.set_trial_user_attr(t._trial_id, "status", "interrupted")
                storage.set_trial_user_attr(t._trial_id, "reason", f"worker {owner} died (last heartbeat "
                                            f"{entry.get('last', 0):.0f}); not resumed")
                self.study.tell(t.number, state=TrialState.FAIL, skip_if_finished=True)
            except UpdateFinishedTrialError:  # another worker got there first
                continue
            self.log(f"trial {t.number}: interrupted (its worker is gone); marked failed")
        self.fail_stale()

    def reap(self, t, host: str) -> str | None:
        """Stop a dead worker's trial's processes (on this host) and end its MLflow run; its id."""
        if not t.user_attrs.get("trial_dir"):
            return None
        return self.launcher.reap(Path(t.user_attrs["trial_dir"]), t.user_attrs.get("pgids", []), host)

    def fail_stale(self) -> None:
        """Optuna's fail_stale_trials (RDB storage): a trial whose heartbeat is older than
        stale_after_s ends FAIL; the worker that failed it records why (its attributes are frozen
        by then) and stops its processes if they run on this host."""
        if self.storage is None:
            return

        def on_stale(t) -> None:
            owner = t.user_attrs.get("worker")
            run_id = self.reap(t, t.user_attrs.get("host", ""))
            self.study.set_user_attr(f"{INTERRUPTED_ATTR}{t.number}", {
                "reason": f"worker {owner} sent no heartbeat for {self.stale_after_s:g} s; not resumed",
                "by": self.worker_id, "run_id": t.user_attrs.get("run_id") or run_id})
            self.log(f"trial {t.number}: interrupted (worker {owner} stopped sending heartbeats); marked failed")

        self.storage.fail_stale(self.study, on_stale)

    def created(self, trial) -> None:
        """A trial this worker now holds: its first heartbeat at once (Optuna never takes a trial
        without one for stale)."""
        if self.storage is not None:
            self.storage.beat(self.study, [trial])

    def beat(self, held: list) -> None:
        """Each pass of the loop: the ledger span; every heartbeat_s, the held trials' heartbeats
        and the others' staleness (a worker whose slots are all busy takes no new trial, and must
        still notice a dead peer). A journal has no trial heartbeat: there the ledger decides."""
        self.ledger.beat()
        now = self.clock.now()
        if self.storage is None or now - self._beat_at < self.heartbeat_s:
            return
        self._beat_at = now
        if self.storage.rdb:
            self.storage.beat(self.study, held)
            self.fail_stale()
        else:
            self.recover()
