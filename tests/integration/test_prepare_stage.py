"""prepare on the tiny pipeline: loss masking with the target's chat template, the split order speculators relies on."""


from draftlab.rundir import prepare_record
from draftlab.stages.prepare import tokenize_conversation


def test_loss_mask_covers_exactly_the_assistant_turns(built):
    from draftlab.models import load_tokenizer

    params, target_dir, _, _ = built
    tok = load_tokenizer(params, target_dir)
    conv = [{"role": "user", "content": "spell cat"}, {"role": "assistant", "content": "c a t ."},
            {"role": "user", "content": "add 1 and 2"}, {"role": "assistant", "content": "3 ."}]
    ids, mask = tokenize_conversation(tok, conv, 512)
    masked = tok.decode([t for t, m in zip(ids, mask) if m])
    assert masked.split() == ["c", "a", "t", ".", "<|end|>", "3", ".", "<|end|>"]
    short_ids, short_mask = tokenize_conversation(tok, conv, 6)
    assert len(short_ids) == len(short_mask) == 6


def test_prepared_rows_are_shuffled_then_split_by_ratio(built):
    """speculators takes rows [0, n*ratio) as train: prepare must write them in that order."""
    from datasets import load_from_disk

    params, _, data_dir, _ = built
    ds = load_from_disk(str(data_dir))
    summary = prepare_record(data_dir).read().model_dump()
    assert summary["num_train"] == int(len(ds) * params.data.train_ratio)
    assert set(ds.column_names) >= {"input_ids", "loss_mask", "seq_len"}
    assert all(len(r["input_ids"]) == r["seq_len"] <= params.prepare.max_seq_len for r in ds)
    assert (data_dir / "token_freq.pt").exists()
