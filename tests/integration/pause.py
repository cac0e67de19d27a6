"""Stop a draftlab process in the middle of its work at a point the test names, so that a kill -9
lands there whatever the machine's speed: a `sitecustomize` on the process's PYTHONPATH makes the
extraction launcher sleep for good right after journaling its Nth batch, and says so in a file."""

from __future__ import annotations

import os
import time
from pathlib import Path

SITECUSTOMIZE = '''
import os
import time
from pathlib import Path

import draftlab.store.layout as _store

_stock, _seen = _store.Journal.record, []


def record(self, files):
    _stock(self, files)
    _seen.append(len(files))
    if len(_seen) == int(os.environ["PAUSE_AFTER_BATCHES"]):
        Path(os.environ["PAUSED_FILE"]).write_text(str(os.getpid()))
        while True:
            time.sleep(60)


_store.Journal.record = record
'''


def paused_after(tmp_path: Path, batches: int) -> tuple[dict[str, str], Path]:
    """(env for the process, the file that appears once it has stopped after `batches` batches)."""
    site = tmp_path / "pause-site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    marker = tmp_path / "paused"
    env = dict(os.environ, PAUSE_AFTER_BATCHES=str(batches), PAUSED_FILE=str(marker),
               PYTHONPATH=os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH")) if p))
    return env, marker


def wait_paused(proc, marker: Path, timeout_s: float = 300) -> None:
    """Until the process has stopped at its pause (fails if it ends first or never gets there)."""
    deadline = time.monotonic() + timeout_s
    while not marker.exists():
        assert proc.poll() is None, f"the process ended before its pause: {proc.stderr.read()[-2000:]}"
        assert time.monotonic() < deadline, "the process never reached its pause"
        time.sleep(0.05)
