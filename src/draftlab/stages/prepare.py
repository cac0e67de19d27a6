"""The `prepare` stage: conversations → speculators 0.9's tokenized dataset.

Reads conversations (procedural, OpenAI-`messages` JSONL, or a `datasets` folder), optionally
regenerates the assistant turns with the target (so the draft learns what the target says),
applies the target's chat template, masks the loss to assistant tokens, truncates, shuffles
by `data.seed` and writes rows in that order: speculators splits train/val by row order with
`data.train_ratio`, so the same ratio serves prepare, train and evaluate. Output folder:
a `datasets.save_to_disk` dataset (`input_ids`, `loss_mask`, `seq_len`) plus `token_freq.pt`
and `prepare.json` (counts, drops).

    draftlab prepare --params params.yaml --out data/prepared
"""

from __future__ import annotations

import contextlib
import json
import random
import time
from dataclasses import dataclass
from pathlib import Path

from draftlab import corpus
from draftlab.errors import UserError
from draftlab.params import Params, ParamsError

ROLES = {"system", "user", "assistant", "tool"}


class RecordError(UserError, ValueError):
    """A malformed input record; the message starts with file:line."""


@dataclass(frozen=True)
class PrepareResult:
    out_dir: Path
    num_samples: int
    num_train: int
    num_tokens: int
    num_loss_tokens: int
    skipped: int


def parse_record(obj, where: str) -> list[dict[str, str]]:
    """Validate one conversation: a `messages` list of {role, content} with an assistant turn."""
    messages = obj.get("messages") if isinstance(obj, dict) else None
    if not isinstance(messages, list) or not messages:
        raise RecordError(f"{where}: expected an object with a non-empty 'messages' list")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise RecordError(f"{where}: messages[{i}] needs a 'role' in {sorted(ROLES)}")
        content = m.get("content")
        if isinstance(content, list):  # OpenAI content parts: keep the text ones
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        if not isinstance(content, str):
            raise RecordError(f"{where}: messages[{i}].content must be a string")
        out.append({"role": m["role"], "content": content})
    if not any(m["role"] == "assistant" for m in out):
        raise RecordError(f"{where}: no assistant turn (nothing to train the draft on)")
    return out


def read_conversations(params: Params, root: Path) -> tuple[list[list[dict]], int]:
    """All conversations of the configured source, and how many records were skipped."""
    p = params.prepare
    if p.source == "procedural":
        return corpus.conversations(p.num_samples, params.data.seed + 1000), 0
    path = root / p.path
    convs, skipped = [], 0

    def take(obj, where):
        nonlocal skipped
        try:
            convs.append(parse_record(obj, where))
        except RecordError:
            if p.on_error == "fail":
                raise
            skipped += 1

    if p.source == "jsonl":
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as err:
                    obj = None
                    if p.on_error == "fail":
                        raise RecordError(f"{path}:{lineno}: not valid JSON ({err.msg})") from None
                    skipped += 1
                    continue
                take(obj, f"{path}:{lineno}")
    else:
        from datasets import load_from_disk

        ds = load_from_disk(str(path))
        if "messages" not in ds.column_names:
            raise ParamsError(f"prepare.path: {p.path} has no 'messages' column (has {ds.column_names})")
        for i, row in enumerate(ds):
            take(row, f"{path}[{i}]")
    return convs, skipped


def tokenize_conversation(tokenizer, messages: list[dict], max_len: int) -> tuple[list[int], list[int]]:
    """Token ids of the rendered conversation and a 0/1 mask that is 1 on assistant tokens.

    Works for any chat template: each assistant turn's span is found by rendering the
    conversation up to the turn with the generation prompt and then with the turn itself."""

    def render(msgs, gen):
        return tokenizer.apply_chat_template(msgs, add_generation_prompt=gen, tokenize=True, return_dict=False)

    ids = list(render(messages, False))
    mask = [0] * len(ids)
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        start = len(render(messages[:i], True))
        stop = len(render(messages[: i + 1], False))
        for j in range(start, min(stop, len(ids))):
            mask[j] = 1
    return ids[:max_len], mask[:max_len]


def regenerate(params: Params, convs: list[list[dict]], model, tokenizer) -> list[list[dict]]:
    """Replace every assistant turn by the target's greedy continuation (turn by turn)."""
    from rich.progress import Progress

    from draftlab.console import console, progress_columns
    from draftlab.generation import greedy_generate

    p = params.prepare
    if p.regenerate_backend == "openai":
        return _regenerate_openai(p, convs)
    out = [list(c) for c in convs]
    max_turns = max(sum(m["role"] == "assistant" for m in c) for c in out)
    with Progress(*progress_columns(), console=console) as progress:
        task = progress.add_task("regenerating responses", total=sum(
            sum(m["role"] == "assistant" for m in c) for c in out))
        for turn in range(max_turns):
            todo = []  # (conversation index, message index)
            for ci, c in enumerate(out):
                idx = [mi for mi, m in enumerate(c) if m["role"] == "assistant"]
                if turn < len(idx):
                    todo.append((ci, idx[turn]))
            for lo in range(0, len(todo), p.batch_size):
                chunk = todo[lo : lo + p.batch_size]
                gen = greedy_generate(
                    model, tokenizer, [out[ci][:mi] for ci, mi in chunk],
                    max_new_tokens=p.max_new_tokens, batch_size=p.batch_size,
                )
                for (ci, mi), ids in zip(chunk, gen):
                    text = tokenizer.decode(ids, skip_special_tokens=True).strip()
                    out[ci][mi] = {"role": "assistant", "content": text}
                progress.update(task, advance=len(chunk))
    return out


def _regenerate_openai(p, convs):
    """Regenerate through an OpenAI-compatible server (vLLM serving the target), with the key in
    OPENAI_API_KEY when the server requires one (as every vLLM draftlab starts does)."""
    import os

    import openai

    if not p.regenerate_url:
        raise ParamsError("prepare.regenerate_url: required when prepare.regenerate_backend is 'openai'")
    client = openai.OpenAI(base_url=p.regenerate_url, api_key=os.environ.get("OPENAI_API_KEY") or "EMPTY")
    try:
        model_id = client.models.list().data[0].id
    except openai.AuthenticationError:
        raise ParamsError(f"prepare.regenerate_url: {p.regenerate_url} refused the API key (HTTP 401); set "
                          "OPENAI_API_KEY to the server's key") from None
    except openai.APIConnectionError:
        raise ParamsError(f"prepare.regenerate_url: nothing answers at {p.regenerate_url}; start the server "
                          "or fix the URL (it ends in /v1)") from None
    out = []
    for c in convs:
        new: list[dict] = []
        for m in c:
            if m["role"] == "assistant":
                r = client.chat.completions.create(
                    model=model_id, messages=new, temperature=0.0, max_tokens=p.max_new_tokens
                )
                m = {"role": "assistant", "content": r.choices[0].message.content or ""}
            new.append(m)
        out.append(new)
    return out


def run(params: Params, *, target_dir: Path, out_dir: Path, root: Path = Path(".")) -> PrepareResult:
    import torch
    from datasets import Dataset

    from draftlab import devices
    from draftlab.console import console
    from draftlab.models import load_target, load_tokenizer
    from draftlab.rundir import PrepareRecord, prepare_record
    from draftlab.util import atomic_dir, check_replaceable

    check_replaceable(out_dir, "prepare.json")  # before the work: an --out that is not draftlab's is refused
    started = time.perf_counter()
    convs, skipped = read_conversations(params, root)
    if not convs:
        raise ParamsError("prepare: no usable conversations in the input")
    need_model = params.prepare.regenerate and params.prepare.regenerate_backend == "hf"
    placement = devices.resolve("prepare.device", params.prepare.device, params.target.dtype) if need_model else None
    if need_model:
        model, tokenizer = load_target(params, target_dir, device=placement.device)
    else:
        model, tokenizer = None, load_tokenizer(params, target_dir)
    if params.prepare.regenerate:
        torch.manual_seed(params.data.seed)
        with devices.autocast(placement) if placement else contextlib.nullcontext():
            convs = regenerate(params, convs, model, tokenizer)

    rows = {"input_ids": [], "loss_mask": [], "seq_len": []}
    order = list(range(len(convs)))
    random.Random(params.data.seed).shuffle(order)
    empty = 0
    for i in order:
        ids, mask = tokenize_conversation(tokenizer, convs[i], params.prepare.max_seq_len)
        if not any(mask):  # truncated before the first assistant token: nothing to learn
            empty += 1
            continue
        rows["input_ids"].append(ids)
        rows["loss_mask"].append(mask)
        rows["seq_len"].append(len(ids))
    n = len(rows["seq_len"])
    num_train = int(n * params.data.train_ratio)
    if num_train == 0 or num_train == n:
        raise ParamsError(
            f"data.train_ratio: {params.data.train_ratio} leaves an empty split for {n} samples"
        )
    ds = Dataset.from_dict(rows)
    ds.set_format("torch")

    from speculators.train.vocab_mapping import save_token_frequency_distribution

    summary = PrepareRecord(
        num_samples=n, num_train=num_train, num_val=n - num_train, num_tokens=sum(rows["seq_len"]),
        num_loss_tokens=int(sum(map(sum, rows["loss_mask"]))), skipped_records=skipped,
        dropped_no_assistant_tokens=empty, regenerated=params.prepare.regenerate,
        # GPU bf16 and CPU regenerations differ token by token: the record says which this is
        regenerate_compute=placement.record() if placement else None,
        wall_clock_s=round(time.perf_counter() - started, 2))
    with atomic_dir(out_dir, record="prepare.json") as tmp:  # the record marks an older draftlab's folder
        ds.save_to_disk(str(tmp))
        save_token_frequency_distribution(ds, tmp / "token_freq.pt")
        prepare_record(tmp).write(summary)
    console.print(
        f"[bold]prepare[/]: {n} samples ({num_train} train / {n - num_train} val), "
        f"{summary.num_tokens:,} tokens ({summary.num_loss_tokens:,} loss-masked), "
        f"{skipped} records skipped → {out_dir}"
    )
    return PrepareResult(out_dir, n, num_train, summary.num_tokens, summary.num_loss_tokens, skipped)
