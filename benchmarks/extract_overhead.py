"""Is writing hidden states the bottleneck of `extract`? Extraction vs a bare forward pass.

Runs, on the same batches (`plan_batches` of one synthetic prepared dataset) and interleaved
round by round (A B C, A B C, …):

  A  extraction: `draftlab.stages.extract.run` on a fresh temp store (forward + LayerCapture
     + bf16 cast + safetensors `save` + `write_bytes_atomic` with fsync + sha256 + journal +
     manifest), its own tokens/s (model and dataset loading excluded);
  B  bare forward: `model.model(...)` on the same padded batches, nothing captured or written;
  C  write path alone: the per-file part of extract.run's loop (`save`, `write_bytes_atomic`,
     sha256, `journal.record`) on random bf16 [T, 4, H] tensors of the same lengths.

It prints tokens/s of each (median and min–max over rounds), the per-round ratio A / B (goal
≥ 0.85: writing hidden states must not be the bottleneck), the write path's MB/s, and bytes
per token on disk next to the analytic 4 × H × dtype bytes + 8 (the int64 token id).

The target is a random-init Llama built by draftlab's own `target` stage (pre-training off)
with `--hidden-size`/`--num-layers`: the tiny default (H=64) does so little compute per token
that any write looks expensive. `--target-dir models/target` uses an already built target
instead (run `draftlab target` first). Nothing here passes or fails on timing.

    python benchmarks/extract_overhead.py                       # H=1024, 7 layers, ~2-3 min on 2 cores
    python benchmarks/extract_overhead.py --hidden-size 2048 --tokens 2048
    python benchmarks/extract_overhead.py --target-dir models/target --tokens 16384
    python benchmarks/extract_overhead.py --json reports/extract_overhead.json
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

# The Kimi-K2.5 reference scenario: 4 layers x 7168 x bf16 (+ int64 id) per token, ~32 B active
# parameters per token (about 2 x 32e9 FLOP/token), for the write-intensity comparison.
REF_BYTES_PER_TOKEN = 4 * 7168 * 2 + 8
REF_GFLOP_PER_TOKEN = 2 * 32e9 / 1e9


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden-size", type=int, default=1024, help="H of the random-init Llama target")
    ap.add_argument("--num-layers", type=int, default=7, help="decoder layers (>= 7 for the default aux ids)")
    ap.add_argument("--target-dir", type=Path, default=None,
                    help="use this built target (e.g. models/target) instead of building one")
    ap.add_argument("--tokens", type=int, default=3072, help="real tokens per run (approximate)")
    ap.add_argument("--min-len", type=int, default=128, help="shortest synthetic sample")
    ap.add_argument("--max-len", type=int, default=384, help="longest synthetic sample")
    ap.add_argument("--batch-tokens", type=int, default=2048, help="extract.batch_tokens (padded tokens per forward)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
                    help="extract.dtype (stored hidden states)")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved repeats of A B C")
    ap.add_argument("--workdir", type=Path, default=None, help="where temp stores go (default: system temp)")
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    return ap.parse_args()


def spread(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "values": xs}


def build_target(args, work: Path):
    """(params, target_dir) for extract.run; the target is built by draftlab's target stage."""
    from draftlab.params import parse_params
    from draftlab.stages import target

    raw: dict = {"extract": {"batch_tokens": args.batch_tokens, "dtype": args.dtype}}
    if args.target_dir is not None:
        if not (args.target_dir / "config.json").exists():
            raise SystemExit(f"{args.target_dir}: no built target there; run `draftlab target` first")
        return parse_params(raw), args.target_dir
    h = args.hidden_size
    heads = max(h // 64, 1)
    raw["target"] = {"tiny": {
        "hidden_size": h,
        "num_layers": args.num_layers,
        "num_heads": heads,
        "num_kv_heads": max(heads // 4, 1),
        "intermediate_size": max(64, round(2.75 * h / 64) * 64),
        "max_position_embeddings": max(1024, args.max_len),
        "pretrain_steps": 0,  # random weights cost the same FLOPs and write the same bytes
    }}
    params = parse_params(raw)
    target_dir = work / "target"
    with quiet_console():
        target.run(params, out_dir=target_dir, report_path=work / "target.json")
    return params, target_dir


@contextlib.contextmanager
def quiet_console():
    """Silence draftlab's console and the libraries' progress bars around a stage call."""
    import datasets
    import transformers

    from draftlab.console import console

    before = console.quiet
    console.quiet = True
    datasets.disable_progress_bars()
    transformers.utils.logging.disable_progress_bar()
    try:
        yield
    finally:
        console.quiet = before


def synthetic_dataset(path: Path, args, vocab_size: int) -> list[int]:
    """A prepared dataset (`input_ids`, `loss_mask`, `seq_len`) of about args.tokens tokens."""
    from datasets import Dataset

    rng = random.Random(0)
    lens: list[int] = []
    while sum(lens) < args.tokens:
        lens.append(rng.randint(args.min_len, args.max_len))
    ids = [[rng.randrange(4, vocab_size) for _ in range(n)] for n in lens]
    Dataset.from_dict({"input_ids": ids, "loss_mask": [[1] * n for n in lens], "seq_len": lens}).save_to_disk(str(path))
    return lens


def padded_batches(data_dir: Path, batches: list[list[int]]):
    """The (input_ids, attention_mask) extract.run builds for each batch."""
    import torch
    from datasets import load_from_disk

    ds = load_from_disk(str(data_dir))
    out = []
    for batch in batches:
        rows = [ds[i]["input_ids"] for i in batch]
        width = max(map(len, rows))
        input_ids = torch.zeros((len(rows), width), dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for r, ids in enumerate(rows):
            input_ids[r, : len(ids)] = torch.as_tensor(ids)
            mask[r, : len(ids)] = 1
        out.append((input_ids, mask, sum(map(len, rows))))
    return out


def run_extraction(params, target_dir: Path, data_dir: Path, store_dir: Path) -> dict:
    from draftlab.stages import extract

    with quiet_console():
        t0 = time.perf_counter()
        res = extract.run(params, target_dir=target_dir, data_dir=data_dir, out_dir=store_dir)
        wall_s = time.perf_counter() - t0
    return {"tokens_per_s": res.tokens_per_s, "tokens": res.num_tokens, "bytes": res.total_bytes,
            "files": res.num_files, "call_wall_s": wall_s}


def run_bare_forward(model, batches) -> float:
    import torch

    tokens = 0
    t0 = time.perf_counter()
    with torch.no_grad():
        for input_ids, mask, n in batches:
            model.model(input_ids=input_ids.to(model.device), attention_mask=mask.to(model.device))
            tokens += n
    return tokens / (time.perf_counter() - t0)


def run_write_path(lens: list[int], batches: list[list[int]], hidden: int, dtype: str, store_dir: Path) -> dict:
    """extract.run's per-file write loop (save, atomic write + fsync, sha256, journal) alone."""
    import torch
    from safetensors.torch import save

    from draftlab import store
    from draftlab.util import write_bytes_atomic

    torch_dtype = getattr(torch, dtype)
    pool = torch.randn(max(lens), 4, hidden).to(torch_dtype)  # made before the clock starts
    journal = store.Journal.open(store_dir, "write-path-benchmark")
    tokens = nbytes = 0
    t0 = time.perf_counter()
    for batch in batches:
        records = []
        for i in batch:
            n = lens[i]
            blob = save({"hidden_states": pool[:n].contiguous(), "token_ids": torch.arange(n, dtype=torch.long)})
            write_bytes_atomic(store_dir / store.file_name(i), blob)
            records.append({"index": i, "name": store.file_name(i), "bytes": len(blob),
                            "sha256": hashlib.sha256(blob).hexdigest(), "tokens": n})
            tokens += n
            nbytes += len(blob)
        journal.record(records)
    dt = time.perf_counter() - t0
    return {"tokens_per_s": tokens / dt, "mb_per_s": nbytes / dt / 1e6}


def main() -> None:
    args = parse_args()
    from rich.console import Console

    from draftlab import store
    from draftlab.stages.extract import plan_batches
    from draftlab.stages.target import load_target

    out = Console(highlight=False)
    work = Path(tempfile.mkdtemp(prefix="draftlab-extract-bench-", dir=args.workdir))
    try:
        params, target_dir = build_target(args, work)
        with quiet_console():
            model, tokenizer = load_target(params, target_dir)
            data_dir = work / "prepared"
            lens = synthetic_dataset(data_dir, args, len(tokenizer))
        cfg = model.config
        hidden, num_layers = cfg.hidden_size, cfg.num_hidden_layers
        batches = plan_batches(lens, params.extract.batch_tokens)
        tensors = padded_batches(data_dir, batches)
        non_embed = sum(p.numel() for n, p in model.model.named_parameters() if "embed" not in n)
        gflop_per_token = 2 * non_embed / 1e9
        out.print(
            f"target: random-init Llama H={hidden}, {num_layers} layers, {non_embed / 1e6:.1f} M non-embedding "
            f"params ({params.target.dtype}), "
            f"{torch_threads()} torch threads; {len(lens)} samples, {sum(lens):,} tokens, "
            f"{len(batches)} batches of <= {params.extract.batch_tokens} padded tokens; {args.rounds} rounds A B C"
        )
        run_bare_forward(model, tensors[:1])  # warm-up (allocator, kernels) outside the rounds

        ext, bare, write, ratios = [], [], [], []
        for r in range(args.rounds):
            a = run_extraction(params, target_dir, data_dir, work / f"store-{r}")
            b = run_bare_forward(model, tensors)
            c = run_write_path(lens, batches, hidden, params.extract.dtype, work / f"write-{r}")
            ext.append(a)
            bare.append(b)
            write.append(c)
            ratios.append(a["tokens_per_s"] / b)
            out.print(f"  round {r + 1}: extraction {a['tokens_per_s']:,.0f} tok/s, bare forward {b:,.0f} tok/s, "
                      f"ratio {ratios[-1]:.3f}; write path alone {c['tokens_per_s']:,.0f} tok/s ({c['mb_per_s']:,.0f} MB/s)")
            shutil.rmtree(work / f"store-{r}", ignore_errors=True)
            shutil.rmtree(work / f"write-{r}", ignore_errors=True)

        measured_bpt = ext[0]["bytes"] / ext[0]["tokens"]
        analytic_bpt = store.bytes_per_token(hidden, params.extract.dtype)
        results = {
            "machine": {"cpus": os.cpu_count(), "torch_threads": torch_threads()},
            "target": {"hidden_size": hidden, "num_layers": num_layers, "non_embedding_params": non_embed,
                       "target_dtype": params.target.dtype, "built_here": args.target_dir is None},
            "data": {"samples": len(lens), "tokens": sum(lens), "batches": len(batches),
                     "batch_tokens": params.extract.batch_tokens, "stored_dtype": params.extract.dtype},
            "rounds": args.rounds,
            "extraction_tokens_per_s": spread([a["tokens_per_s"] for a in ext]),
            "bare_forward_tokens_per_s": spread(bare),
            "write_path_tokens_per_s": spread([c["tokens_per_s"] for c in write]),
            "write_path_mb_per_s": spread([c["mb_per_s"] for c in write]),
            "ratio_extraction_over_bare": spread(ratios),
            "ratio_goal": 0.85,
            "bytes_per_token_measured": measured_bpt,
            "bytes_per_token_analytic": analytic_bpt,
            "write_intensity_bytes_per_gflop": measured_bpt / gflop_per_token,
            "reference_write_intensity_bytes_per_gflop": REF_BYTES_PER_TOKEN / REF_GFLOP_PER_TOKEN,
        }
        print_table(out, results)
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(results, indent=2) + "\n")
            out.print(f"results → {args.json}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


def torch_threads() -> int:
    import torch

    return torch.get_num_threads()


def print_table(out, res: dict) -> None:
    from rich.table import Table

    from draftlab.store import DTYPE_BYTES

    def row(name, s, fmt="{:,.0f}"):
        return name, fmt.format(s["median"]), f"{fmt.format(s['min'])} – {fmt.format(s['max'])}"

    t = Table(title=f"extraction vs bare forward, H={res['target']['hidden_size']}, {res['rounds']} interleaved rounds")
    for col in ("measure", "median", "min – max"):
        t.add_column(col, justify="right" if col != "measure" else "left")
    t.add_row(*row("A extraction (extract.run), tok/s", res["extraction_tokens_per_s"]))
    t.add_row(*row("B bare forward (model.model), tok/s", res["bare_forward_tokens_per_s"]))
    t.add_row(*row("C write path alone, tok/s", res["write_path_tokens_per_s"]))
    t.add_row(*row("C write path alone, MB/s", res["write_path_mb_per_s"]))
    t.add_row(*row("ratio A / B (per round; goal >= 0.85)", res["ratio_extraction_over_bare"], "{:.3f}"))
    out.print(t)
    m, a = res["bytes_per_token_measured"], res["bytes_per_token_analytic"]
    h, dtype = res["target"]["hidden_size"], res["data"]["stored_dtype"]
    out.print(f"bytes per token on disk: {m:,.1f} measured (file bytes / tokens) vs {a:,} analytic "
              f"(4 x {h} x {DTYPE_BYTES[dtype]} B {dtype} + 8 B token id); safetensors headers add {m / a - 1:+.2%}")
    out.print(f"write intensity: {res['write_intensity_bytes_per_gflop']:,.0f} B written per forward GFLOP here vs "
              f"~{res['reference_write_intensity_bytes_per_gflop']:,.0f} for the Kimi-K2.5 reference scenario "
              "(higher = writes weigh more than they will there)")
    r = res["ratio_extraction_over_bare"]
    out.print(f"RESULT extraction/bare-forward ratio: median {r['median']:.3f} (min {r['min']:.3f}, max {r['max']:.3f}); "
              f"goal >= {res['ratio_goal']}")


if __name__ == "__main__":
    main()
