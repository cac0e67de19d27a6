"""Small filesystem helpers: atomic writes so a kill -9 never leaves a half-written output
that later counts as done, and hashing."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Iterator


def write_bytes_atomic(path: Path, data: bytes) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        tmp.unlink(missing_ok=True)  # a full disk: the space the partial file took goes back at once
        raise
    os.replace(tmp, path)


def write_json_atomic(path: Path, obj) -> None:
    write_bytes_atomic(Path(path), (json.dumps(obj, indent=2, sort_keys=False) + "\n").encode())


MADE_BY = ".draftlab"  # in every folder atomic_dir makes: draftlab may replace only those
MADE_BY_TEXT = b"this folder was made by draftlab, which replaces it when its stage runs again\n"


def made_by_draftlab(folder: Path, record: str | None = None) -> bool:
    """Marked, or (made before the mark existed) holding the stage's own record file `record`."""
    return (Path(folder) / MADE_BY).is_file() or (record is not None and (Path(folder) / record).is_file())


def check_replaceable(final: Path, record: str | None = None) -> None:
    """Refuse (one line, exit 2) an existing `final` that draftlab did not make: a folder named by
    mistake (`--out ~/models`) is the user's, never moved aside and removed."""
    from draftlab.errors import HostError

    final = Path(final)
    if final.is_symlink() or (final.exists() and not final.is_dir()):
        raise HostError(f"{final}: exists and is not a folder draftlab made; remove it yourself or pass another --out")
    if final.is_dir() and any(final.iterdir()) and not made_by_draftlab(final, record):
        raise HostError(f"{final}: an existing folder draftlab did not make (no {MADE_BY} marker in it); "
                        "draftlab replaces only its own folders: pass another --out, or empty or remove it yourself")


@contextlib.contextmanager
def atomic_dir(final: Path, record: str | None = None) -> Iterator[Path]:
    """Yield a scratch folder beside `final`; on success it replaces `final` in one rename.
    On failure `final` (if any) is untouched and the scratch folder is removed. The folder is
    marked as draftlab's (MADE_BY); an existing `final` without that mark is refused before
    anything is written (check_replaceable), and an empty one is taken. `record`: the stage's own
    record file (prepare.json, export.json), which marks a folder an older draftlab made."""
    final = Path(final)
    check_replaceable(final, record)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
        (tmp / MADE_BY).write_bytes(MADE_BY_TEXT)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    check_replaceable(final, record)  # made meanwhile by someone else: still theirs
    old = final.with_name(f".{final.name}.old-{os.getpid()}")
    if final.exists():
        os.replace(final, old)
    os.replace(tmp, final)
    shutil.rmtree(old, ignore_errors=True)


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()
