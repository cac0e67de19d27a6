"""Where a study lives, and what keeps several workers on it from stepping on each other.

    null / a path          a JournalStorage file (default): any number of workers on one host
    postgresql://u:p@h/db  RDBStorage (SQLAlchemy 2.1 opens it with psycopg 3; psycopg2 with
                           postgresql+psycopg2://; both are in the lock): workers on several hosts
    sqlite:///path         RDBStorage on one host (locks under many writers: prefer the journal)

Two mechanisms, both in the database so that they hold across hosts:

  lock       `StudyStorage.lock()` serialises the few read-then-write steps of a study: queueing
             the calibration trials, popping one, creating the parent MLflow run. PostgreSQL:
             a session-level advisory lock (`pg_advisory_lock(hashtext('draftlab:<study>'))`) on
             a connection of its own; a journal or sqlite file: `flock` on `<file>.draftlab-lock`.
  heartbeat  on RDB storage, Optuna's own trial heartbeat (`heartbeat_interval`, `grace_period`):
             its thread runs only inside `Study.optimize`, and a sweep worker uses ask/tell, so
             the worker calls `record_heartbeat` for the trials it holds every `heartbeat_s`,
             and `optuna.storages.fail_stale_trials` before it takes a new trial; a trial whose
             heartbeat is older than `stale_after_s` (database time, so host clocks do not
             matter) ends FAIL, and the worker that failed it records why
             (`draftlab.interrupted.<number>` in the study) and stops its processes if they
             run on its host. JournalStorage has no heartbeat: there, a dead worker is found by
             its span in the ledger (draftlab.sweep.budget) and its pid.

A journal's own append lock is `flock` on `<file>.append-lock` (`JournalAppendLock`), not
Optuna's default symlink `<file>.lock`: the kernel drops a flock when its holder dies, where a
symlink left by a worker killed mid-append stays. Optuna forces a stale symlink after 30 s by the
mtime of the file it points at, and its link holds the path as given: a relative path in a
subfolder (`--out sweeps`) dangles from the link's own folder, the mtime is never read, and
every later worker spins on it for good (Optuna 5.0.0, `JournalFileSymlinkLock.acquire`).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import warnings
from pathlib import Path
from typing import Callable, Iterator

from draftlab import redact
from draftlab.sweep.budget import HEARTBEAT_S, STALE_AFTER_S
from draftlab.sweep.space import SpaceError

INTERRUPTED_ATTR = "draftlab.interrupted."  # + trial number → {"reason", "by"} (a FAIL trial's attrs are frozen)


class JournalAppendLock:
    """The lock Optuna's `JournalFileBackend` takes around each append (`acquire`/`release`, its
    `lock_obj`): an exclusive `flock` on `<journal>.append-lock`, held by an open descriptor, so it
    ends with its holder however that holder ends. Separate from the study-wide lock, which is
    held across Optuna writes."""

    def __init__(self, journal_path: str | os.PathLike):
        self.path = os.path.abspath(f"{os.fspath(journal_path)}.append-lock")
        self._fd: int | None = None

    def acquire(self) -> bool:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        return True

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is None:
            raise RuntimeError(f"{self.path}: released without being held")
        os.close(fd)  # closing the descriptor drops the flock


def journal(path: str | os.PathLike):
    """An Optuna JournalStorage on the file `path` (absolute, so a later chdir cannot move it),
    appended under `JournalAppendLock`. Every draftlab process that writes a journal opens it here."""
    import optuna
    from optuna.storages.journal import JournalFileBackend

    path = os.path.abspath(os.fspath(path))
    return optuna.storages.JournalStorage(JournalFileBackend(path, lock_obj=JournalAppendLock(path)))


class StudyStorage:
    """An Optuna storage plus the study-wide lock and, on RDB storage, the trial heartbeat."""

    def __init__(self, url: str, *, heartbeat_s: int = HEARTBEAT_S, stale_after_s: int = STALE_AFTER_S):
        import optuna

        self.url, self.heartbeat_s, self.stale_after_s = url, heartbeat_s, stale_after_s
        self._on_stale: Callable | None = None
        self.rdb = "://" in url
        if not self.rdb:
            Path(url).parent.mkdir(parents=True, exist_ok=True)
            self.optuna = journal(url)
            self._lock_path: Path | None = Path(url + ".draftlab-lock")
            return
        scheme = url.split("://", 1)[0].split("+", 1)[0]
        if scheme not in ("postgresql", "sqlite"):
            raise SpaceError(f"storage: {scheme}:// is not supported; use postgresql://… (several hosts), "
                             "sqlite:///… or a journal file path")
        try:
            with warnings.catch_warnings():  # heartbeat_interval is "experimental" since Optuna 2.9
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                self.optuna = optuna.storages.RDBStorage(
                    url, engine_kwargs={"pool_pre_ping": True}, heartbeat_interval=heartbeat_s,
                    grace_period=stale_after_s, heartbeat_stale_trial_callback=self._stale)
        except Exception as err:  # noqa: BLE001 — unreachable database, missing driver: one line
            reason = redact.text(str(err).strip().splitlines()[0], url)
            raise SpaceError(f"storage: cannot open {redact.url(url)!r} ({type(err).__name__}: {reason})") from None
        self._lock_path = Path(self.optuna.engine.url.database + ".draftlab-lock") if scheme == "sqlite" else None

    # -------------------------------------------------------- the study-wide lock

    @contextlib.contextmanager
    def lock(self, study_name: str) -> Iterator[None]:
        if self._lock_path is not None:
            with open(self._lock_path, "a") as f:
                fcntl.flock(f, fcntl.LOCK_EX)
                try:
                    yield
                finally:
                    fcntl.flock(f, fcntl.LOCK_UN)
            return
        import sqlalchemy

        key = f"draftlab:{study_name}"
        with self.optuna.engine.connect() as conn:
            conn.execute(sqlalchemy.text("SELECT pg_advisory_lock(hashtext(:k))"), {"k": key})
            conn.commit()
            try:
                yield
            finally:
                conn.execute(sqlalchemy.text("SELECT pg_advisory_unlock(hashtext(:k))"), {"k": key})
                conn.commit()

    # -------------------------------------------------------- Optuna's heartbeat (RDB only)

    def beat(self, study, trials) -> None:
        """Record a heartbeat for each trial this worker holds (a trial without one is never stale)."""
        if not self.rdb:
            return
        for trial in trials:
            study._storage.record_heartbeat(trial._trial_id)

    def fail_stale(self, study, on_stale: Callable) -> None:
        """Optuna's `fail_stale_trials`; `on_stale(frozen_trial)` for each trial this call failed."""
        if not self.rdb:
            return
        import optuna

        self._on_stale = on_stale
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                optuna.storages.fail_stale_trials(study)
        finally:
            self._on_stale = None

    def _stale(self, study, trial) -> None:  # RDBStorage's heartbeat_stale_trial_callback
        if self._on_stale is not None:
            self._on_stale(trial)


def interrupted(study) -> dict[int, dict]:
    """Trial number → why it was interrupted, for trials failed by a stale heartbeat."""
    return {int(k[len(INTERRUPTED_ATTR):]): v for k, v in study.user_attrs.items() if k.startswith(INTERRUPTED_ATTR)}
