"""The fp8 store against bf16 on the tiny default: what halving the store costs in accuracy.

One target and one prepared dataset (params.yaml merged with benchmarks/fp8_ab.yaml: 144 train,
144 validation rows), three stores extracted from it (float32 as the reference, bfloat16,
float8_e4m3fn), then per arm, same seed:

  bytes     the store's bytes on disk (manifest) and its ratio to bf16, next to the goal
            (4H + 12) / (8H + 8) + 0.5%
  error     per-layer relative error ||x - x_fp32|| / ||x_fp32|| of what speculators' reader
            returns (FP8Transfer dequantizes), with hs_connectors' one scale per token over all
            4 layers, and, for comparison, one scale per token and layer
  train     `draftlab.stages.train.run` (torchrun, speculators' trainer), `--repeats` times per arm,
            arms interleaved; tokens/s = median of the run's perf/tokens_per_s
  accept    simulated acceptance length (teacher-forced on the arm's own val store) and measured
            (speculative decoding of the held-out prompts with the trained draft), both with a
            paired bootstrap 95% interval of Δ = fp8 − bf16 over val samples / prompts

Nothing here passes or fails on timing. Measured on a shared 2-core VM: ~25-35 min.

    python benchmarks/fp8_ab.py --workdir /tmp/fp8-ab --json reports/fp8_ab.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

REPO = Path(__file__).resolve().parents[1]
ARMS = ("bfloat16", "float8_e4m3fn")


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", type=Path, default=REPO / "params.yaml")
    ap.add_argument("--overlay", type=Path, default=REPO / "benchmarks/fp8_ab.yaml")
    ap.add_argument("--repeats", type=int, default=3, help="trainings per arm (interleaved)")
    ap.add_argument("--bootstrap", type=int, default=2000, help="bootstrap resamples")
    ap.add_argument("--workdir", type=Path, default=None, help="kept if given (default: a temp dir, removed)")
    ap.add_argument("--json", type=Path, default=None)
    return ap.parse_args()


def load(args, **sections):
    import yaml

    from draftlab.params import merge, parse_params

    raw = merge(yaml.safe_load(args.params.read_text()), yaml.safe_load(args.overlay.read_text()))
    for name, values in sections.items():
        raw = merge(raw, {name: values})
    return parse_params(raw, str(args.overlay))


def layer_errors(stores: dict[str, Path], num_files: int) -> dict[str, list[float]]:
    """Per-layer relative error against the fp32 store, summed over every file (sum of squared
    errors / sum of squares), as speculators' readers return the states."""
    import torch
    from hs_connectors import FileTransfer, FP8Transfer
    from hs_connectors.fp8_utils import dequantize_fp8_tensor, quantize_tensor_to_fp8

    readers = {"bfloat16": FileTransfer(stores["bfloat16"]), "fp8 per token (stored)": FP8Transfer(stores["float8_e4m3fn"])}
    ref = FileTransfer(stores["float32"])
    err = {name: torch.zeros(4, dtype=torch.float64) for name in [*readers, "fp8 per token and layer"]}
    norm = torch.zeros(4, dtype=torch.float64)
    for i in range(num_files):
        x = ref.get_cached(i)["hidden_states"].double()  # [T, 4, H]
        norm += (x**2).sum(dim=(0, 2))
        for name, r in readers.items():
            err[name] += ((r.get_cached(i)["hidden_states"].double() - x) ** 2).sum(dim=(0, 2))
        per_layer = torch.stack([dequantize_fp8_tensor(*quantize_tensor_to_fp8(x[:, j].float()), dtype=torch.bfloat16)
                                 for j in range(4)], dim=1)
        err["fp8 per token and layer"] += ((per_layer.double() - x) ** 2).sum(dim=(0, 2))
    return {name: (e / norm).sqrt().tolist() for name, e in err.items()}


def median_metric(run_id: str, key: str) -> float:
    from draftlab import tracking

    hist = tracking.client().get_metric_history(run_id, key)
    return statistics.median(m.value for m in hist) if hist else float("nan")


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def acceptance(params, ctx, store_dir: Path, checkpoint: Path, prompts) -> dict:
    """Per val sample (simulated) and per prompt (measured) counts for one trained draft."""
    from draftlab.generation import stop_token_ids
    from draftlab.models import load_draft, resolve
    from draftlab.serve import specdec
    from draftlab.stages import evaluate
    from draftlab.store.hidden_states import source_for_store

    target, tokenizer = ctx["target"], ctx["tokenizer"]
    draft = load_draft(checkpoint, resolve(params, ctx["target_dir"]))
    packed = evaluate.simulated(params, draft, target, ctx["data_dir"], source_for_store(store_dir))
    per_sample: list[dict] = []
    evaluate.simulated(params, draft, target, ctx["data_dir"], source_for_store(store_dir),
                       batches=[[i] for i in range(ctx["num_val"])], per_batch=per_sample)
    k = params.train.ttt_steps
    sim = [[s[f"full_correct_{j}"] for j in range(k)] + [s[f"full_total_{j}"] for j in range(k)] for s in per_sample]
    measured = []
    for ids in prompts:
        spec = specdec.speculative_generate(target, draft, ids, num_speculative_tokens=k,
                                            max_new_tokens=params.evaluate.max_new_tokens,
                                            layer_ids=ctx["layer_ids"], stop_ids=stop_token_ids(tokenizer))
        measured.append([spec.drafts, sum(spec.accepted_per_pos)])
    return {"simulated_packed": packed["eval/simulated_acc_len"], "sim_counts": sim, "measured_counts": measured}


def sim_len(counts, k: int) -> float:
    tot = [sum(c[j] for c in counts) for j in range(2 * k)]
    return 1 + sum(tot[j] / max(tot[k + j], 1) for j in range(k))


def meas_len(counts) -> float:
    drafts, acc = sum(c[0] for c in counts), sum(c[1] for c in counts)
    return 1 + acc / drafts if drafts else 1.0


def paired_bootstrap(a, b, stat, n: int, seed: int = 0) -> dict:
    """Δ = stat(b) − stat(a) with the same resampled units in both arms; percentile 95% interval."""
    import numpy as np

    rng = np.random.default_rng(seed)
    m = len(a)
    deltas = []
    for _ in range(n):
        idx = rng.integers(0, m, m)
        deltas.append(stat([b[i] for i in idx]) - stat([a[i] for i in idx]))
    lo, hi = np.percentile(deltas, [2.5, 97.5])
    return {"delta": stat(b) - stat(a), "ci95": [float(lo), float(hi)], "units": m}


def main() -> None:
    args = parse_args()
    import torch

    from draftlab.models import load_target
    from draftlab.rundir import prepare_record
    from draftlab.stages import extract, prepare, target, train
    from draftlab.store import layout as store

    torch.set_num_threads(1)
    work = args.workdir or Path(tempfile.mkdtemp(prefix="draftlab-fp8-ab-"))
    work.mkdir(parents=True, exist_ok=True)
    os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{work / 'mlflow.db'}"
    base = load(args)
    t0 = time.perf_counter()
    try:
        target_dir, data_dir = work / "target", work / "prepared"
        if not (target_dir / "config.json").exists():
            target.run(base, out_dir=target_dir, report_path=work / "target.json")
        if not prepare_record(data_dir).exists():
            prepare.run(base, target_dir=target_dir, out_dir=data_dir)
        stores, extracted = {}, {}
        for dtype in ("float32", *ARMS):
            stores[dtype] = work / f"hs-{dtype}"
            extracted[dtype] = extract.run(load(args, extract={"dtype": dtype}), target_dir=target_dir,
                                           data_dir=data_dir, out_dir=stores[dtype])
        m = {d: store.read_manifest(stores[d]) for d in stores}
        h = m["bfloat16"]["target"]["hidden_size"]
        errors = layer_errors(stores, m["bfloat16"]["num_files"])

        runs = {a: [] for a in ARMS}
        for r in range(args.repeats):
            for arm in ARMS if r % 2 == 0 else ARMS[::-1]:
                p = load(args, extract={"dtype": arm})
                res = train.run(p, target_dir=target_dir, data_dir=data_dir, store_dir=stores[arm],
                                out_dir=work / f"train-{arm}-{r}")
                runs[arm].append({"run_id": res.run_id, "wall_clock_s": res.wall_clock_s,
                                  "tokens_per_s": median_metric(res.run_id, "perf/tokens_per_s"),
                                  "checkpoint": str(res.checkpoint),
                                  "weights_sha256": sha256(Path(res.checkpoint) / "model.safetensors")})
                print(f"train {arm} repeat {r + 1}: {runs[arm][-1]['tokens_per_s']:,.0f} tok/s "
                      f"(median of perf/tokens_per_s), {res.wall_clock_s:.0f} s", flush=True)

        from datasets import load_from_disk

        from draftlab.serve.specdec import held_out_prompts

        ds = load_from_disk(str(data_dir))
        num_val = len(ds) - int(len(ds) * base.data.train_ratio)
        model, tokenizer = load_target(base, target_dir)
        ctx = {"target": model, "tokenizer": tokenizer, "target_dir": target_dir, "data_dir": data_dir,
               "num_val": num_val, "layer_ids": m["bfloat16"]["layer_ids"]}
        prompts = held_out_prompts(data_dir, base.data.train_ratio, base.evaluate.num_prompts)
        k = base.train.ttt_steps
        evals = {}
        for arm in ARMS:  # one evaluation per distinct trained draft
            for run in runs[arm]:
                key = run["weights_sha256"]
                if key not in evals:
                    evals[key] = acceptance(load(args, extract={"dtype": arm}), ctx, stores[arm],
                                            Path(run["checkpoint"]), prompts)
                run["simulated_acc_len"] = sim_len(evals[key]["sim_counts"], k)
                run["simulated_acc_len_packed"] = evals[key]["simulated_packed"]
                run["measured_acc_len"] = meas_len(evals[key]["measured_counts"])
        pairs = []
        for rb, rf in zip(runs["bfloat16"], runs["float8_e4m3fn"]):
            eb, ef = evals[rb["weights_sha256"]], evals[rf["weights_sha256"]]
            pairs.append({
                "simulated": paired_bootstrap(eb["sim_counts"], ef["sim_counts"], lambda c: sim_len(c, k), args.bootstrap),
                "measured": paired_bootstrap(eb["measured_counts"], ef["measured_counts"], meas_len, args.bootstrap),
            })
        results = {
            "machine": {"cpus": os.cpu_count(), "torch_threads_eval": 1},
            "shape": {"hidden_size": h, "files": m["bfloat16"]["num_files"], "tokens": m["bfloat16"]["num_tokens"],
                      "val_samples": num_val, "prompts": len(prompts)},
            "bytes": {d: m[d]["total_bytes"] for d in m},
            "bytes_ratio_fp8_over_bf16": m["float8_e4m3fn"]["total_bytes"] / m["bfloat16"]["total_bytes"],
            "bytes_goal": (4 * h + 12) / (8 * h + 8) + 0.005,
            "extract_tokens_per_s": {d: extracted[d].tokens_per_s for d in extracted},
            "layer_rel_error_vs_fp32": errors,
            "train": runs,
            "tokens_per_s_ratio_fp8_over_bf16": [rf["tokens_per_s"] / rb["tokens_per_s"]
                                                 for rb, rf in zip(runs["bfloat16"], runs["float8_e4m3fn"])],
            "distinct_drafts": {a: len({r["weights_sha256"] for r in runs[a]}) for a in ARMS},
            "delta_fp8_minus_bf16": pairs,
            "wall_clock_s": time.perf_counter() - t0,
        }
        report(results)
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(results, indent=2) + "\n")
            print(f"results → {args.json}")
    finally:
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)


def report(res: dict) -> None:
    s = res["shape"]
    print(f"\nstore: H = {s['hidden_size']}, {s['files']} files, {s['tokens']:,} tokens; "
          f"{s['val_samples']} val samples, {s['prompts']} held-out prompts")
    b = res["bytes"]
    print(f"bytes on disk: bf16 {b['bfloat16']:,}, fp8 {b['float8_e4m3fn']:,}: ratio "
          f"{res['bytes_ratio_fp8_over_bf16']:.4f} (goal <= {res['bytes_goal']:.4f})")
    print("per-layer relative error vs the fp32 store (aux0, aux1, aux2, final pre-norm):")
    for name, e in res["layer_rel_error_vs_fp32"].items():
        print(f"  {name:26s} " + "  ".join(f"{x:.4f}" for x in e))
    ratios = res["tokens_per_s_ratio_fp8_over_bf16"]
    print(f"train tokens/s fp8/bf16 per interleaved pair: " + ", ".join(f"{r:.3f}" for r in ratios)
          + f" (median {statistics.median(ratios):.3f})")
    print(f"distinct trained drafts per arm (same seed): {res['distinct_drafts']}")
    for arm, runs in res["train"].items():
        print(f"  {arm}: simulated " + ", ".join(f"{r['simulated_acc_len']:.4f}" for r in runs)
              + "; measured " + ", ".join(f"{r['measured_acc_len']:.4f}" for r in runs))
    for i, p in enumerate(res["delta_fp8_minus_bf16"]):
        sm, ms = p["simulated"], p["measured"]
        print(f"RESULT pair {i + 1}: Δ simulated {sm['delta']:+.4f} [{sm['ci95'][0]:+.4f}, {sm['ci95'][1]:+.4f}] "
              f"over {sm['units']} val samples; Δ measured {ms['delta']:+.4f} [{ms['ci95'][0]:+.4f}, "
              f"{ms['ci95'][1]:+.4f}] over {ms['units']} prompts (goal |Δ| <= 0.02)")


if __name__ == "__main__":
    main()
