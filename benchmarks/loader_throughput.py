"""Does speculators' own data loader read a cold store at the disk's rate? bf16 and fp8 stores.

A generated store per dtype (≥ `--gb` GB each, files of `--tokens-per-file` tokens × 4 layers ×
`--hidden-size`, written by extract's own writer: `sample_tensors` + safetensors + atomic write,
random-normal states), with a prepared dataset whose token ids match. In every round, for each
dtype (order alternating), page cache evicted before each pass (posix_fadvise DONTNEED per file):

  dd       `dd bs=16M` of the same files to /dev/null: the disk's read rate
  loader   speculators' trainer loader (`speculators.train.dataloader._setup_dataloader`: its
           ArrowDataset, packing sampler, CollateFn, spawn workers, prefetch) over every file,
           the transfer the trainer picks for the dtype (FileTransfer / FP8Transfer, which
           dequantizes to bf16), eagle3's shift_batch; bytes/s of files read, CPU-s per GB (the
           process and its workers)

and once per dtype, in-process without workers, where a batch's time goes: the transfer's read
(safetensors load, + dequantize for fp8), the rest of the dataset's __getitem__, the collate.
Goal: loader >= 0.8x dd. Nothing here passes or fails on timing.

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


def generate(root: Path, dtype: str, args) -> tuple[Path, Path, list[Path]]:
    import torch
    from datasets import Dataset
    from safetensors.torch import save

    from draftlab import store
    from draftlab.stages.extract import sample_tensors
    from draftlab.util import write_bytes_atomic

    t, h = args.tokens_per_file, args.hidden_size
    per_file = t * store.bytes_per_token(h, dtype)
    n = max(1, -(-int(args.gb * 1e9) // per_file))
    store_dir, data_dir = root / f"hs-{dtype}", root / f"data-{dtype}"
    g = torch.Generator().manual_seed(0)
    rows = []
    for i in range(n):
        ids = torch.randint(0, 32000, (t,), generator=g)
        hidden = torch.randn(t, 4, h, generator=g)
        write_bytes_atomic(store_dir / store.file_name(i), save(sample_tensors(hidden, ids, dtype)))
        rows.append({"input_ids": ids.tolist(), "loss_mask": [1] * t, "seq_len": t})
    ds = Dataset.from_list(rows)
    ds.set_format("torch")  # as prepare saves it: speculators compares tensors
    ds.save_to_disk(str(data_dir))
    return store_dir, data_dir, sorted(store_dir.glob("hs_*.safetensors"))


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


def loader(store_dir: Path, data_dir: Path, files: list[Path], dtype: str, args) -> dict:
    import torch
    from hs_connectors import FileTransfer, FP8Transfer
    from speculators.models.eagle3.data import shift_batch
    from speculators.train.data import ArrowDataset
    from speculators.train.dataloader import _setup_dataloader

    transfer = FP8Transfer(store_dir) if dtype == "float8_e4m3fn" else FileTransfer(store_dir)
    ds = ArrowDataset(max_len=args.total_seq_len, datapath=str(data_dir), transfer=transfer, on_missing="raise",
                      train_ratio=1.0, split="train", hidden_states_dtype=torch.bfloat16)
    dl = _setup_dataloader(ds, args.total_seq_len, args.hidden_size, num_workers=args.workers,
                           prefetch_factor=args.prefetch, preprocess=shift_batch)
    evict(files)
    cpu0, t0 = cpu_s(), time.perf_counter()
    tokens = 0
    it = iter(dl)  # spawns the workers (their start-up is part of what a training pays)
    for batch in it:
        tokens += int((batch["document_ids"] >= 0).sum())
    elapsed = time.perf_counter() - t0
    cpu = cpu_s() - cpu0  # workers are still alive (persistent): their CPU time counts
    del it, dl
    return {"s": elapsed, "cpu_s": cpu, "tokens": tokens}


def breakdown(store_dir: Path, data_dir: Path, files: list[Path], dtype: str, args) -> dict:
    """In-process, no workers: seconds in the transfer's read, the rest of __getitem__, collate."""
    import torch
    from hs_connectors import FileTransfer, FP8Transfer
    from speculators.models.eagle3.data import shift_batch
    from speculators.train.data import ArrowDataset, CollateFn

    transfer = FP8Transfer(store_dir) if dtype == "float8_e4m3fn" else FileTransfer(store_dir)
    timed = {"read": 0.0}
    get = transfer.get_cached

    def timed_get(i):
        t0 = time.perf_counter()
        out = get(i)
        out = {k: (v.clone() if k == "hidden_states" and dtype != "float8_e4m3fn" else v) for k, v in out.items()}
        timed["read"] += time.perf_counter() - t0  # lazy mmap: touched (copied) so the read is counted
        return out

    transfer.get_cached = timed_get
    ds = ArrowDataset(max_len=args.total_seq_len, datapath=str(data_dir), transfer=transfer, on_missing="raise",
                      train_ratio=1.0, split="train", hidden_states_dtype=torch.bfloat16)
    collate = CollateFn(args.total_seq_len, args.hidden_size, dtype=torch.bfloat16, preprocess=shift_batch)
    per = max(1, args.total_seq_len // args.tokens_per_file)
    evict(files)
    get_s = collate_s = 0.0
    for start in range(0, len(ds), per):
        t0 = time.perf_counter()
        items = [ds[i] for i in range(start, min(start + per, len(ds)))]
        t1 = time.perf_counter()
        collate(items)
        collate_s += time.perf_counter() - t1
        get_s += t1 - t0
    return {"read_s": timed["read"], "getitem_rest_s": get_s - timed["read"], "collate_s": collate_s}


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
              + f"; {args.workers} workers × prefetch {args.prefetch}, total_seq_len {args.total_seq_len:,}", flush=True)
        res = {d: {"dd": [], "loader": []} for d in DTYPES}
        for r in range(args.rounds):
            for d in DTYPES if r % 2 == 0 else DTYPES[::-1]:
                store_dir, data_dir, files = stores[d]
                passes = {"dd": lambda: dd(files), "loader": lambda: loader(store_dir, data_dir, files, d, args)}
                for name in ("dd", "loader") if r % 2 == 0 else ("loader", "dd"):
                    res[d][name].append(passes[name]())
                x, y = res[d]["dd"][-1], res[d]["loader"][-1]
                print(f"  round {r + 1} {d}: dd {nbytes[d] / x['s'] / 1e6:.0f} MB/s, loader "
                      f"{nbytes[d] / y['s'] / 1e6:.0f} MB/s ({y['tokens']:,} tokens)", flush=True)
        out = {"machine": {"cpus": os.cpu_count()}, "args": {k: str(v) for k, v in vars(args).items()}, "dtypes": {}}
        for d in DTYPES:
            gb = nbytes[d] / 1e9
            ratio = [nbytes[d] / l["s"] / (nbytes[d] / x["s"]) for x, l in zip(res[d]["dd"], res[d]["loader"])]
            out["dtypes"][d] = {
                "files": len(stores[d][2]), "bytes": nbytes[d],
                "dd_mb_s": spread([nbytes[d] / x["s"] / 1e6 for x in res[d]["dd"]]),
                "loader_mb_s": spread([nbytes[d] / l["s"] / 1e6 for l in res[d]["loader"]]),
                "loader_tokens_per_s": spread([l["tokens"] / l["s"] for l in res[d]["loader"]]),
                "loader_over_dd": spread(ratio),
                "dd_cpu_s_per_gb": spread([x["cpu_s"] / gb for x in res[d]["dd"]]),
                "loader_cpu_s_per_gb": spread([l["cpu_s"] / gb for l in res[d]["loader"]]),
                "breakdown_s": breakdown(*stores[d], d, args),
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

    for d, r in out["dtypes"].items():
        b = r["breakdown_s"]
        print(f"{d}: {r['files']} files, {r['bytes'] / 1e9:.2f} GB; dd {ms(r['dd_mb_s'])} MB/s; loader "
              f"{ms(r['loader_mb_s'])} MB/s of files = {ms(r['loader_over_dd'], '{:.2f}')}x dd, "
              f"{ms(r['loader_tokens_per_s'])} tokens/s; CPU-s per GB: loader {ms(r['loader_cpu_s_per_gb'], '{:.2f}')}, "
              f"dd {ms(r['dd_cpu_s_per_gb'], '{:.2f}')}; no-worker breakdown: read {b['read_s']:.1f} s, rest of "
              f"__getitem__ {b['getitem_rest_s']:.1f} s, collate {b['collate_s']:.1f} s")
    print("RESULT loader / dd (goal >= 0.8): " + "; ".join(
        f"{d} {ms(r['loader_over_dd'], '{:.2f}')}" for d, r in out["dtypes"].items()))


if __name__ == "__main__":
    main()
