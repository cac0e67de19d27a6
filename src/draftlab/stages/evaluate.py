"""The `evaluate` stage: how many tokens the draft saves per target forward pass.

Predicted: on the validation split, per TTT step k, loss, `full_acc_k` and `cond_acc_k`, with the
target's argmax taken over the *full* vocabulary (speculators' own metric compares argmaxes
over the draft vocabulary, which overstates acceptance whenever the target's token lies outside
it: here such a token counts as a rejection). `eval/simulated_acc_len` = 1 + Σ_k full_acc_k,
tokens per target forward with the bonus token, vLLM's convention for its mean acceptance length.

Measured: real greedy speculative decoding of held-out prompts (`draftlab.serve.specdec`), with
`eval/measured_acc_len` = 1 + accepted / drafts, acceptance per position, and target forward
passes saved against plain greedy decoding.

With `evaluate.backend: vllm`, vLLM judges the draft too, on the same prompts: it serves the target
with the exported draft (`--speculative-config`, as the export's README tells a user) and the
target alone (`draftlab.serve.serving`), and its own counters give `eval/vllm_measured_acc_len` and
`eval/vllm_accept_rate_k`, beside output tokens/s with and without the draft and whether the greedy
outputs are identical. `eval/vllm_minus_measured_acc_len` ± `eval/vllm_minus_measured_se` (per-prompt
differences) and `eval/vllm_differs_from_measured` say whether vLLM's figure and draftlab's differ by
more than their spread (docs/serving.md says why they can). All of it goes to the training run in MLflow and to
`reports/metrics.json` (DVC metrics), with per-step curves as DVC plots and PNG figures.

    draftlab evaluate --params params.yaml --train runs/train --out reports
"""

from __future__ import annotations

import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from draftlab.params import Params
from draftlab.rundir import RunDir
from draftlab.store import layout as store
from draftlab.store.hidden_states import HiddenStateSource, source_for
from draftlab.training import metrics as train_metrics
from draftlab.util import write_json_atomic


@dataclass(frozen=True)
class EvaluateResult:
    metrics: dict


def simulated(params: Params, draft, target, data_dir: Path, source: HiddenStateSource, *,
              batches: list[list[int]] | None = None, per_batch: list[dict] | None = None) -> dict:
    """Teacher-forced validation metrics per TTT step, full-vocabulary target argmax, on the hidden
    states `source` reads (draftlab.store.hidden_states). `batches`
    (val-split indices) replaces the trainer's packing; `per_batch` collects each batch's counts
    (for a bootstrap over samples: benchmarks/fp8_ab.py)."""
    import torch

    from draftlab.plan.sampler import sampler_class
    from draftlab.training.compat import eagle3_collate

    t = params.train
    # exactly the trainer's validation batches: its reader, packing sampler and eagle3 preprocess
    ds = source.dataset(data_dir, split="val", max_len=t.total_seq_len,
                        train_ratio=params.data.train_ratio, hidden_states_dtype=t.hidden_states_dtype)
    collate = eagle3_collate(t.total_seq_len, target.config.hidden_size, t.hidden_states_dtype)
    sampler = sampler_class()(batch_max_length=t.total_seq_len, lengths=ds.approx_lengths,
                              num_replicas=1, rank=0, seed=0)
    steps = t.ttt_steps
    d2t, in_draft_vocab = draft.d2t.long(), draft.t2d.bool()
    keys = ("loss", "full_correct", "full_total", "cond_total", "spec_full_correct")
    sums = {f"{k}_{s}": 0.0 for s in range(steps) for k in keys}
    oov = total_masked = n_batches = 0
    for indices in sampler if batches is None else batches:
        before = dict(sums)
        batch = {k: v.to(target.device) if hasattr(v, "to") else v for k, v in collate([ds[i] for i in indices]).items()}
        with torch.no_grad():
            logits_steps, spec = draft_forward(draft, batch, steps)
            h = batch["verifier_last_hidden_states"].to(target.dtype)
            tgt = target.lm_head(target.model.norm(h)).argmax(-1)  # [1, T]: full vocabulary
        mask = batch["loss_mask"].bool()
        oov += int((mask & ~in_draft_vocab[tgt]).sum())
        total_masked += int(mask.sum())
        # prev is indexed by the position a draft chain starts from (speculators' prev_correct)
        prev, T = mask.clone(), mask.shape[1]
        for s, logits in enumerate(logits_steps):
            pred = logits.argmax(-1)
            pred_t = (pred + d2t[pred])[:, : T - s]  # draft vocab → target ids
            chain = prev[:, : T - s]
            sums[f"cond_total_{s}"] += float(chain.sum())
            correct = chain & (pred_t == tgt[:, s:])  # an out-of-draft-vocab target never matches
            prev[:, : T - s] = correct
            m = mask[:, s:]
            sums[f"full_correct_{s}"] += float((correct & m).sum())
            sums[f"full_total_{s}"] += float(m.sum())
            sums[f"loss_{s}"] += float(spec.get(f"loss_{s}_sum", torch.tensor(0.0)))
            sums[f"spec_full_correct_{s}"] += float(spec.get(f"full_acc_{s}_sum", torch.tensor(0.0)))
        n_batches += 1
        if per_batch is not None:
            per_batch.append({k: v - before[k] for k, v in sums.items()})
    out = {}
    for s in range(steps):
        out[f"eval/loss_{s}"] = sums[f"loss_{s}"] / max(n_batches, 1)
        out[f"eval/full_acc_{s}"] = sums[f"full_correct_{s}"] / max(sums[f"full_total_{s}"], 1)
        out[f"eval/cond_acc_{s}"] = sums[f"full_correct_{s}"] / max(sums[f"cond_total_{s}"], 1)
        out[f"eval/draft_vocab_full_acc_{s}"] = sums[f"spec_full_correct_{s}"] / max(sums[f"full_total_{s}"], 1)
    out["eval/simulated_acc_len"] = 1 + sum(out[f"eval/full_acc_{s}"] for s in range(steps))
    out["eval/simulated_acc_len_draft_vocab"] = 1 + sum(out[f"eval/draft_vocab_full_acc_{s}"] for s in range(steps))
    out["eval/target_token_oov_frac"] = oov / max(total_masked, 1)
    out["eval/val_samples"] = len(ds)
    return out


def draft_forward(draft, batch, steps: int, loss_implementation: str = "eager"):
    """speculators' own teacher-forced forward with its validation kwargs: its metrics, and
    each TTT step's logits (captured at the draft's lm_head)."""
    kwargs = type(draft).get_trainer_kwargs(loss_fn="kl_div", loss_implementation=loss_implementation,
                                            ttt_steps=steps, ttt_step_loss_decay=1.0)[1]
    captured = []
    handle = draft.lm_head.register_forward_hook(lambda m, a, out: captured.append(out))
    try:
        _, _, metrics = draft(**{k: v for k, v in batch.items() if k != "error_records"}, **kwargs)
    finally:
        handle.remove()
    return captured[:steps], metrics


def measured(params: Params, draft, target, tokenizer, prompts: list[list[int]], layer_ids: list[int],
             per_prompt: list | None = None) -> dict:
    """draftlab's own greedy speculative decoding of `prompts`. `per_prompt`, when given, receives
    each prompt's acceptance length and the target's plain greedy tokens (to set beside vLLM's)."""
    from draftlab.generation import stop_token_ids
    from draftlab.serve import specdec

    k = params.evaluate.num_speculative_tokens or params.train.ttt_steps
    stops = stop_token_ids(tokenizer)
    stats = specdec.AcceptanceStats(num_speculative_tokens=k)
    for ids in prompts:
        spec = specdec.speculative_generate(target, draft, ids, num_speculative_tokens=k,
                                            max_new_tokens=params.evaluate.max_new_tokens,
                                            layer_ids=layer_ids, stop_ids=stops)
        plain = specdec.plain_greedy(target, ids, max_new_tokens=params.evaluate.max_new_tokens, stop_ids=stops)
        stats.add(spec, plain)
        if per_prompt is not None:
            per_prompt.append({"acc_len": 1.0 + sum(spec.accepted_per_pos) / spec.drafts if spec.drafts else 1.0,
                               "drafts": spec.drafts, "plain_tokens": list(plain.tokens)})
    out = {
        "eval/measured_acc_len": stats.mean_acceptance_length,
        "eval/num_speculative_tokens": k,
        "eval/drafts": stats.drafts,
        "eval/target_forwards": stats.target_forwards,
        "eval/plain_forwards": stats.plain_forwards,
        "eval/forward_passes_saved_frac": stats.forward_passes_saved / max(stats.plain_forwards, 1),
        "eval/lossless": float(stats.lossless_mismatches == 0),
        "eval/prompts": stats.prompts,
    }
    for pos, rate in enumerate(stats.acceptance_per_position):
        out[f"eval/accept_rate_{pos}"] = rate
    return out


def _vllm(params: Params, prompts, *, target_dir: Path, train_dir: Path, store_dir: Path, out_dir: Path,
          stop_token_ids: list[int], hf_per_prompt: list[dict]) -> dict:
    """vLLM serving the exported draft (as the export's README serves it) and the target alone, on
    the prompts draftlab measured; its figures as eval/vllm_*, set beside draftlab's own."""
    import tempfile

    from draftlab.models import resolve
    from draftlab.serve import serving
    from draftlab.serve.draft_export import export_draft

    out_dir.mkdir(parents=True, exist_ok=True)
    runs: dict = {}
    with tempfile.TemporaryDirectory(prefix=".vllm-draft-", dir=out_dir) as scratch:
        draft_dir = Path(scratch) / "draft"
        export_draft(params, target_dir=target_dir, train_dir=train_dir, store_dir=store_dir, out_dir=draft_dir)
        vllm = serving.run_benchmark(
            target=resolve(params, target_dir), draft_dir=draft_dir, prompts=prompts,
            num_speculative_tokens=params.evaluate.num_speculative_tokens or params.train.ttt_steps,
            max_tokens=params.evaluate.max_new_tokens, port=params.evaluate.vllm_port,
            gpu_memory_utilization=params.evaluate.vllm_gpu_memory_utilization, log_dir=out_dir / "vllm",
            stop_token_ids=stop_token_ids, dtype=params.target.dtype, runs_out=runs,
            revision=params.target.revision if params.target.source == "hub" else None,
            trust_remote_code=params.target.trust_remote_code)
    vllm.update(compare_with_vllm(hf_per_prompt, runs["speculative"]["per_prompt"], runs["plain"]["token_ids"]))
    return vllm


def compare_with_vllm(hf_per_prompt: list[dict], vllm_per_prompt: list[dict], vllm_plain_tokens: list[list[int]]) -> dict:
    """vLLM's acceptance length against draftlab's on the same prompts: the mean per-prompt
    difference (vLLM − draftlab), its standard error, and whether it exceeds twice that (the
    figures differ by more than their spread); and the share of prompts where vLLM's plain greedy
    tokens equal the HF target's (a dtype or kernel difference shows here first)."""
    import statistics

    diffs = [v["mean_acceptance_length"] - h["acc_len"]
             for h, v in zip(hf_per_prompt, vllm_per_prompt, strict=True) if h["drafts"] and v["num_drafts"]]
    mean = statistics.fmean(diffs) if diffs else 0.0
    se = statistics.stdev(diffs) / len(diffs) ** 0.5 if len(diffs) > 1 else 0.0
    same = sum(h["plain_tokens"] == list(v) for h, v in zip(hf_per_prompt, vllm_plain_tokens, strict=True))
    return {"eval/vllm_minus_measured_acc_len": mean, "eval/vllm_minus_measured_se": se,
            "eval/vllm_differs_from_measured": float(len(diffs) > 1 and abs(mean) > 2 * se),
            "eval/vllm_hf_greedy_match_frac": same / max(len(hf_per_prompt), 1)}


def leading_first(metrics: dict) -> dict:
    """The acceptance lengths, then the validation loss per TTT step, then the rest: what a user
    compares across runs comes first in `dvc exp show` and `dvc metrics show`, which list columns
    in the order of the file's keys."""
    lead = [k for k in ("eval/simulated_acc_len", "eval/measured_acc_len", "eval/vllm_measured_acc_len")
            if k in metrics]
    lead += [f"eval/loss_{s}" for s in range(len(metrics)) if f"eval/loss_{s}" in metrics]
    return {**{k: metrics[k] for k in lead}, **metrics}


def _figures(train_dir: Path, metrics: dict, steps: int, out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    fig, ax = plt.subplots(figsize=(6, 3.5))
    pos = list(range(steps))
    ax.bar([p - 0.2 for p in pos], [metrics.get(f"eval/full_acc_{s}", 0) for s in pos], 0.4, label="predicted (val full_acc_k)")
    ax.bar([p + 0.2 for p in pos], [metrics.get(f"eval/accept_rate_{s}", 0) for s in pos], 0.4, label="measured (spec. decoding)")
    ax.set_xlabel("draft position k"), ax.set_ylabel("acceptance"), ax.set_ylim(0, 1), ax.legend()
    ax.set_title("acceptance by position")
    fig.tight_layout()
    paths.append(out_dir / "acceptance_by_position.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    curves = train_metrics.read(train_dir)
    if curves:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        for s in range(steps):
            points = [(step, rec[f"train/loss_{s}"]) for step, rec in sorted(curves.items()) if f"train/loss_{s}" in rec]
            if points:
                ax.plot([p[0] for p in points], [p[1] for p in points], label=f"TTT step {s}")
        ax.set_xlabel("global step"), ax.set_ylabel("train loss"), ax.set_yscale("log"), ax.legend()
        ax.set_title("loss per TTT step")
        fig.tight_layout()
        paths.append(out_dir / "loss_per_ttt_step.png")
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    return paths


def _plots(train_dir: Path, steps: int, metrics: dict, out_dir: Path) -> None:
    """CSV curves for `dvc plots show`: acceptance by position, and the train loss per TTT step
    from the train stage's own per-step record (draftlab.training.metrics)."""
    import csv

    rows = [{"position": s, "predicted": metrics.get(f"eval/full_acc_{s}", 0.0),
             "measured": metrics.get(f"eval/accept_rate_{s}", 0.0)} for s in range(steps)]
    with open(out_dir / "acceptance.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    curves = train_metrics.read(train_dir)
    with open(out_dir / "train_loss.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["step", *[f"loss_{s}" for s in range(steps)]])
        for step, rec in sorted(curves.items()):
            w.writerow([step, *[rec.get(f"train/loss_{s}", "") for s in range(steps)]])


def run(params: Params, *, target_dir: Path, data_dir: Path, store_dir: Path | None, train_dir: Path,
        out_dir: Path, tracker=None) -> EvaluateResult:
    from draftlab.console import console
    from draftlab.models import load_draft, load_target, resolve

    started = time.perf_counter()
    if params.evaluate.backend == "vllm":
        from draftlab.serve.serving import require_vllm

        require_vllm()  # before anything loads: a host without vLLM fails at once
    from draftlab import devices

    placement = devices.resolve("evaluate.device", params.evaluate.device, params.target.dtype)
    train = RunDir(train_dir).train.read()
    if train.calibration:  # a sweep times evaluate on it; its figures are no draft's quality
        console.print(f"[yellow]evaluate[/]: {train_dir} is a step-limited calibration run "
                      f"({train.total_steps} steps), not a trained draft: its acceptance figures are "
                      "marked eval/calibration = 1 and say nothing about a trained draft")
    # the validation split's hidden states, from where training read them (train.source)
    source = source_for(params, store_dir=store_dir, target_dir=target_dir, out_dir=out_dir)
    target, tokenizer = load_target(params, target_dir, device=placement.device)
    draft = load_draft(Path(train.checkpoint), resolve(params, target_dir)).to(placement.device)
    with source.opened(console) as live, devices.autocast(placement):
        metrics = simulated(params, draft, target, data_dir, live)
    from draftlab.serve.specdec import held_out_prompts

    prompts = held_out_prompts(data_dir, params.data.train_ratio, params.evaluate.num_prompts)
    per_prompt: list[dict] = []
    with devices.autocast(placement):
        metrics.update(measured(params, draft, target, tokenizer, prompts, source.layer_ids, per_prompt))
    if params.evaluate.backend == "vllm":
        from draftlab.generation import stop_token_ids

        del target, draft  # vLLM loads its own copies: free this process's before it starts
        import gc

        import torch

        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        metrics.update(_vllm(params, prompts, target_dir=target_dir, train_dir=train_dir, store_dir=store_dir,
                             out_dir=out_dir, stop_token_ids=sorted(stop_token_ids(tokenizer)),
                             hf_per_prompt=per_prompt))
    if metrics.get("eval/measured_acc_len"):
        metrics["eval/predicted_over_measured"] = metrics["eval/simulated_acc_len"] / metrics["eval/measured_acc_len"]
    metrics["eval/wall_clock_s"] = time.perf_counter() - started
    metrics["eval/calibration"] = 1.0 if train.calibration else 0.0
    out_dir.mkdir(parents=True, exist_ok=True)
    steps = params.train.ttt_steps
    # Everything is written to a scratch folder first and renamed in at the end: a failure
    # while plotting leaves the previous reports whole, not half replaced.
    with tempfile.TemporaryDirectory(prefix=".evaluate-", dir=out_dir) as scratch:
        scratch = Path(scratch)
        write_json_atomic(scratch / "metrics.json", {**leading_first(metrics), "run_id": train.run_id})
        _plots(Path(train_dir), steps, metrics, scratch)
        figures = [out_dir / f.name for f in _figures(Path(train_dir), metrics, steps, scratch)]
        for f in sorted(scratch.iterdir()):
            os.replace(f, out_dir / f.name)
    if tracker is not None:
        tracker.log_metrics(metrics)
        # tags, not params: a later evaluation on another host may log into the same run
        tracker.set_tags({"evaluate.device": placement.device, "evaluate.compute_dtype": placement.compute_dtype})
        for path in [out_dir / "metrics.json", out_dir / "acceptance.csv", *figures]:
            tracker.log_artifact(path, "evaluate")
        from draftlab.registry import lineage  # the store is the training's input already (same run)

        lineage.log_inputs(tracker, [lineage.prepared_dataset(data_dir, split="val", context="evaluation",
                                                              train_ratio=params.data.train_ratio)])
    console.print(
        f"[bold]evaluate[/]: simulated acceptance length {metrics['eval/simulated_acc_len']:.3f} "
        f"(draft-vocab metric {metrics['eval/simulated_acc_len_draft_vocab']:.3f}), measured "
        f"{metrics.get('eval/measured_acc_len', float('nan')):.3f} on {len(prompts)} prompts; "
        f"lossless: {metrics.get('eval/lossless', 'n/a')} → {out_dir / 'metrics.json'}"
    )
    if "eval/vllm_measured_acc_len" in metrics:
        m = metrics
        console.print(
            f"[bold]evaluate[/]: vLLM's acceptance length {m['eval/vllm_measured_acc_len']:.3f} on the same prompts "
            f"(draftlab's measured {m['eval/measured_acc_len']:.3f}; per-prompt difference "
            f"{m['eval/vllm_minus_measured_acc_len']:+.3f} ± {m['eval/vllm_minus_measured_se']:.3f}"
            + (", more than their spread: docs/serving.md says why they can differ" if m["eval/vllm_differs_from_measured"]
               else ", within their spread") + f"); output tokens/s with the draft ÷ without "
            f"{m['eval/vllm_speedup']:.2f}, greedy outputs identical on {m['eval/vllm_output_match_frac']:.0%} of prompts")
    return EvaluateResult(metrics)
