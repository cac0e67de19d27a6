"""The `target` stage: build the tiny default target (a Llama causal LM + tokenizer with a
chat template, saved in Hugging Face format) so a fresh clone runs offline.

Real targets (`target.source: local|hub`) skip this stage's work: it only records what the
target is. The tiny target is pre-trained briefly on the procedural corpus because a
random-initialised model's greedy continuations collapse into loops (a draft would learn
nothing real); `reports/target.json` records the distinct-token ratio of greedy responses
before and after, so the choice is measured, not assumed.

    draftlab target --params params.yaml
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass
from pathlib import Path

from draftlab import corpus
from draftlab.params import Params
from draftlab.util import atomic_dir, check_replaceable, write_json_atomic

POINTER = "target.json"


@dataclass(frozen=True)
class TargetResult:
    path: Path
    report: dict


def build_tokenizer():
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from tokenizers import decoders
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(corpus.vocabulary())}
    tok = Tokenizer(WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        pad_token="<pad>",
        bos_token="<bos>",
        eos_token="<eos>",
        additional_special_tokens=["<|system|>", "<|user|>", "<|assistant|>", "<|end|>"],
    )
    fast.chat_template = corpus.CHAT_TEMPLATE
    return fast


def build_model(tiny, tokenizer):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(tiny.seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=tiny.hidden_size,
        intermediate_size=tiny.intermediate_size,
        num_hidden_layers=tiny.num_layers,
        num_attention_heads=tiny.num_heads,
        num_key_value_heads=tiny.num_kv_heads,
        max_position_embeddings=tiny.max_position_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|end|>"),
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config)


def distinct_token_ratio(model, tokenizer, prompts: list[list[dict]], max_new_tokens: int = 48) -> float:
    """Mean over responses of distinct tokens / tokens: ~1 for varied text, → 0 for loops."""
    from draftlab.generation import greedy_generate

    outs = greedy_generate(model, tokenizer, prompts, max_new_tokens=max_new_tokens, batch_size=32)
    ratios = [len(set(o)) / len(o) for o in outs if o]
    return sum(ratios) / max(len(ratios), 1)


def _pretrain(model, tokenizer, tiny, progress) -> list[float]:
    import torch

    rng = random.Random(tiny.seed + 1)
    texts = [
        tokenizer.apply_chat_template(c, tokenize=False) for c in corpus.conversations(4096, tiny.seed + 7)
    ]
    opt = torch.optim.AdamW(model.parameters(), lr=tiny.pretrain_lr, weight_decay=0.01)
    model.train()
    losses = []
    task = progress.add_task("pre-training tiny target", total=tiny.pretrain_steps)
    for step in range(tiny.pretrain_steps):
        lr = tiny.pretrain_lr * 0.5 * (1 + math.cos(math.pi * step / tiny.pretrain_steps))
        for group in opt.param_groups:
            group["lr"] = lr
        batch = tokenizer(
            rng.sample(texts, tiny.pretrain_batch_size),
            return_tensors="pt",
            padding=True,
            add_special_tokens=False,
        )
        labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
        loss = model(**batch, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        progress.update(task, advance=1, description=f"pre-training tiny target (loss {loss.item():.3f})")
    model.eval()
    return losses


def run(params: Params, *, out_dir: Path, report_path: Path) -> TargetResult:
    """Build the tiny target into `out_dir` (source `tiny`), or describe a real one."""
    check_replaceable(out_dir)  # before the work: an --out that is not draftlab's is refused
    import torch
    from rich.progress import Progress

    from draftlab.console import console, progress_columns

    if params.target.source != "tiny":
        # The stage still owns out_dir: a pointer that later stages and DVC can depend on.
        report = {"source": params.target.source, "path": params.target.path, "built": False}
        with atomic_dir(out_dir) as tmp:
            write_json_atomic(tmp / POINTER, report)
        write_json_atomic(report_path, report)
        return TargetResult(out_dir, report)

    tiny = params.target.tiny
    torch.manual_seed(tiny.seed)
    started = time.perf_counter()
    tokenizer = build_tokenizer()
    model = build_model(tiny, tokenizer)
    probe = [c[:1] for c in corpus.conversations(64, tiny.seed + 99)]
    with torch.no_grad():
        ratio_random = distinct_token_ratio(model, tokenizer, probe)
    with Progress(*progress_columns(), console=console) as progress:
        losses = _pretrain(model, tokenizer, tiny, progress) if tiny.pretrain_steps else []
    with torch.no_grad():
        ratio_trained = distinct_token_ratio(model, tokenizer, probe)

    with atomic_dir(out_dir) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
    report = {
        "source": "tiny",
        "path": str(out_dir),
        "built": True,
        "num_parameters": sum(p.numel() for p in model.parameters()),
        "vocab_size": len(tokenizer),
        "num_layers": tiny.num_layers,
        "hidden_size": tiny.hidden_size,
        "pretrain_steps": tiny.pretrain_steps,
        "pretrain_final_loss": losses[-1] if losses else None,
        "distinct_token_ratio_random_init": round(ratio_random, 4),
        "distinct_token_ratio_trained": round(ratio_trained, 4),
        "wall_clock_s": round(time.perf_counter() - started, 2),
    }
    write_json_atomic(report_path, report)
    console.print(
        f"[bold]target[/]: tiny Llama ({report['num_parameters']:,} params, {tiny.num_layers} layers, "
        f"H={tiny.hidden_size}) → {out_dir}; distinct-token ratio of greedy responses "
        f"{ratio_random:.2f} (random init) → {ratio_trained:.2f} (after {tiny.pretrain_steps} steps)"
    )
    return TargetResult(out_dir, report)
