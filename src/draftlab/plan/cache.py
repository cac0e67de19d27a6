"""What a training's launcher computes before launch from its inputs alone, kept by the hash of
those inputs, so that the next training of the same data (a sweep's trials, a rerun, `dvc exp run`,
a benchmark's pairs) reads it instead of computing it again:

    split   the train split's sample lengths and loss-masked tokens, the validation split's
            lengths (loading the dataset costs the `datasets` import and a pass over its rows);
            key: the dataset's content (store.capture.dataset_fingerprint) and data.train_ratio
    plan    the exact accounting and every global step's real tokens (speculators' packing
            sampler, once per (epoch, rank): about a second each at the reference's 37 k samples);
            key: the split's key, the train knobs the sampler reads, and the planning code itself

Entries live under `$DRAFTLAB_CACHE_DIR`, else `$XDG_CACHE_HOME/draftlab`, else `~/.cache/draftlab`
(`plan/<key>.json`), each written atomically once computed; an entry that cannot be read is
computed again, a cache that cannot be written is skipped. A key names the bytes its value was
computed from, so an entry is never stale: deleting the folder costs only time.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from pathlib import Path

# the code an entry's value comes from: a change to any of these files is a new key
_CODE = ("plan/accounting.py", "plan/sampler.py", "plan/cache.py")


def cache_dir() -> Path:
    if os.environ.get("DRAFTLAB_CACHE_DIR"):
        return Path(os.environ["DRAFTLAB_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "draftlab"


@functools.cache
def code_version() -> str:
    from draftlab.pinned import SPECULATORS_VERSION

    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256(SPECULATORS_VERSION.encode())
    for rel in _CODE:
        h.update((root / rel).read_bytes())
    return h.hexdigest()


def key_of(kind: str, fields: dict) -> str:
    blob = json.dumps({"kind": kind, "code": code_version(), **fields}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


def _entry(kind: str, key: str) -> Path:
    return cache_dir() / kind / f"{key}.json"


def read(kind: str, key: str) -> dict | None:
    try:
        return json.loads(_entry(kind, key).read_text())
    except (OSError, ValueError):
        return None


def write(kind: str, key: str, value: dict) -> None:
    from draftlab.util import write_json_atomic

    try:
        path = _entry(kind, key)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(path, value)
    except OSError:  # a read-only or full home: the next run computes it again
        pass


@functools.cache
def _fingerprint(data_dir: str, stats: tuple) -> str:
    from draftlab.store.capture import dataset_fingerprint

    return dataset_fingerprint(Path(data_dir))


def dataset_key(data_dir: Path) -> str:
    """store.capture.dataset_fingerprint, computed once per process for files that did not change."""
    files = sorted(Path(data_dir).glob("*.arrow"))
    stats = tuple((p.name, st.st_size, st.st_mtime_ns, st.st_ino) for p in files for st in [p.stat()])
    return _fingerprint(str(Path(data_dir).resolve()), stats)


def split(data_dir: Path, train_ratio: float) -> dict:
    """{"train_lengths", "loss_tokens", "val_lengths"} of speculators' row-order split."""
    key = key_of("split", {"dataset": dataset_key(data_dir), "train_ratio": train_ratio})
    if (hit := read("split", key)) is not None:
        return hit
    from datasets import load_from_disk

    import pyarrow.compute as pc

    ds = load_from_disk(str(data_dir)).with_format(None)
    n_train = int(len(ds) * train_ratio)
    lengths = list(ds["seq_len"])
    # summed in Arrow: as Python lists, the reference's 87.8 M mask values cost about a minute
    masks = ds.with_format("arrow")[:n_train]["loss_mask"]
    value = {"train_lengths": lengths[:n_train], "loss_tokens": int(pc.sum(pc.list_flatten(masks)).as_py() or 0),
             "val_lengths": lengths[n_train:]}
    write("split", key, value)
    return value


def plan_key(data_dir: Path, train_ratio: float, knobs: dict) -> str:
    return key_of("plan", {"dataset": dataset_key(data_dir), "train_ratio": train_ratio, **knobs})
