"""Extraction's work, shared by the extract stage and its rank processes (draftlab.store.extract_ranks):
what a store is made from (`target_identity`, `dataset_fingerprint`, `check_dtype`), batches
composed from sample lengths alone (`plan_batches`), and the forward-capture-write loop that
writes one `hs_<i>.safetensors` per row atomically (`extract_batches`).

Legend: B batch rows, T tokens, H hidden size; 4 = the 3 aux layers and the pre-norm final layer.
"""

from __future__ import annotations

import hashlib
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from draftlab.models import LayerCapture, resolve
from draftlab.params import Params, ParamsError
from draftlab.store import layout as store
from draftlab.util import sha256_file, write_bytes_atomic


def target_identity(params: Params, target_dir: Path) -> dict:
    """What makes one target differ from another, cheaply (no hashing of TB of weights)."""
    t = params.target
    if t.source == "hub":
        return {"hub_id": t.path, **({"revision": t.revision} if t.revision else {})}
    path = Path(resolve(params, target_dir))
    files = sorted(p for p in path.iterdir() if p.suffix in (".json", ".safetensors", ".bin"))
    sig = {p.name: p.stat().st_size for p in files}
    return {"config_sha256": sha256_file(path / "config.json"), "files": sig}


def dataset_fingerprint(data_dir: Path) -> str:
    import hashlib

    h = hashlib.sha256()
    for p in sorted(data_dir.glob("*.arrow")):
        h.update(p.name.encode())
        h.update(sha256_file(p).encode())
    return h.hexdigest()


def check_dtype(dtype: str) -> None:
    import torch

    if dtype == store.FP8 and not hasattr(torch, store.FP8):
        raise ParamsError(f"extract.dtype: {dtype} needs a torch with torch.{store.FP8} (this is torch "
                          f"{torch.__version__}); use bfloat16 or a newer torch")


def plan_batches(seq_lens: list[int], batch_tokens: int) -> list[list[int]]:
    """Consecutive sample indices per batch, padded size (count × longest) ≤ batch_tokens."""
    batches, cur, longest = [], [], 0
    for i, n in enumerate(seq_lens):
        new_longest = max(longest, n)
        if cur and new_longest * (len(cur) + 1) > batch_tokens:
            batches.append(cur)
            cur, new_longest = [], n
        cur.append(i)
        longest = new_longest
    if cur:
        batches.append(cur)
    return batches


def sample_tensors(hidden_T4H, token_ids, dtype: str) -> dict:
    """One file's tensors. fp8 uses hs_connectors' own quantizer (what its vLLM connector
    writes, and what its FP8Transfer dequantizes): one fp32 scale per token over all 4 layers."""
    if dtype == store.FP8:
        from hs_connectors.fp8_utils import quantize_tensor_to_fp8

        fp8_T4H, scales_T11 = quantize_tensor_to_fp8(hidden_T4H)
        return {"hidden_states": fp8_T4H, store.SCALES_KEY: scales_T11, "token_ids": token_ids}
    import torch

    return {"hidden_states": hidden_T4H.to(getattr(torch, dtype)).contiguous(), "token_ids": token_ids}


def _heal_in_place(path: Path, blob: bytes) -> None:
    """A damaged file that is hardlinked into DVC's cache damaged the cache object too (one
    inode, which DVC trusts while its mode is read-only): when re-extraction reproduced the
    original bytes, they are written back into that inode, healing workspace and cache at once."""
    mode = os.stat(path).st_mode
    os.chmod(path, mode | 0o200)
    try:
        with open(path, "r+b") as f:
            f.write(blob)
            f.truncate()
            f.flush()
            os.fsync(f.fileno())
    finally:
        os.chmod(path, mode)


def write_batch(out_dir: Path, batch: list[int], lengths: list[int], hidden_BT4H, input_ids,
                keep: frozenset[int] = frozenset(), dtype: str = "bfloat16",
                heal: dict[int, str] | None = None) -> list[dict]:
    """Write one batch's files atomically, except those in `keep` (verified good: a repair
    rewrites only the bad files); return their journal records (sha256 of the bytes already in
    memory: no re-read; mtime_ns so that a later check can tell an untouched file). `heal`: the
    sha256 a damaged file had when written; see `_heal_in_place`."""
    from safetensors.torch import save

    records = []
    for r, (i, n) in enumerate(zip(batch, lengths)):
        if i in keep:
            continue
        blob = save(sample_tensors(hidden_BT4H[r, :n], input_ids[r, :n].clone(), dtype))
        path = out_dir / store.file_name(i)
        digest = hashlib.sha256(blob).hexdigest()
        if heal and heal.get(i) == digest and path.exists() and os.stat(path).st_nlink > 1:
            _heal_in_place(path, blob)
        else:
            write_bytes_atomic(path, blob)
        records.append({"index": i, "name": store.file_name(i), "bytes": len(blob),
                        "sha256": digest, "tokens": n, "mtime_ns": path.stat().st_mtime_ns})
    return records


def extract_batches(model, capture: LayerCapture, ds, batches: list[list[int]], out_dir: Path, dtype: str,
                    placement, on_done, done: frozenset[int] = frozenset(),
                    heal: dict[int, str] | None = None) -> None:
    """Forward every batch, write its files except those in `done` (verified good: a repair
    rewrites only the bad ones), call `on_done(records)` once they are on disk.

    One writer thread: batch k's files are serialised, hashed and written while batch k+1's
    forward runs (hashlib and file writes release the GIL). `on_done` (the journal) sees a batch
    only after its files are on disk, so a kill never leaves a recorded-but-missing file."""
    import torch

    from draftlab import devices

    torch_dtype, pad = (None if dtype == store.FP8 else getattr(torch, dtype)), 0
    writer = ThreadPoolExecutor(max_workers=1)
    pending = None
    try:
        for batch in batches:
            rows = [ds[i]["input_ids"] for i in batch]
            width = max(len(r) for r in rows)
            input_ids = torch.full((len(rows), width), pad, dtype=torch.long)
            mask = torch.zeros((len(rows), width), dtype=torch.long)
            for r, ids in enumerate(rows):
                input_ids[r, : len(ids)] = torch.as_tensor(ids)
                mask[r, : len(ids)] = 1
            with torch.no_grad(), devices.autocast(placement):
                model.model(input_ids=input_ids.to(model.device), attention_mask=mask.to(model.device))
            # fp8 is quantized from the model's own precision, per sample, on the writer thread
            hidden_BT4H = capture.stacked()
            hidden_BT4H = (hidden_BT4H if dtype == store.FP8 else hidden_BT4H.to(torch_dtype)).cpu()
            if pending is not None:
                on_done(pending.result())
            keep = frozenset(i for i in batch if i in done)
            pending = writer.submit(write_batch, out_dir, batch, [len(r) for r in rows], hidden_BT4H, input_ids, keep,
                                    dtype, heal)
        if pending is not None:
            on_done(pending.result())
    finally:
        writer.shutdown(wait=True)
