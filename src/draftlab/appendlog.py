"""Append-only JSON-lines files that a kill -9 or a full disk may leave ending in a partial line.

Every such file draftlab keeps (the store's journal, the tracking spool, the ranks' sample and
profile records) is written one whole line at a time, and a line without its newline is a write
that did not finish. The writer trims it before it appends (`append`), so a later record never
lands after garbage; the reader ignores it (`complete_lines`). Nothing complete is ever dropped.

    append(path, {"epoch": 0, "ids": [1, 2]})
    steps = Appender(path); steps.append({"step": 0}); steps.append({"step": 1})   # one writer, kept open
    records = [json.loads(line) for line in complete_lines(path)]
"""

from __future__ import annotations

import json
import os
from pathlib import Path

_TAIL = 1 << 16  # read backwards this much at a time to find the last newline


def trim_partial_line(path: Path) -> int:
    """Cut a last line that has no newline (a write a kill or a full disk cut short).
    Returns the bytes removed (0 when the file is whole or absent)."""
    try:
        f = open(path, "r+b")
    except FileNotFoundError:
        return 0
    with f:
        size = f.seek(0, os.SEEK_END)
        if size == 0:
            return 0
        f.seek(size - 1)
        if f.read(1) == b"\n":
            return 0
        end = size
        while end > 0:
            start = max(0, end - _TAIL)
            f.seek(start)
            block = f.read(end - start)
            if (nl := block.rfind(b"\n")) >= 0:
                keep = start + nl + 1
                break
            end = start
        else:
            keep = 0
        f.truncate(keep)
        f.flush()
        os.fsync(f.fileno())
        return size - keep


def append(path: Path, record: dict, *, sync: bool = False) -> None:
    """One JSON line at the end of `path`, after trimming a partial last line. `sync`: fsync it
    (a record that says work is done, like the journal's, must survive a power cut)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    trim_partial_line(path)
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()
        if sync:
            os.fsync(f.fileno())


class Appender:
    """`append` for a file one process writes a line to again and again (a rank's step records):
    the file stays open, and a partial last line is trimmed when it opens and after a write that
    failed, not before every line (two opens and a read per line: the step profile recorder took
    0.25 ms of a rank's step with them, 0.09 without). Nothing else may write the file while it
    is open."""

    def __init__(self, path: Path):
        self.path, self.file = Path(path), None

    def open(self) -> None:
        """Open it now (else the first write does), trimming a line a killed writer tore."""
        if self.file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            trim_partial_line(self.path)  # a line torn by a kill, or by a failed write of ours
            self.file = open(self.path, "a")  # noqa: SIM115 — kept open until close()

    def append(self, record: dict) -> None:
        self.write(json.dumps(record) + "\n")

    def write(self, lines: str) -> None:
        """Whole lines (each ending in a newline), flushed to the OS (`sync()`: to the disk)."""
        self.open()
        try:
            self.file.write(lines)
            self.file.flush()
        except BaseException:
            self._drop()  # a write cut short (a full disk): the next one reopens and trims what it left
            raise

    def sync(self) -> None:
        if self.file is not None:
            os.fsync(self.file.fileno())

    def _drop(self) -> None:
        file, self.file = self.file, None
        try:
            file.close()
        except OSError:  # its buffer cannot reach the disk either: trimmed at the next open
            pass

    def close(self) -> None:
        if self.file is not None:
            file, self.file = self.file, None
            file.close()


def complete_lines(text_or_path) -> list[str]:
    """The lines of a file (or its text) that ended with a newline: a partial last one is left out."""
    text = Path(text_or_path).read_text() if isinstance(text_or_path, Path) else text_or_path
    lines = text.split("\n")
    return lines[:-1]  # the piece after the last newline: empty, or a write that did not finish
