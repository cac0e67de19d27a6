"""Does speculators' own data loader read a cold store at the disk's rate? bf16 and fp8 stores.

A generated store per dtype (≥ `--gb` GB each, files of `--tokens-per-file` tokens × 4 layers ×
`--hidden-size`, written by extract's own writer: `sample_tensors` + safetensors + atomic write,
random-normal states), with a prepared dataset whose token ids match. Two loader arms per dtype:

  speculators  its trainer loader (`speculators.train.dataloader._setup_dataloader`: ArrowDataset,
               packing sampler, CollateFn, spawn workers, prefetch, pin_memory as it sets them)
               with the stock transfer the trainer picks for the dtype (FileTransfer /
               FP8Transfer, which dequantizes to bf16), eagle3's shift_batch
  draftlab     the same loader as `draftlab train` runs it: every file through
               hidden_states.VerifiedTransfer (size, header and sha256 against the manifest, decoded in
               place, fp8 dequantized by table lookup)

Each arm's loader is built once and kept (persistent workers, as in training): its first pass
pays the workers' start-up (spawn, import torch and speculators), reported apart as
"start-up" (iter() to the first batch) and "first pass"; then `--rounds` rounds, each an
interleaved pair (order alternating) on a page cache evicted before each pass (posix_fadvise
DONTNEED per file):

  dd       `dd bs=16M` of the same files to /dev/null: the disk's read rate
  loader   one epoch with the workers already up: bytes/s of files read, tokens/s, CPU-s per GB
           (the process and its workers)

and once per arm and dtype, in-process without workers, where a batch's time goes: the transfer's
read (+ sha256 for draftlab, + dequantize for fp8), the rest of the dataset's __getitem__, the
collate (a zero-filled row buffer, one copy per sample), and the move of the batch into shared
memory that a worker's queue makes. Goal: loader >= 0.8x dd. Nothing passes or fails on timing.

    python benchmarks/loader_throughput.py                       # H=7168, 2,353 tokens/file, ~2.2 GB/store
    python benchmarks/loader_throughput.py --workers 12 --json reports/loader_throughput.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from dvc_scale import evict  # noqa: E402  (benchmarks/ is on sys.path when run as a script)

DTYPES = ("bfloat16", "float8_e4m3fn")
ARMS = ("speculators", "draftlab")


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden-size", type=int, default=7168, help="H (the reference's 7168)")
    ap.add_argument("--tokens-per-file", type=int, default=2353, help="the reference's mean tokens per sample")
    ap.add_argument("--gb", type=float, default=2.0, help="minimum store size per dtype, GB")
    ap.add_argument("--total-seq-len", type=int, default=8192, help="packing length (train.total_seq_len)")
    ap.add_argument("--workers", type=int, default=2, help="DataLoader workers (speculators' default is 12)")
    ap.add_argument("--prefetch", type=int, default=4, help="prefetch factor (speculators' default)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--json", type=Path, default=None)
    return ap.parse_args()


def generate(root: Path, dtype: str, args) -> tuple[Path, Path, list[Path], dict]:
    import hashlib

    import torch
    from datasets import Dataset
    from safetensors.torch import save

    from draftlab.store import layout as store
    from draftlab.store.capture import sample_tensors
    from draftlab.util import write_bytes_atomic

    t, h = args.tokens_per_file, args.hidden_size
    per_file = t * store.bytes_per_token(h, dtype)
    n = max(1, -(-int(args.gb * 1e9) // per_file))
    store_dir, data_dir = root / f"hs-{dtype}", root / f"data-{dtype}"
    g = torch.Generator().manual_seed(0)
    rows, records = [], {}
    for i in range(n):
        ids = torch.randint(0, 32000, (t,), generator=g)
        hidden = torch.randn(t, 4, h, generator=g)
        blob = save(sample_tensors(hidden, ids, dtype))
        write_bytes_atomic(store_dir / store.file_name(i), blob)
        records[i] = {"index": i, "name": store.file_name(i), "tokens": t, "bytes": len(blob),
                      "sha256": hashlib.sha256(blob).hexdigest()}  # what extract's manifest records
        rows.append({"input_ids": ids.tolist(), "loss_mask": [1] * t, "seq_len": t})
    ds = Dataset.from_list(rows)
    ds.set_format("torch")  # as prepare saves it: speculators compares tensors
    ds.save_to_disk(str(data_dir))
    return store_dir, data_dir, sorted(store_dir.glob("hs_*.safetensors")), records


def cpu_s(pid: int | None = None) -> float:
    import psutil

    proc = psutil.Process(pid)
    total = sum(proc.cpu_times()[:2])
    for child in proc.children(recursive=True):
        try:
            total += sum(child.cpu_times()[:2])
        except psutil.NoSuchProcess:
            pass
    return total


def dd(files: list[Path]) -> dict:
    evict(files)
    t0, c0 = time.perf_counter(), time.process_time()
    cpu = 0.0
    for path in files:
        proc = subprocess.run(["bash", "-c", f"TIMEFORMAT=%U+%S; time dd if='{path}' of=/dev/null bs=16M status=none"],
                              capture_output=True, text=True, check=True)
        cpu += sum(map(float, proc.stderr.strip().splitlines()[-1].split("+")))  # bash's "user+sys" s
    return {"s": time.perf_counter() - t0, "cpu_s": cpu + time.process_time() - c0}


def transfer(arm: str, dtype: str, store_dir: Path, records: dict):
    from hs_connectors import FileTransfer, FP8Transfer

    from draftlab.store import hidden_states

    stock = FP8Transfer(store_dir) if dtype == "float8_e4m3fn" else FileTransfer(store_dir)
    return stock if arm == "speculators" else hidden_states.VerifiedTransfer(stock, store_dir, records)


def dataset(arm: str, dtype: str, store_dir: Path, data_dir: Path, records: dict, args):
    import torch
    from speculators.train.data import ArrowDataset

    return ArrowDataset(max_len=args.total_seq_len, datapath=str(data_dir),
                        transfer=transfer(arm, dtype, store_dir, records), on_missing="raise",
                        train_ratio=1.0, split="train", hidden_states_dtype=torch.bfloat16)


class Loader:
    """One arm's trainer loader, kept across passes (persistent workers, as in training)."""

    def __init__(self, arm: str, dtype: str, store, args):
        from speculators.models.eagle3.data import shift_batch
        from speculators.train.dataloader import _setup_dataloader

        store_dir, data_dir, self.files, records = store
        ds = dataset(arm, dtype, store_dir, data_dir, records, args)
        self.dl = _setup_dataloader(ds, args.total_seq_len, args.hidden_size, num_workers=args.workers,
                                    prefetch_factor=args.prefetch, preprocess=shift_batch)

    def epoch(self) -> dict:
        evict(self.files)
        cpu0, t0 = cpu_s(), time.perf_counter()
        tokens, first_s = 0, None
        for batch in self.dl:  # the first epoch spawns the workers
            if first_s is None:
                first_s = time.perf_counter() - t0
            tokens += int((batch["document_ids"] >= 0).sum())
        return {"s": time.perf_counter() - t0, "cpu_s": cpu_s() - cpu0, "tokens": tokens, "first_batch_s": first_s}

    def close(self) -> None:
        it = getattr(self.dl, "_iterator", None)
        if it is not None:
            it._shutdown_workers()
        del self.dl


def breakdown(arm: str, dtype: str, store, args) -> dict:
    """In-process, no workers: seconds in the transfer's read, the rest of __getitem__, collate,
    and the move into shared memory a worker's queue makes of every batch."""
    import torch
    from speculators.models.eagle3.data import shift_batch
    from speculators.train.data import CollateFn

    store_dir, data_dir, files, records = store
    ds = dataset(arm, dtype, store_dir, data_dir, records, args)
    timed = {"read": 0.0}
    get = ds.transfer.get_cached

    def timed_get(i):
        t0 = time.perf_counter()
        out = get(i)
        if arm == "speculators" and dtype != "float8_e4m3fn":  # lazy mmap: touched (copied) so the read counts
            out = {k: (v.clone() if k == "hidden_states" else v) for k, v in out.items()}
        timed["read"] += time.perf_counter() - t0
        return out

    ds.transfer.get_cached = timed_get
    collate = CollateFn(args.total_seq_len, args.hidden_size, dtype=torch.bfloat16, preprocess=shift_batch)
    per = max(1, args.total_seq_len // args.tokens_per_file)
    evict(files)
    get_s = collate_s = shm_s = 0.0
    for start in range(0, len(ds), per):
        t0 = time.perf_counter()
        items = [ds[i] for i in range(start, min(start + per, len(ds)))]
        t1 = time.perf_counter()
        batch = collate(items)
        t2 = time.perf_counter()
        for v in batch.values():
            if isinstance(v, torch.Tensor):
                v.share_memory_()
        shm_s += time.perf_counter() - t2
        collate_s += t2 - t1
        get_s += t1 - t0
    return {"read_s": timed["read"], "getitem_rest_s": get_s - timed["read"], "collate_s": collate_s,
            "to_shared_memory_s": shm_s}


def spread(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "values": xs}


def main() -> None:
    args = parse_args()
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    work = Path(tempfile.mkdtemp(prefix="draftlab-loader-", dir=args.workdir))
    try:
        stores = {d: generate(work, d, args) for d in DTYPES}
        nbytes = {d: sum(p.stat().st_size for p in stores[d][2]) for d in DTYPES}
        print(f"{os.cpu_count()} CPUs; H = {args.hidden_size}, {args.tokens_per_file:,} tokens/file; "
              + "; ".join(f"{d}: {len(stores[d][2])} files, {nbytes[d] / 1e9:.2f} GB" for d in DTYPES)
              + f"; {args.workers} workers × prefetch {args.prefetch}, total_seq_len {args.total_seq_len:,}; "
              f"load average {os.getloadavg()[0]:.1f}", flush=True)
        res = {d: {a: {"dd": [], "loader": []} for a in ARMS} for d in DTYPES}
        first = {d: {} for d in DTYPES}
        order = [(d, a) for d in DTYPES for a in ARMS]
        for k, (d, a) in enumerate(order):
            files = stores[d][2]
            ld = Loader(a, d, stores[d], args)
            try:
                first[d][a] = ld.epoch()  # the workers' start-up, paid once per training
                f = first[d][a]
                print(f"  {d} {a}: start-up + first batch {f['first_batch_s']:.1f} s, first pass {f['s']:.1f} s",
                      flush=True)
                for r in range(args.rounds):
                    passes = {"dd": lambda: dd(files), "loader": ld.epoch}
                    for name in ("dd", "loader") if (r + k) % 2 == 0 else ("loader", "dd"):
                        res[d][a][name].append(passes[name]())
                    x, y = res[d][a]["dd"][-1], res[d][a]["loader"][-1]
                    print(f"  round {r + 1} {d} {a}: dd {nbytes[d] / x['s'] / 1e6:.0f} MB/s, loader "
                          f"{nbytes[d] / y['s'] / 1e6:.0f} MB/s ({y['tokens']:,} tokens); load average "
                          f"{os.getloadavg()[0]:.1f}", flush=True)
            finally:
                ld.close()
        out = {"machine": {"cpus": os.cpu_count(), "load_average_end": os.getloadavg()},
               "args": {k: str(v) for k, v in vars(args).items()}, "dtypes": {}}
        for d in DTYPES:
            gb = nbytes[d] / 1e9
            out["dtypes"][d] = {"files": len(stores[d][2]), "bytes": nbytes[d], "arms": {}}
            for a in ARMS:
                r = res[d][a]
                out["dtypes"][d]["arms"][a] = {
                    "dd_mb_s": spread([nbytes[d] / x["s"] / 1e6 for x in r["dd"]]),
                    "loader_mb_s": spread([nbytes[d] / l["s"] / 1e6 for l in r["loader"]]),
                    "loader_tokens_per_s": spread([l["tokens"] / l["s"] for l in r["loader"]]),
                    "loader_over_dd": spread([x["s"] / l["s"] for x, l in zip(r["dd"], r["loader"])]),
                    "dd_cpu_s_per_gb": spread([x["cpu_s"] / gb for x in r["dd"]]),
                    "loader_cpu_s_per_gb": spread([l["cpu_s"] / gb for l in r["loader"]]),
                    "startup_to_first_batch_s": first[d][a]["first_batch_s"], "first_pass_s": first[d][a]["s"],
                    "breakdown_s": breakdown(a, d, stores[d], args),
                }
        report(out)
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(out, indent=2) + "\n")
            print(f"results → {args.json}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


def report(out: dict) -> None:
    def ms(s, f="{:.0f}"):
        return f"{f.format(s['median'])} ({f.format(s['min'])}–{f.format(s['max'])})"

    for d, dd_ in out["dtypes"].items():
        for a, r in dd_["arms"].items():
            b = r["breakdown_s"]
            print(f"{d} {a}: {dd_['files']} files, {dd_['bytes'] / 1e9:.2f} GB; dd {ms(r['dd_mb_s'])} MB/s; loader "
                  f"{ms(r['loader_mb_s'])} MB/s of files = {ms(r['loader_over_dd'], '{:.2f}')}x dd, "
                  f"{ms(r['loader_tokens_per_s'])} tokens/s; CPU-s per GB: loader "
                  f"{ms(r['loader_cpu_s_per_gb'], '{:.2f}')}, dd {ms(r['dd_cpu_s_per_gb'], '{:.2f}')}; workers' "
                  f"start-up + first batch {r['startup_to_first_batch_s']:.1f} s (first pass {r['first_pass_s']:.1f} s); "
                  f"no-worker breakdown: read {b['read_s']:.1f} s, rest of __getitem__ {b['getitem_rest_s']:.1f} s, "
                  f"collate {b['collate_s']:.1f} s, to shared memory {b['to_shared_memory_s']:.1f} s")
    print("RESULT loader / dd, workers up (goal >= 0.8): " + "; ".join(
        f"{d} {a} {ms(r['loader_over_dd'], '{:.2f}')}" for d, dd_ in out["dtypes"].items()
        for a, r in dd_["arms"].items()))


if __name__ == "__main__":
    main()
