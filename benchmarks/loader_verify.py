"""What does the training loader's per-file check cost? speculators' stock read vs draftlab's
verified reads (`train.verify_reads: header` and `sha256`), CPU seconds per GB read.

Each round reads every file of a synthetic store once per mode, the modes' order rotating
from round to round, with the page cache warm (the check costs CPU, not disk: a cold read is
disk-bound in every mode). Every read touches all tensor bytes (a sum), as the collate does.
Printed: median and spread of CPU-s/GB per mode, the extra CPU-s/GB over stock, and what that
extra is as a fraction of one core at a stated per-rank read rate (default: the Kimi-K2.5
reference scenario, 13.2 k tokens/s over 8 ranks at 57.6 kB/token = 95 MB/s per rank).
Nothing passes or fails on timing.

    python benchmarks/loader_verify.py                        # 24 files of 2,048 tokens at H=2048
    python benchmarks/loader_verify.py --hidden-size 7168 --tokens 1024 --files 16 --rounds 5
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import tempfile
import time
from pathlib import Path


def make_store(root: Path, files: int, tokens: int, hidden: int) -> dict[int, dict]:
    import torch
    from safetensors.torch import save

    from draftlab.store import layout as store

    torch.manual_seed(0)
    records = {}
    for i in range(files):
        blob = save({"hidden_states": torch.randn(tokens, 4, hidden).to(torch.bfloat16),
                     "token_ids": torch.randint(0, 1000, (tokens,))})
        (root / store.file_name(i)).write_bytes(blob)
        records[i] = {"index": i, "name": store.file_name(i), "bytes": len(blob),
                      "sha256": hashlib.sha256(blob).hexdigest(), "tokens": tokens}
    return records


def read_all(transfer, files: int) -> float:
    """CPU seconds to read (and touch) every file once."""
    started = time.process_time()
    for i in range(files):
        out = transfer.get_cached(i)
        float(out["hidden_states"].float().sum())
    return time.process_time() - started


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--files", type=int, default=24)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--hidden-size", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--rank-mb-s", type=float, default=95.0, help="per-rank read rate to express the cost at")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()

    import torch
    from hs_connectors import FileTransfer

    from draftlab.store.hidden_states import VerifiedTransfer

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        records = make_store(root, args.files, args.tokens, args.hidden_size)
        gb = sum(r["bytes"] for r in records.values()) / 1e9

        def fresh(mode):  # a new transfer per round: its verified-stat memo must not skip the work
            stock = FileTransfer(root)
            return stock if mode == "stock" else VerifiedTransfer(stock, root, records, full=mode == "sha256")

        modes = ["stock", "header", "sha256"]
        read_all(fresh("stock"), args.files)  # warm the page cache
        cpu = {m: [] for m in modes}
        for r in range(args.rounds):
            for m in modes[r % 3:] + modes[: r % 3]:
                cpu[m].append(read_all(fresh(m), args.files) / gb)
    stock = statistics.median(cpu["stock"])
    result = {"gb_per_round": round(gb, 3), "rounds": args.rounds, "modes": {}}
    print(f"{args.files} files × {args.tokens} tokens at H={args.hidden_size} ({gb:.2f} GB), {args.rounds} rounds, 1 thread")
    for m in modes:
        med, lo, hi = statistics.median(cpu[m]), min(cpu[m]), max(cpu[m])
        extra = med - stock
        core_frac = extra * args.rank_mb_s / 1000
        result["modes"][m] = {"cpu_s_per_gb": med, "spread": [lo, hi], "extra_cpu_s_per_gb": extra,
                              "extra_core_frac_at_rank_rate": core_frac}
        print(f"  {m:7s} {med:6.3f} CPU-s/GB (spread {lo:.3f}–{hi:.3f}); extra over stock {extra:+.3f} "
              f"= {core_frac:.1%} of a core at {args.rank_mb_s:g} MB/s per rank")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
