"""Batched greedy generation with a Hugging Face causal LM (prepare's regeneration and the
tiny target's loop check). Returns generated token ids only, stopped at the end-of-turn token."""

from __future__ import annotations


def stop_token_ids(tokenizer) -> set[int]:
    ids = {tokenizer.eos_token_id}
    for tok in ("<|end|>", "<|eot_id|>", "<|im_end|>", "<|end_of_text|>"):
        tid = tokenizer.convert_tokens_to_ids(tok)
        if isinstance(tid, int) and tid != tokenizer.unk_token_id:
            ids.add(tid)
    return {i for i in ids if i is not None}


def greedy_generate(model, tokenizer, prompts: list[list[dict]], *, max_new_tokens: int, batch_size: int):
    """prompts: conversations ending with a user turn. Returns one list of new token ids each."""
    import torch

    stops = stop_token_ids(tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else next(iter(stops))
    outs: list[list[int]] = []
    for lo in range(0, len(prompts), batch_size):
        chunk = prompts[lo : lo + batch_size]
        ids = [
            tokenizer.apply_chat_template(p, add_generation_prompt=True, tokenize=True, return_dict=False)
            for p in chunk
        ]
        width = max(map(len, ids))
        input_ids = torch.tensor([[pad] * (width - len(x)) + list(x) for x in ids])
        mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids])
        with torch.no_grad():
            gen = model.generate(
                input_ids=input_ids.to(model.device),
                attention_mask=mask.to(model.device),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=pad,
                eos_token_id=sorted(stops),
            )
        for row in gen[:, width:].tolist():
            cut = next((i for i, t in enumerate(row) if t in stops), len(row))
            outs.append(row[:cut])
    return outs
