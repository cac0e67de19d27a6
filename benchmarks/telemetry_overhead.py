"""Does the telemetry sampler slow training? Tokens/s of a training-like loop with and without
`draftlab.observe.telemetry.TelemetrySampler` running, side by side in one process.

The loop is a small pre-norm MLP block stack trained with AdamW on random [tokens, H] inputs
(forward, backward, optimizer step, a little Python per step like a trainer's bookkeeping),
using every core torch is given. Blocks of `--block-s` seconds alternate A (no sampler) and
B (sampler at `--interval`, default 2 s as in training), the order flipping each pair; the
result is the median over pairs of B/A tokens/s, with the min–max spread. Also printed: the
cost of one sample (ms of CPU on the calling thread), i.e. the overhead bound interval ÷ cost.

Goal: B/A ≥ 0.99 (≤ 1 % cost). Nothing passes or fails on timing.

    python benchmarks/telemetry_overhead.py                      # ~1 min
    python benchmarks/telemetry_overhead.py --pairs 10 --interval 0.5
    python benchmarks/telemetry_overhead.py --json reports/telemetry_overhead.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden-size", type=int, default=512, help="width of the MLP blocks")
    ap.add_argument("--layers", type=int, default=4, help="MLP blocks")
    ap.add_argument("--tokens", type=int, default=512, help="tokens per step")
    ap.add_argument("--block-s", type=float, default=5.0, help="seconds per A or B block")
    ap.add_argument("--pairs", type=int, default=6, help="A/B pairs (order alternates)")
    ap.add_argument("--interval", type=float, default=2.0, help="sampler interval (default: training's 2 s)")
    ap.add_argument("--path", type=Path, default=Path("."), help="whose block device the sampler watches")
    ap.add_argument("--device", default="cpu", help="torch device of the loop (cuda: synchronized each step, as "
                    "a profiled trainer is)")
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    return ap.parse_args()


def build(hidden: int, layers: int, device: str):
    import torch

    blocks = [torch.nn.Sequential(torch.nn.LayerNorm(hidden), torch.nn.Linear(hidden, 4 * hidden),
                                  torch.nn.GELU(), torch.nn.Linear(4 * hidden, hidden)) for _ in range(layers)]
    model = torch.nn.ModuleList(blocks).to(device)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def run_block(model, opt, tokens: int, hidden: int, seconds: float) -> float:
    """Train for `seconds`; return tokens/s."""
    import torch

    device = next(model.parameters()).device
    x = torch.randn(tokens, hidden, device=device)
    done, started = 0, time.perf_counter()
    history = []
    while time.perf_counter() - started < seconds:
        h = x
        for block in model:
            h = h + block(h)
        loss = h.square().mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        history.append({"loss": float(loss.detach()), "step": len(history)})  # syncs, like a logged step
        done += tokens
    return done / (time.perf_counter() - started)


def main() -> None:
    from draftlab.observe.telemetry import TelemetrySampler
    from draftlab.tracking import RecordingTracker

    args = parse_args()
    model, opt = build(args.hidden_size, args.layers, args.device)
    run_block(model, opt, args.tokens, args.hidden_size, 1.0)  # warm-up: allocator, kernels

    probe = TelemetrySampler(args.path, None, interval_s=args.interval)
    t0 = time.thread_time()
    n_probe = 50
    for _ in range(n_probe):
        probe.sample_once()
    sample_cpu_ms = (time.thread_time() - t0) / n_probe * 1000
    probe.stop()

    ratios, a_runs, b_runs, logged = [], [], [], 0
    for i in range(args.pairs):
        results = {}
        for mode in (("A", "B") if i % 2 == 0 else ("B", "A")):
            if mode == "A":
                results["A"] = run_block(model, opt, args.tokens, args.hidden_size, args.block_s)
            else:
                tracker = RecordingTracker()
                with TelemetrySampler(args.path, tracker, interval_s=args.interval):
                    results["B"] = run_block(model, opt, args.tokens, args.hidden_size, args.block_s)
                logged += len(tracker.metrics)
        a_runs.append(results["A"])
        b_runs.append(results["B"])
        ratios.append(results["B"] / results["A"])
        print(f"pair {i}: A {results['A']:,.0f} tok/s, B {results['B']:,.0f} tok/s, B/A {ratios[-1]:.4f}")

    med = statistics.median(ratios)
    res = {
        "interval_s": args.interval, "block_s": args.block_s, "pairs": args.pairs,
        "ratio_b_over_a": {"median": med, "min": min(ratios), "max": max(ratios), "values": ratios},
        "tokens_per_s_a_median": statistics.median(a_runs), "tokens_per_s_b_median": statistics.median(b_runs),
        "samples_logged": logged, "sample_cpu_ms": sample_cpu_ms,
        "overhead_bound_pct": 100 * sample_cpu_ms / 1000 / args.interval,
        "block_device": probe.device, "loop_device": args.device,
    }
    print(f"one sample costs {sample_cpu_ms:.2f} ms of CPU → at most {res['overhead_bound_pct']:.3f} % of one core "
          f"at a {args.interval:g} s interval ({logged} samples logged during B blocks; device {probe.device})")
    print(f"RESULT with sampler / without: median {med:.4f} (spread {min(ratios):.4f}–{max(ratios):.4f}) "
          f"over {args.pairs} interleaved pairs of {args.block_s:g} s; goal ≥ 0.99")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(res, indent=2) + "\n")
        print(f"results → {args.json}")


if __name__ == "__main__":
    main()
