"""The hidden-state store: `hs_<i>.safetensors` files in speculators 0.9's layout, a journal
that makes extraction resumable, and the manifest that DVC tracks in place of the files.

Layout of a store folder:
    hs_<i>.safetensors   hidden_states [T, 4, H] (3 aux layers, then the final layer before the
                         final norm) and token_ids [T] (int64), for row i of the prepared dataset
    .journal.jsonl       line 1: the store key; then one line per finished batch of files
    manifest.json        written last: key, its fields, per-file bytes/sha256/tokens, totals

Why a manifest: versioning a 4.6 TiB store by md5 costs DVC hours per change, so DVC tracks
manifest.json (whose sha256s are computed from bytes already in memory during extraction) and
the files are checked against it by `draftlab verify`.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

from draftlab.util import sha256_file

MANIFEST = "manifest.json"
JOURNAL = ".journal.jsonl"
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
TOKEN_ID_BYTES = 8  # token_ids are int64


def default_layer_ids(num_layers: int) -> list[int]:
    """speculators' / vLLM's default EAGLE-3 auxiliary layers."""
    return [2, num_layers // 2, num_layers - 3]


def file_name(index: int) -> str:
    return f"hs_{index}.safetensors"


def bytes_per_token(hidden_size: int, dtype: str) -> int:
    """Analytic payload per token: 4 layers × H × dtype bytes + one int64 token id."""
    return 4 * hidden_size * DTYPE_BYTES[dtype] + TOKEN_ID_BYTES


def predicted_bytes(seq_lens: list[int], hidden_size: int, dtype: str, header_bytes: int = 256) -> int:
    bpt = bytes_per_token(hidden_size, dtype)
    return sum(t * bpt + header_bytes for t in seq_lens)


def store_key(fields: dict) -> str:
    """sha256 of the params that define a store: files of different keys never mix."""
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()


@dataclass
class Journal:
    """Append-only record of finished files; a file not in it is redone on resume."""

    path: Path
    key: str
    done: dict[int, dict]

    @classmethod
    def open(cls, store_dir: Path, key: str) -> Journal:
        path = store_dir / JOURNAL
        done: dict[int, dict] = {}
        if path.exists():
            lines = path.read_text().splitlines()
            header = json.loads(lines[0]) if lines else {}
            if header.get("key") != key:
                raise StaleStoreError(header.get("key"))
            for line in lines[1:]:
                try:
                    for rec in json.loads(line)["files"]:
                        done[rec["index"]] = rec
                except (json.JSONDecodeError, KeyError):
                    break  # a torn last line from a kill: everything after it is redone
        else:
            store_dir.mkdir(parents=True, exist_ok=True)
            with open(path, "w") as f:
                f.write(json.dumps({"key": key}) + "\n")
                f.flush()
                os.fsync(f.fileno())
        return cls(path, key, done)

    def record(self, files: list[dict]) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps({"files": files}) + "\n")
            f.flush()
            os.fsync(f.fileno())
        for rec in files:
            self.done[rec["index"]] = rec


class StaleStoreError(RuntimeError):
    def __init__(self, old_key: str | None):
        super().__init__(f"store was written for key {old_key}")
        self.old_key = old_key


def read_manifest(store_dir: Path) -> dict:
    path = Path(store_dir) / MANIFEST
    if not path.exists():
        raise FileNotFoundError(f"{path}: no manifest; run `draftlab extract` (or `dvc repro extract`)")
    return json.loads(path.read_text())


def manifest_hash(store_dir: Path) -> str:
    return sha256_file(Path(store_dir) / MANIFEST)


def verify(store_dir: Path, *, full: bool = True) -> list[str]:
    """Problems found: missing, truncated or corrupt files (full=True re-hashes every file)."""
    store_dir = Path(store_dir)
    manifest = read_manifest(store_dir)
    problems = []
    for rec in manifest["files"]:
        path = store_dir / rec["name"]
        if not path.exists():
            problems.append(f"{path}: missing")
            continue
        size = path.stat().st_size
        if size != rec["bytes"]:
            problems.append(f"{path}: truncated or rewritten ({size} bytes, manifest says {rec['bytes']})")
        elif full and sha256_file(path) != rec["sha256"]:
            problems.append(f"{path}: corrupt (sha256 differs from the manifest)")
    return problems
