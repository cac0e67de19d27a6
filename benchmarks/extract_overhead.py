"""Is writing hidden states the bottleneck of `extract`? Extraction vs a bare forward pass.

Same batches (`plan_batches` of one synthetic prepared dataset), same target, measured side by
side in every round:

  P  paired, batch by batch (the robust number on a shared machine): for each batch, one
     extraction step (forward + LayerCapture + cast + safetensors `save` + `write_bytes_atomic`
     with fsync + sha256 + `journal.record`, i.e. the body of extract.run's loop) and one bare
     forward (`model.model(...)`, nothing captured or written), their order alternating from
     batch to batch; ratio = extraction tok/s / bare tok/s over the round;
  E  end to end: `draftlab.stages.extract.run` on a fresh temp store (its own tok/s: model and
     dataset loading excluded, journal and manifest included), divided by P's bare tok/s of the
     same round;
  C  write path alone: P's per-file part (`save`, atomic write, sha256, journal) on random
     [T, 4, H] tensors of the same lengths, in MB/s and the tok/s it could sustain.

Goal: ratio >= 0.85 (writing hidden states must not be the bottleneck). Also printed: bytes
per token on disk next to the analytic 4 x H x dtype bytes + 8 (the int64 token id), and how
write-heavy this target is next to the Kimi-K2.5 reference scenario.

The target is a random-init Llama built with draftlab's tiny-target code (no pre-training),
sized by `--hidden-size`/`--num-layers`: the tiny default (H=64) does so little compute per
token that any write looks expensive. `--target-dir models/target` uses a built target instead
(`draftlab target` builds it). Nothing here passes or fails on timing.

    python benchmarks/extract_overhead.py                  # H=1024, 7 layers, 1 thread: ~2-3 min
    python benchmarks/extract_overhead.py --hidden-size 2048 --tokens 1024
    python benchmarks/extract_overhead.py --target-dir models/target --tokens 16384
    python benchmarks/extract_overhead.py --threads 0 --json reports/extract_overhead.json
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
# parameters per token (~2 x 32e9 FLOP/token): how many bytes it writes per forward GFLOP.
REF_BYTES_PER_TOKEN = 4 * 7168 * 2 + 8
REF_GFLOP_PER_TOKEN = 2 * 32e9 / 1e9


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden-size", type=int, default=1024, help="H of the random-init Llama target")
    ap.add_argument("--num-layers", type=int, default=7, help="decoder layers (>= 7 for the default aux ids)")
    ap.add_argument("--target-dir", type=Path, default=None,
                    help="use this built target (e.g. models/target) instead of building one")
    ap.add_argument("--tokens", type=int, default=1536, help="real tokens per run (approximate)")
    ap.add_argument("--min-len", type=int, default=128, help="shortest synthetic sample")
    ap.add_argument("--max-len", type=int, default=384, help="longest synthetic sample")
    ap.add_argument("--batch-tokens", type=int, default=768, help="extract.batch_tokens (padded tokens per forward)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
                    help="extract.dtype (stored hidden states)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch CPU threads (0 = torch's default). 1 by default: on a shared machine a "
                    "descheduled OpenMP thread stalls every parallel region (10x swings seen on 2 cores); "
                    "a faster multi-threaded forward makes writes weigh more, so try 0 on a dedicated host")
    ap.add_argument("--rounds", type=int, default=4, help="rounds of P E C (E first in odd rounds)")
    ap.add_argument("--workdir", type=Path, default=None, help="where temp stores go (default: system temp)")
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    return ap.parse_args()


def spread(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "values": xs}


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


def build_target(args, work: Path):
    """(params, target_dir) for extract.run: a random-init target built with the tiny target's
    own architecture code and tokenizer, saved as the `target` stage saves it (the stage itself
    is skipped: its greedy-generation probes take minutes at H=1024 on 2 cores)."""
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
    tokenizer = target.build_tokenizer()
    with quiet_console():
        target.build_model(params.target.tiny, tokenizer).save_pretrained(target_dir)
    tokenizer.save_pretrained(target_dir)
    return params, target_dir


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


def pad_batch(ds, batch: list[int], pad: int = 0):
    """input_ids, attention_mask and real tokens of one batch, built as extract.run builds them."""
    import torch

    rows = [ds[i]["input_ids"] for i in batch]
    width = max(map(len, rows))
    input_ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for r, ids in enumerate(rows):
        input_ids[r, : len(ids)] = torch.as_tensor(ids)
        mask[r, : len(ids)] = 1
    return input_ids, mask, [len(r) for r in rows]


def extract_batch(model, capture, ds, batch: list[int], *, out_dir: Path, torch_dtype) -> list[dict]:
    """The body of extract.run's loop for one batch (forward, capture, write each file); returns
    the journal records. A copy: replace it by `draftlab.stages.extract.extract_batch` once
    extract.run is factored that way, so the two can never drift."""
    import torch
    from safetensors.torch import save

    from draftlab.store import layout as store
    from draftlab.util import write_bytes_atomic

    input_ids, mask, lens = pad_batch(ds, batch)
    with torch.no_grad():
        model.model(input_ids=input_ids.to(model.device), attention_mask=mask.to(model.device))
    hidden_BT4H = capture.stacked().to(torch_dtype).cpu()
    records = []
    for r, i in enumerate(batch):
        n = lens[r]
        blob = save({"hidden_states": hidden_BT4H[r, :n].contiguous(), "token_ids": input_ids[r, :n].clone()})
        write_bytes_atomic(out_dir / store.file_name(i), blob)
        records.append({"index": i, "name": store.file_name(i), "bytes": len(blob),
                        "sha256": hashlib.sha256(blob).hexdigest(), "tokens": n})
    return records


def run_paired(model, params, ds, batches, padded, store_dir: Path, layer_ids, first: int) -> dict:
    """P: per batch, an extraction step and a bare forward, in alternating order."""
    import torch

    from draftlab.models import LayerCapture
    from draftlab.store import layout as store

    torch_dtype = getattr(torch, params.extract.dtype)
    journal = store.Journal.open(store_dir, "paired-benchmark")
    ext_s = bare_s = 0.0
    tokens = nbytes = 0
    for k, (batch, (input_ids, mask, lens)) in enumerate(zip(batches, padded)):
        for which in ((0, 1) if (k + first) % 2 == 0 else (1, 0)):
            t0 = time.perf_counter()
            if which == 0:
                capture = LayerCapture(model, layer_ids)
                try:
                    records = extract_batch(model, capture, ds, batch, out_dir=store_dir, torch_dtype=torch_dtype)
                    journal.record(records)
                finally:
                    capture.close()
                ext_s += time.perf_counter() - t0
                nbytes += sum(r["bytes"] for r in records)
            else:
                with torch.no_grad():
                    model.model(input_ids=input_ids, attention_mask=mask)
                bare_s += time.perf_counter() - t0
        tokens += sum(lens)
    return {"extraction_tokens_per_s": tokens / ext_s, "bare_tokens_per_s": tokens / bare_s,
            "tokens": tokens, "bytes": nbytes}


def run_end_to_end(params, target_dir: Path, data_dir: Path, store_dir: Path) -> dict:
    """E: the real stage function on a fresh store."""
    from draftlab.stages import extract

    with quiet_console():
        res = extract.run(params, target_dir=target_dir, data_dir=data_dir, out_dir=store_dir)
    return {"tokens_per_s": res.tokens_per_s, "tokens": res.num_tokens, "bytes": res.total_bytes}


def run_write_path(lens: list[int], batches: list[list[int]], hidden: int, dtype: str, store_dir: Path) -> dict:
    """C: the per-file part of the loop (save, atomic write + fsync, sha256, journal) alone."""
    import torch
    from safetensors.torch import save

    from draftlab.store import layout as store
    from draftlab.util import write_bytes_atomic

    pool = torch.randn(max(lens), 4, hidden).to(getattr(torch, dtype))  # made before the clock starts
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
    import torch
    from datasets import load_from_disk
    from rich.console import Console

    from draftlab.models import load_target
    from draftlab.store import layout as store
    from draftlab.store.capture import plan_batches

    if args.threads:
        torch.set_num_threads(args.threads)
    out = Console(highlight=False)
    work = Path(tempfile.mkdtemp(prefix="draftlab-extract-bench-", dir=args.workdir))
    try:
        params, target_dir = build_target(args, work)
        data_dir = work / "prepared"
        with quiet_console():
            model, tokenizer = load_target(params, target_dir)
            lens = synthetic_dataset(data_dir, args, len(tokenizer))
            ds = load_from_disk(str(data_dir))
        cfg = model.config
        hidden, num_layers = cfg.hidden_size, cfg.num_hidden_layers
        layer_ids = params.extract.layer_ids or store.default_layer_ids(num_layers)
        batches = plan_batches(lens, params.extract.batch_tokens)
        padded = [pad_batch(ds, b) for b in batches]
        non_embed = sum(p.numel() for n, p in model.model.named_parameters() if "embed" not in n)
        out.print(
            f"target: random-init Llama H={hidden}, {num_layers} layers, {non_embed / 1e6:.1f} M non-embedding "
            f"params ({params.target.dtype}), {torch.get_num_threads()} torch threads, {os.cpu_count()} CPUs; "
            f"{len(lens)} samples, {sum(lens):,} tokens, {len(batches)} batches of <= "
            f"{params.extract.batch_tokens} padded tokens; {args.rounds} rounds of P, E, C"
        )
        with torch.no_grad():  # warm-up (allocator, kernels) outside the rounds
            model.model(input_ids=padded[0][0], attention_mask=padded[0][1])

        paired, e2e, write = [], [], []
        for r in range(args.rounds):
            def p():
                paired.append(run_paired(model, params, ds, batches, padded, work / f"p-{r}", layer_ids, r))

            def e():
                e2e.append(run_end_to_end(params, target_dir, data_dir, work / f"e-{r}"))

            for step in ((p, e) if r % 2 == 0 else (e, p)):
                step()
            write.append(run_write_path(lens, batches, hidden, params.extract.dtype, work / f"c-{r}"))
            pr, er, cr = paired[-1], e2e[-1], write[-1]
            out.print(
                f"  round {r + 1}: P extraction {pr['extraction_tokens_per_s']:,.0f} vs bare {pr['bare_tokens_per_s']:,.0f} "
                f"tok/s (ratio {pr['extraction_tokens_per_s'] / pr['bare_tokens_per_s']:.3f}); E extract.run "
                f"{er['tokens_per_s']:,.0f} tok/s (ratio {er['tokens_per_s'] / pr['bare_tokens_per_s']:.3f}); "
                f"C write path {cr['tokens_per_s']:,.0f} tok/s, {cr['mb_per_s']:,.0f} MB/s"
            )
            for d in ("p", "e", "c"):
                shutil.rmtree(work / f"{d}-{r}", ignore_errors=True)

        bare = [p["bare_tokens_per_s"] for p in paired]
        measured_bpt = e2e[0]["bytes"] / e2e[0]["tokens"]
        results = {
            "machine": {"cpus": os.cpu_count(), "torch_threads": torch.get_num_threads()},
            "target": {"hidden_size": hidden, "num_layers": num_layers, "non_embedding_params": non_embed,
                       "target_dtype": params.target.dtype, "built_here": args.target_dir is None},
            "data": {"samples": len(lens), "tokens": sum(lens), "batches": len(batches),
                     "batch_tokens": params.extract.batch_tokens, "stored_dtype": params.extract.dtype},
            "rounds": args.rounds,
            "bare_forward_tokens_per_s": spread(bare),
            "paired_extraction_tokens_per_s": spread([p["extraction_tokens_per_s"] for p in paired]),
            "end_to_end_extraction_tokens_per_s": spread([e["tokens_per_s"] for e in e2e]),
            "write_path_tokens_per_s": spread([c["tokens_per_s"] for c in write]),
            "write_path_mb_per_s": spread([c["mb_per_s"] for c in write]),
            "ratio_paired": spread([p["extraction_tokens_per_s"] / p["bare_tokens_per_s"] for p in paired]),
            "ratio_end_to_end": spread([e["tokens_per_s"] / b for e, b in zip(e2e, bare)]),
            # If writes were serial with an otherwise unchanged forward: 1 / (1 + bare / write).
            "ratio_from_write_path": spread([1 / (1 + b / c["tokens_per_s"]) for b, c in zip(bare, write)]),
            "ratio_goal": 0.85,
            "bytes_per_token_measured": measured_bpt,
            "bytes_per_token_analytic": store.bytes_per_token(hidden, params.extract.dtype),
            "write_intensity_bytes_per_gflop": measured_bpt / (2 * non_embed / 1e9),
            "reference_write_intensity_bytes_per_gflop": REF_BYTES_PER_TOKEN / REF_GFLOP_PER_TOKEN,
        }
        report(out, results)
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(results, indent=2) + "\n")
            out.print(f"results → {args.json}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


def report(out, res: dict) -> None:
    from rich.table import Table

    from draftlab.store.layout import DTYPE_BYTES

    def row(name, s, fmt="{:,.0f}"):
        return name, fmt.format(s["median"]), f"{fmt.format(s['min'])} – {fmt.format(s['max'])}"

    t = Table(title=f"extraction vs bare forward, H={res['target']['hidden_size']}, {res['rounds']} rounds")
    t.add_column("measure")
    t.add_column("median", justify="right")
    t.add_column("min – max", justify="right")
    t.add_row(*row("bare forward (model.model), tok/s", res["bare_forward_tokens_per_s"]))
    t.add_row(*row("P extraction, batch-paired, tok/s", res["paired_extraction_tokens_per_s"]))
    t.add_row(*row("E extract.run end to end, tok/s", res["end_to_end_extraction_tokens_per_s"]))
    t.add_row(*row("C write path alone, tok/s", res["write_path_tokens_per_s"]))
    t.add_row(*row("C write path alone, MB/s", res["write_path_mb_per_s"]))
    t.add_row(*row("ratio P extraction / bare (goal >= 0.85)", res["ratio_paired"], "{:.3f}"))
    t.add_row(*row("ratio E extract.run / bare", res["ratio_end_to_end"], "{:.3f}"))
    t.add_row(*row("ratio implied by C: 1 / (1 + bare / C)", res["ratio_from_write_path"], "{:.3f}"))
    out.print(t)
    m, a = res["bytes_per_token_measured"], res["bytes_per_token_analytic"]
    h, dtype = res["target"]["hidden_size"], res["data"]["stored_dtype"]
    out.print(f"bytes per token on disk: {m:,.1f} measured (file bytes / tokens) vs {a:,} analytic "
              f"(4 x {h} x {DTYPE_BYTES[dtype]} B {dtype} + 8 B token id); safetensors headers add {m / a - 1:+.2%}")
    out.print(f"write intensity: {res['write_intensity_bytes_per_gflop']:,.0f} B written per forward GFLOP here vs "
              f"~{res['reference_write_intensity_bytes_per_gflop']:,.0f} in the Kimi-K2.5 reference scenario "
              "(higher = writes weigh more here than there)")
    rp, re_ = res["ratio_paired"], res["ratio_end_to_end"]
    out.print(f"RESULT extraction / bare forward: paired {rp['median']:.3f} ({rp['min']:.3f}–{rp['max']:.3f}), "
              f"extract.run {re_['median']:.3f} ({re_['min']:.3f}–{re_['max']:.3f}); goal >= {res['ratio_goal']}")


if __name__ == "__main__":
    main()
