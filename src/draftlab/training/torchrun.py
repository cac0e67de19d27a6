"""torch's elastic launcher (`torch.distributed.run`, flags unchanged) that leaves without the
interpreter's teardown once its ranks are done.

    python -m draftlab.training.torchrun --standalone --nproc-per-node 2 -m draftlab.training.rank …

Tearing down an interpreter that imported torch took about a second on a loaded 2-core VM: time
after the last step that every training's tail, ETA and plan pay. The launcher's own work
(rendezvous shutdown, exit barrier, error records) is inside `torch.distributed.run.main` and
runs as before; only the teardown of loaded modules is skipped (atexit handlers still run).

torch's elastic agent makes a log folder for every launch with `tempfile.mkdtemp(prefix="torchelastic_")`
and never removes it: one empty tree in /tmp per training, per sweep trial. Here that folder is made
inside one of this process's own (`draftlab-torchrun-<pid>-…`), removed when torchrun returns; the
next launch on the host removes those of launchers that are gone (kill -9).

A rank that stopped the run for a reason it wrote down (the run folder's failure.json: a NaN
loss, a bad hidden-state file) already said why in one line: the elastic launcher's error report
and traceback for it are not shown, and this process exits with that rank's code.
"""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import sys
import tempfile

from draftlab import procs
from draftlab.rundir import RunDir


class _SaidWhy(logging.Filter):
    """Drops the elastic launcher's records once a rank has written the run's failure record."""

    def __init__(self):
        super().__init__()
        run_dir = os.environ.get("DRAFTLAB_RUN_DIR")
        self.failure = RunDir(run_dir).failure.path if run_dir else None

    def said(self) -> bool:
        return self.failure is not None and self.failure.is_file()

    def filter(self, record) -> bool:
        return record.levelno < logging.WARNING or not self.said()


SCRATCH_PREFIX = "draftlab-torchrun-"


def _reap_scratch(tmp: str) -> None:
    """Remove the scratch folders of launchers whose process is gone (one killed with -9 could not)."""
    try:
        names = os.listdir(tmp)
    except OSError:
        return
    for name in names:
        pid = name[len(SCRATCH_PREFIX):].split("-", 1)[0] if name.startswith(SCRATCH_PREFIX) else ""
        if pid.isdigit() and procs.gone(int(pid)):  # a live pid (reused or not) keeps its folder
            shutil.rmtree(os.path.join(tmp, name), ignore_errors=True)  # another user's stays: not ours to remove


def main() -> None:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    said = _SaidWhy()
    for name in ("torch.distributed.elastic.multiprocessing.api", "torch.distributed.elastic.agent.server.api",
                 "torch.distributed.elastic.multiprocessing.errors", "torch.distributed.run"):
        logging.getLogger(name).addFilter(said)
    _reap_scratch(tempfile.gettempdir())
    scratch = tempfile.mkdtemp(prefix=f"{SCRATCH_PREFIX}{os.getpid()}-")
    tempfile.tempdir = scratch  # where the agent's mkdtemp puts its torchelastic_* folder
    try:
        torchrun()
        code = 0
    except SystemExit as done:
        code = done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
    except ChildFailedError as err:
        if not said.said():
            raise
        code = err.get_first_failure()[1].exitcode or 1
    finally:
        tempfile.tempdir = None
        shutil.rmtree(scratch, ignore_errors=True)
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
