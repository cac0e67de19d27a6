"""The hidden-state store: `hs_<i>.safetensors` files in speculators 0.9's layout, a journal
that makes extraction resumable, and the manifest that DVC tracks in place of the files.

Layout of a store folder:
    hs_<i>.safetensors   hidden_states [T, 4, H] (3 aux layers, then the final layer before the
                         final norm) and token_ids [T] (int64), for row i of the prepared dataset;
                         in an fp8 store hidden_states is float8_e4m3fn and hidden_states_scales
                         [T, 1, 1] fp32 holds one scale per token (hs_connectors' fp8 layout,
                         dequantized on read by speculators' `--hidden-states-backend fp8`)
    .journal.jsonl       line 1: the store key; then one line per finished batch of files
    manifest.json        written last: key, its fields, dtype, per-file bytes/sha256/tokens, totals
    bad-files.jsonl      files a reader or `draftlab verify` found bad (name, problem): the next
                         extract re-hashes and re-extracts them whatever their size and mtime say

DVC versions the whole folder (a persistent output of `extract`, cached by hardlink); the
manifest's sha256s, computed from bytes already in memory during extraction, let `draftlab verify`
check a store without DVC.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

from draftlab.rundir import Manifest, StoreDir
from draftlab.util import sha256_file, write_bytes_atomic

FP8 = "float8_e4m3fn"
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, FP8: 1}
TOKEN_ID_BYTES = 8  # token_ids are int64
SCALE_BYTES = 4  # fp8: one fp32 scale per token
SCALES_KEY = "hidden_states_scales"  # hs_connectors.fp8_utils.SCALES_KEY (a unit test keeps them equal)
# safetensors header dtype names -> torch's dtype names (the store's for hidden_states)
SAFETENSORS_DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "F64": "float64",
                      "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8",
                      "BOOL": "bool", "F8_E4M3": FP8, "F8_E5M2": "float8_e5m2"}


def default_layer_ids(num_layers: int) -> list[int]:
    """speculators' / vLLM's default EAGLE-3 auxiliary layers."""
    return [2, num_layers // 2, num_layers - 3]


def stale_dir(store_dir: Path, key: str | None) -> Path:
    """Where a store of another key is set aside (and found again when the params return)."""
    store_dir = Path(store_dir)
    return store_dir.parent / f".stale-{store_dir.name}-{(key or 'unknown')[:12]}"


def work_dir(store_dir: Path) -> Path:
    """Where extraction writes and keeps a store: beside it, outside the DVC output (which DVC
    removes before the stage runs); the output is published from it as hardlinks."""
    store_dir = Path(store_dir)
    return store_dir.parent / f".{store_dir.name}.work"


def file_name(index: int) -> str:
    return f"hs_{index}.safetensors"


def bytes_per_token(hidden_size: int, dtype: str) -> int:
    """Analytic payload per token: 4 layers × H × dtype bytes + one int64 token id (+ one fp32
    scale in an fp8 store)."""
    return 4 * hidden_size * DTYPE_BYTES[dtype] + TOKEN_ID_BYTES + (SCALE_BYTES if dtype == FP8 else 0)


def file_dtype(path: Path) -> str:
    """dtype of a file's `hidden_states`, from its safetensors header alone (no tensor read);
    an fp8 file without its scales is reported as such, so it is never read as unscaled."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    name = header["hidden_states"]["dtype"]
    dtype = SAFETENSORS_DTYPES.get(name, name)
    if dtype == FP8 and SCALES_KEY not in header:
        return f"{FP8} without {SCALES_KEY}"
    return dtype


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
        """A partial last line (a kill or a full disk mid-append) is trimmed first, so the next
        record follows a whole line; a record line that does not parse is skipped, never the
        records after it."""
        from draftlab import appendlog

        path = StoreDir(store_dir).journal_path
        done: dict[int, dict] = {}
        if path.exists():
            _own(path)
            appendlog.trim_partial_line(path)
            lines = appendlog.complete_lines(path)
        else:
            lines = []
        if lines:
            try:
                header = json.loads(lines[0])
            except json.JSONDecodeError:
                header = {}
            if header.get("key") != key:
                raise StaleStoreError(header.get("key"))
            for line in lines[1:]:
                try:
                    for rec in json.loads(line)["files"]:
                        done[rec["index"]] = rec
                except (json.JSONDecodeError, KeyError, TypeError):
                    continue  # a line torn by an older draftlab: its files are redone, later ones kept
        else:  # new, or only a torn header: nothing was recorded
            from draftlab.util import write_bytes_atomic

            store_dir.mkdir(parents=True, exist_ok=True)
            write_bytes_atomic(path, (json.dumps({"key": key}) + "\n").encode())
        return cls(path, key, done)

    def forget(self, indices: set[int]) -> None:
        """Drop records whose files failed verification, so they are redone (one atomic rewrite)."""
        from draftlab.util import write_bytes_atomic

        for i in indices:
            self.done.pop(i, None)
        lines = [json.dumps({"key": self.key}), json.dumps({"files": [self.done[i] for i in sorted(self.done)]})]
        write_bytes_atomic(self.path, ("\n".join(lines) + "\n").encode())

    def record(self, files: list[dict]) -> None:
        from draftlab import appendlog

        _own(self.path)
        appendlog.append(self.path, {"files": files}, sync=True)
        for rec in files:
            self.done[rec["index"]] = rec


def _own(path: Path) -> None:
    """Make `path` a private, writable file before appending to it. Once DVC has cached the store,
    the workspace journal is a hardlink (or symlink) to a read-only cache object: appending in
    place would fail, or worse, change the cached copy of an older store."""
    st = os.lstat(path)
    if path.is_symlink() or st.st_nlink > 1 or not os.access(path, os.W_OK):
        write_bytes_atomic(path, path.read_bytes())


class StaleStoreError(RuntimeError):
    def __init__(self, old_key: str | None):
        super().__init__(f"store was written for key {old_key}")
        self.old_key = old_key


def read_manifest(store_dir: Path) -> Manifest:
    return StoreDir(store_dir).manifest.read()


def has_manifest(store_dir: Path) -> bool:
    return StoreDir(store_dir).manifest.exists()


def manifest_path(store_dir: Path) -> Path:
    return StoreDir(store_dir).manifest.path


def manifest_hash(store_dir: Path) -> str:
    return sha256_file(manifest_path(store_dir))


HEADER_LIMIT = 100 << 20  # safetensors' own cap on a header's length


def header_problem(path: Path, rec: dict, head: bytes | None = None) -> str | None:
    """Why the file's safetensors header cannot be the one the manifest describes, or None.
    Reads 8 bytes plus the header (or takes them from `head`): cheap at any store size."""
    try:
        if head is None:
            with open(path, "rb") as f:
                head = f.read(8)
                n = int.from_bytes(head, "little") if len(head) == 8 else -1
                if 0 < n <= min(HEADER_LIMIT, rec["bytes"] - 8):
                    head += f.read(n)
        if len(head) < 8:
            return "garbage header (shorter than 8 bytes)"
        n = int.from_bytes(head[:8], "little")
        if not 0 < n <= min(HEADER_LIMIT, rec["bytes"] - 8) or len(head) < 8 + n:
            return f"garbage header (declares {n} header bytes in a {rec['bytes']}-byte file)"
        header = json.loads(head[8 : 8 + n])
        hs, ids = header["hidden_states"], header["token_ids"]
        end = max(t["data_offsets"][1] for k, t in header.items() if k != "__metadata__")
    except (OSError, ValueError, KeyError, TypeError, UnicodeDecodeError):
        return "garbage header (not a safetensors header with hidden_states and token_ids)"
    if hs["shape"][0] != rec["tokens"] or ids["shape"] != [rec["tokens"]]:
        return f"header says {hs['shape'][0]} tokens, manifest says {rec['tokens']}"
    if 8 + n + end != rec["bytes"]:
        return f"header describes {8 + n + end} bytes, manifest says {rec['bytes']}"
    return None


def file_problem(path: Path, rec: dict, *, full: bool, trust_stat: bool = False) -> str | None:
    """One file against its manifest/journal record: missing, wrong size, garbage header, or
    (full) a sha256 that differs. With trust_stat, a file whose mtime and size are those
    recorded when it was written is not re-hashed (DVC trusts its state database the same way)."""
    try:
        st = path.stat()
    except FileNotFoundError:
        return "missing"
    if st.st_size != rec["bytes"]:
        return f"truncated or rewritten ({st.st_size} bytes, manifest says {rec['bytes']})"
    problem = header_problem(path, rec)
    if problem:
        return problem
    if trust_stat and rec.get("mtime_ns") == st.st_mtime_ns:
        return None
    if full and sha256_file(path) != rec["sha256"]:
        return "corrupt (sha256 differs from the manifest)"
    return None


def journal_stamps(store_dir: Path) -> dict[str, int]:
    """mtime_ns of each file as its writer recorded it in the journal (empty without one)."""
    path = StoreDir(store_dir).journal_path
    stamps: dict[str, int] = {}
    if path.exists():
        for line in path.read_text().splitlines()[1:]:
            try:
                stamps.update({r["name"]: r["mtime_ns"] for r in json.loads(line)["files"] if "mtime_ns" in r})
            except (json.JSONDecodeError, KeyError, TypeError):
                continue  # a torn line: the next one still counts
    return stamps


def verify(store_dir: Path, *, full: bool = True, changed_only: bool = False, record: bool = False) -> list[str]:
    """Problems found: missing, truncated, garbage-header, other-dtype (than the manifest's) or
    (full=True: re-hashed) corrupt files.
    changed_only: a file whose mtime is the one recorded when it was written is not re-hashed
    (the cheap check `dvc repro` runs before extract); a file in the store's bad-files record
    is re-hashed whatever its mtime. record: what is found goes into that record (record_bad)."""
    store_dir = Path(store_dir)
    manifest = read_manifest(store_dir)
    want_dtype = manifest.dtype
    stamps = journal_stamps(store_dir) if changed_only else {}
    suspect = set(recorded_bad(store_dir))
    problems = []
    for f in manifest.files:
        rec = f.model_dump()
        path = store_dir / f.name
        stamped = {**rec, "mtime_ns": stamps[f.name]} if f.name in stamps else rec
        again = f.name in suspect
        problem = file_problem(path, stamped, full=full or again, trust_stat=changed_only and not again)
        if not problem and want_dtype and (got := _header_dtype(path)) != want_dtype:
            problem = f"holds {got} hidden states, the manifest says dtype {want_dtype}"
        if problem:
            problems.append(f"{path}: {problem}")
    if record:
        record_bad(store_dir, _problem_names(store_dir, problems))
    return problems


REPAIR = "run `draftlab extract` (or `dvc repro extract`): it re-extracts only the bad files"


def record_bad(store_dir: Path, problems: dict[str, str]) -> None:
    """Keep what a reader found bad ({file name: problem}) where extract looks: in the store's
    work folder (extract's own copy, not a DVC output) and in `store_dir` itself, where DVC sees
    a new file in extract's output (`dvc status`: extract changed) and `verify` reads it. A bad
    file often keeps its size and mtime (bit rot): without this record extract would trust it."""
    if not problems:
        return
    store_dir = Path(store_dir)
    lines = "".join(json.dumps({"name": n, "problem": p}) + "\n" for n, p in sorted(problems.items()))
    for folder in {store_dir, work_dir(store_dir)}:
        if folder.is_dir():
            try:
                with open(StoreDir(folder).bad_files_path, "a") as f:  # one write: several readers may append at once
                    f.write(lines)
            except OSError:
                pass  # a read-only store: the reader's message still names the file


def recorded_bad(store_dir: Path) -> dict[str, str]:
    """{file name: problem} recorded in `store_dir` (a torn last line from a kill is skipped)."""
    path = StoreDir(store_dir).bad_files_path
    out: dict[str, str] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                rec = json.loads(line)
                out[str(rec["name"])] = str(rec["problem"])
            except (json.JSONDecodeError, KeyError, TypeError):
                continue
    return out


def clear_bad(store_dir: Path) -> None:
    StoreDir(store_dir).bad_files_path.unlink(missing_ok=True)


def _problem_names(store_dir: Path, problems: list[str]) -> dict[str, str]:
    prefix = f"{store_dir}/"
    return {line[len(prefix):].split(": ", 1)[0]: line.split(": ", 1)[-1] for line in problems if line.startswith(prefix)}


def _header_dtype(path: Path) -> str:
    try:
        return file_dtype(path)
    except (OSError, ValueError, KeyError, struct.error):
        return "unreadable (not a safetensors file with hidden_states)"
