"""Measured acceptance: real greedy speculative decoding on CPU with a Hugging Face target and an
EAGLE-3 draft trained by speculators 0.9 (the core of `draftlab evaluate`).

speculators' forward always teacher-forces the next TTT step's tokens, so drafting is done here
by `Eagle3Proposer`, built from the draft's own modules the way vLLM serves it:
- draft entry j pairs the target's 3 aux states g_j (inputs of the aux layers at position j) with
  the token x_{j+1} that followed: cat(embed(x_{j+1}), fc(norm(cat g_j))) at rotary position j+1
  (speculators' shifted batch; vLLM uses position j — RoPE is relative, the scores are the same);
- each further draft step feeds back the draft's own output hidden state (before the final norm,
  or after it when the checkpoint has `norm_output`, Eagle 3.1) with the embedding of the token it
  just drafted, one position further on;
- a step attends every step-0 entry of the verified prefix (inside the sliding window where a
  layer has one) and the earlier steps of its own chain: the causal block plus one diagonal per
  TTT step that speculators trains with. The KV cache holds exactly those, is cropped back to the
  verified entries after each verification and extended with the newly verified ones;
- logits are over the draft vocab; target id = draft id + d2t[draft id].

The target verifies [last token, d_1..d_K] in one forward with its DynamicCache; the longest prefix
of drafts equal to its argmax is accepted, its own next token is appended (the bonus) and the cache
is cropped. Mean acceptance length = 1 + accepted / drafts (vLLM's convention).

    python -m draftlab.serve.specdec --draft runs/train/checkpoints/2 --target models/target \
        --data data/prepared --num-prompts 16 --k 3

Legend: T tokens, H hidden size, V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Proposal:
    token_ids: list[int]  # drafted tokens, target vocabulary
    logits_KV: object  # draft-vocab logits of each drafted token
    step0_logits_TV: object  # step-0 logits of every newly verified entry


class Eagle3Proposer:
    """Greedy EAGLE-3 drafting with a speculators `Eagle3DraftModel`'s modules.

    use_cache=False recomputes every entry from scratch on each call (the reference)."""

    def __init__(self, draft, *, use_cache: bool = True):
        self.draft = draft
        self.use_cache = use_cache
        self.norm_output = bool(draft.config.norm_output)
        self.sliding_layers = set(draft.sliding_window_indices)
        self.window = draft.sliding_window
        self.device = draft.fc.weight.device
        self.reset()

    def reset(self) -> None:
        from transformers import DynamicCache

        self.next_ids: list[int] = []  # x_{j+1} of every verified entry j
        self.fused: list = []  # fc(aux) of the verified entries, in chunks
        self.cache = DynamicCache()
        self.slots: list[tuple[int, int]] = []  # (ttt step, entry j) of each cached key

    def _fuse(self, aux_T3H):
        import torch

        d = self.draft
        x = aux_T3H.to(self.device, d.fc.weight.dtype)
        if d.input_norm is not None:
            x = d.input_norm(x)
        if d.fc_norm is not None:
            chunks = x.chunk(len(d.fc_norm), dim=-1)
            x = torch.cat([n(c) for n, c in zip(d.fc_norm, chunks, strict=True)], dim=-1)
        return d.fc(x)

    def _mask(self, queries, sliding: bool, dtype):
        """Additive mask of speculators' TTT training: step-0 keys causally, plus the diagonal."""
        import torch

        q_step, q_j = torch.tensor(queries, device=self.device).T
        kv_step, kv_j = torch.tensor(self.slots, device=self.device).T
        ok = (kv_step == 0) & (kv_j <= q_j[:, None])
        ok |= (kv_step > 0) & (kv_j == q_j[:, None]) & (kv_step <= q_step[:, None])
        if sliding and self.window is not None:
            ok &= kv_j > q_j[:, None] - self.window
        return torch.zeros(ok.shape, dtype=dtype, device=self.device).masked_fill(~ok, float("-inf"))[None, None]

    def _run(self, ids, hidden_TH, queries: list[tuple[int, int]]):
        """The draft's layers on new entries (appending their keys): (logits_TV, fed-back hidden_TH)."""
        import torch

        d = self.draft
        self.slots += queries
        h = torch.cat([d.embed_tokens(torch.tensor([ids], device=self.device)), hidden_TH[None]], dim=-1)
        positions = torch.tensor([[j + step + 1 for step, j in queries]], device=self.device)
        rope = d.rotary_emb(h, positions)
        masks = {s: self._mask(queries, s, h.dtype) for s in (False, True)}
        for i, layer in enumerate(d.layers):
            h = layer(h, attention_mask=masks[i in self.sliding_layers], position_ids=positions,
                      past_key_values=self.cache, position_embeddings=rope)
        normed = d.norm(h)
        return d.lm_head(normed)[0], (normed if self.norm_output else h)[0]

    def to_target(self, draft_id: int) -> int:
        d2t = self.draft.d2t
        return draft_id if d2t is None else draft_id + int(d2t[draft_id])

    def propose(self, next_ids: list[int], aux_T3H, num_tokens: int, *, teacher_ids=None) -> Proposal:
        """Record newly verified entries (aux g_j and the token x_{j+1} that followed), then draft
        num_tokens greedily from the last. teacher_ids replaces the fed-back drafts (tests)."""
        import torch
        from transformers import DynamicCache

        assert len(next_ids) == aux_T3H.shape[0] > 0 and num_tokens > 0
        with torch.no_grad():
            self.next_ids += list(next_ids)
            self.fused.append(self._fuse(aux_T3H))
            n = len(self.next_ids)
            if self.use_cache:  # drop the last chain: its entries are rewritten from verified states
                stale = sum(1 for step, _ in self.slots if step > 0)
                if stale:
                    self.cache.crop(-stale)
                    self.slots = self.slots[:-stale]
            else:
                self.cache, self.slots = DynamicCache(), []
            start = len(self.slots)
            fused_TH = torch.cat(self.fused)[start:]
            step0, hidden = self._run(self.next_ids[start:], fused_TH, [(0, j) for j in range(start, n)])
            logits_V, hidden = step0[-1], hidden[-1:]
            tokens, logits = [], []
            for step in range(1, num_tokens + 1):
                tokens.append(self.to_target(int(logits_V.argmax())))
                logits.append(logits_V)
                if step == num_tokens:
                    break
                fed = tokens[-1] if teacher_ids is None else int(teacher_ids[step - 1])
                out, hidden = self._run([fed], hidden, [(step, n - 1)])
                logits_V = out[-1]
        return Proposal(tokens, torch.stack(logits), step0)


@dataclass
class GenerationResult:
    tokens: list[int] = field(default_factory=list)  # emitted, a stop token included
    target_forwards: int = 0
    drafts: int = 0  # verification rounds (vLLM's num_drafts)
    # what verification accepted, as vLLM counts it: a last round cut by a stop token or the budget
    # still counts all its accepted drafts
    accepted_per_pos: list[int] = field(default_factory=list)

    @property
    def accepted(self) -> int:
        return sum(self.accepted_per_pos)


def _emit(result: GenerationResult, tokens: list[int], stop_ids, max_new_tokens: int) -> bool:
    """Append tokens up to a stop token or the budget; True when generation is over."""
    for tok in tokens:
        result.tokens.append(tok)
        if tok in stop_ids or len(result.tokens) >= max_new_tokens:
            return True
    return False


def plain_greedy(target, prompt_ids, max_new_tokens: int, stop_ids=()) -> GenerationResult:
    """The target alone, one forward per token, with the same DynamicCache path."""
    import torch
    from transformers import DynamicCache

    result, cache, ids = GenerationResult(), DynamicCache(), list(prompt_ids)
    with torch.no_grad():
        while True:
            out = target(input_ids=torch.tensor([ids], device=target.device), past_key_values=cache,
                         use_cache=True, logits_to_keep=1)
            result.target_forwards += 1
            ids = [int(out.logits[0, -1].argmax())]
            if _emit(result, ids, set(stop_ids), max_new_tokens):
                return result


def speculative_generate(target, draft, prompt_ids, *, num_speculative_tokens: int, max_new_tokens: int,
                         layer_ids=None, stop_ids=()) -> GenerationResult:
    """Greedy speculative decoding; `draft` is an Eagle3DraftModel or a proposer (its `propose`)."""
    import torch
    from transformers import DynamicCache

    from draftlab.models import LayerCapture

    proposer = draft if hasattr(draft, "propose") else Eagle3Proposer(draft)
    proposer.reset()
    layer_ids = list(layer_ids or proposer.draft.config.eagle_aux_hidden_state_layer_ids)
    k, stop_ids = num_speculative_tokens, set(stop_ids)
    result = GenerationResult(accepted_per_pos=[0] * k)
    capture, cache = LayerCapture(target, layer_ids), DynamicCache()

    def verify(ids):
        out = target(input_ids=torch.tensor([ids], device=target.device), past_key_values=cache, use_cache=True)
        result.target_forwards += 1
        aux_T3H = torch.cat([capture.captured[f"aux{i}"][0] for i in range(len(layer_ids))], dim=-1)
        return out.logits[0].argmax(-1).tolist(), aux_T3H

    try:
        with torch.no_grad():
            prompt = list(prompt_ids)
            argmax, aux_T3H = verify(prompt)
            bonus = argmax[-1]
            next_ids = prompt[1:] + [bonus]
            done = _emit(result, [bonus], stop_ids, max_new_tokens)
            while not done:
                drafted = proposer.propose(next_ids, aux_T3H, k).token_ids
                argmax, aux_T3H = verify([bonus, *drafted])
                result.drafts += 1
                accepted = 0
                while accepted < k and drafted[accepted] == argmax[accepted]:
                    result.accepted_per_pos[accepted] += 1
                    accepted += 1
                if accepted < k:
                    cache.crop(-(k - accepted))  # the rejected drafts' keys
                bonus = argmax[accepted]
                next_ids, aux_T3H = drafted[:accepted] + [bonus], aux_T3H[: accepted + 1]
                done = _emit(result, next_ids, stop_ids, max_new_tokens)
    finally:
        capture.close()
    return result


@dataclass
class AcceptanceStats:
    """Acceptance over prompts, in vLLM's terms (its spec_decode num_drafts / num_accepted_tokens)."""

    num_speculative_tokens: int
    prompts: int = 0
    drafts: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    emitted_tokens: int = 0
    target_forwards: int = 0  # with speculation (prefill included)
    plain_forwards: int = 0  # the target alone for the same tokens
    lossless_mismatches: int = 0  # prompts whose tokens differ from the target's own greedy output

    def __post_init__(self):
        self.accepted_per_pos = self.accepted_per_pos or [0] * self.num_speculative_tokens

    def add(self, spec: GenerationResult, plain: GenerationResult | None = None) -> None:
        self.accepted_per_pos = [a + b for a, b in zip(self.accepted_per_pos, spec.accepted_per_pos, strict=True)]
        self.prompts += 1
        self.drafts += spec.drafts
        self.emitted_tokens += len(spec.tokens)
        self.target_forwards += spec.target_forwards
        self.plain_forwards += plain.target_forwards if plain is not None else len(spec.tokens)
        self.lossless_mismatches += int(plain is not None and plain.tokens != spec.tokens)

    @property
    def accepted(self) -> int:
        return sum(self.accepted_per_pos)

    @property
    def mean_acceptance_length(self) -> float:
        return 1.0 + self.accepted / self.drafts if self.drafts else 1.0

    @property
    def acceptance_per_position(self) -> list[float]:
        return [a / self.drafts if self.drafts else 0.0 for a in self.accepted_per_pos]

    @property
    def forward_passes_saved(self) -> int:
        return self.plain_forwards - self.target_forwards

    def to_json(self) -> dict:
        return {"num_speculative_tokens": self.num_speculative_tokens, "prompts": self.prompts,
                "drafts": self.drafts, "accepted_tokens": self.accepted, "emitted_tokens": self.emitted_tokens,
                "mean_acceptance_length": round(self.mean_acceptance_length, 4),
                "acceptance_per_position": [round(r, 4) for r in self.acceptance_per_position],
                "target_forwards": self.target_forwards, "plain_forwards": self.plain_forwards,
                "forward_passes_saved": self.forward_passes_saved, "lossless_mismatches": self.lossless_mismatches}


def held_out_prompts(data_dir: Path | str, train_ratio: float, limit: int) -> list[list[int]]:
    """Prompts (tokens before the first loss-masked one) of the validation rows."""
    from datasets import load_from_disk

    ds = load_from_disk(str(data_dir)).with_format(None)
    rows = ds.select(range(int(len(ds) * train_ratio), len(ds)))
    prompts = [r["input_ids"][: r["loss_mask"].index(1)] for r in rows if 1 in r["loss_mask"]]
    return prompts[:limit]


def _main() -> None:
    import argparse
    import json

    from draftlab.generation import stop_token_ids
    from draftlab.models import load_draft, load_target
    from draftlab.params import parse_params

    ap = argparse.ArgumentParser(description="measured acceptance of an EAGLE-3 checkpoint")
    ap.add_argument("--draft", required=True)
    ap.add_argument("--target", required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--train-ratio", type=float, default=0.9)
    args = ap.parse_args()
    params = parse_params({"target": {"source": "local", "path": args.target}})
    target, tokenizer = load_target(params, Path(args.target))
    draft = load_draft(args.draft, Path(args.target).resolve())
    stats, stops = AcceptanceStats(args.k), stop_token_ids(tokenizer)
    for prompt in held_out_prompts(args.data, args.train_ratio, args.num_prompts):
        spec = speculative_generate(target, draft, prompt, num_speculative_tokens=args.k,
                                    max_new_tokens=args.max_new_tokens, stop_ids=stops)
        stats.add(spec, plain_greedy(target, prompt, args.max_new_tokens, stops))
    print(json.dumps(stats.to_json(), indent=1))


if __name__ == "__main__":
    _main()
