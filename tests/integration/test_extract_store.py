"""extract on the tiny pipeline: the captured layers against HF's own, the store files speculators reads, verify."""

import torch

from draftlab.models import LayerCapture
from draftlab.store import layout as store


def test_capture_matches_hf_hidden_states_and_final_is_pre_norm(built):
    from draftlab.models import load_target

    params, target_dir, _, _ = built
    model, _ = load_target(params, target_dir)
    ids = torch.tensor([[2, 5, 40, 41, 42, 7, 6]])
    layer_ids = [2, 4, 5]
    cap = LayerCapture(model, layer_ids)
    last_layer_out = {}
    h = model.model.layers[-1].register_forward_hook(lambda m, a, out: last_layer_out.update(x=out))
    with torch.no_grad():
        out = model.model(input_ids=ids, output_hidden_states=True)
    h.remove()
    cap.close()
    got = cap.stacked()[0]  # [T, 4, H]
    for j, k in enumerate(layer_ids):  # aux id k = residual stream entering layer k
        torch.testing.assert_close(got[:, j], out.hidden_states[k][0])
    final = last_layer_out["x"][0] if isinstance(last_layer_out["x"], torch.Tensor) else last_layer_out["x"][0][0]
    torch.testing.assert_close(got[:, 3], final)
    # ... which is *before* the final norm: HF's last entry is after it.
    torch.testing.assert_close(model.model.norm(got[:, 3]), out.last_hidden_state[0])
    assert not torch.allclose(got[:, 3], out.last_hidden_state[0])


def test_store_files_in_speculators_layout(built):
    from safetensors.torch import load_file

    params, _, data_dir, store_dir = built
    manifest = store.read_manifest(store_dir)
    from datasets import load_from_disk

    ds = load_from_disk(str(data_dir))
    assert manifest.num_files == len(ds)
    assert manifest.layer_ids == [2, 4, 5]
    for i in (0, len(ds) - 1):
        d = load_file(store_dir / f"hs_{i}.safetensors")
        assert d["hidden_states"].shape == (ds[i]["seq_len"], 4, 32)
        assert d["hidden_states"].dtype == torch.bfloat16
        assert d["token_ids"].tolist() == list(ds[i]["input_ids"])
    analytic = store.bytes_per_token(32, "bfloat16")
    assert analytic == 4 * 32 * 2 + 8
    per_token = manifest.total_bytes / manifest.num_tokens
    assert analytic <= per_token < analytic * 1.5


def test_verify_names_missing_truncated_and_corrupt_files(built, tmp_path):
    import shutil

    _, _, _, store_dir = built
    copy = tmp_path / "store"
    shutil.copytree(store_dir, copy)
    assert store.verify(copy) == []
    (copy / "hs_0.safetensors").unlink()
    with open(copy / "hs_1.safetensors", "r+b") as f:
        f.truncate(100)
    data = bytearray((copy / "hs_2.safetensors").read_bytes())
    data[-1] ^= 0xFF
    (copy / "hs_2.safetensors").write_bytes(bytes(data))
    problems = store.verify(copy)
    assert any("hs_0.safetensors: missing" in p for p in problems)
    assert any("hs_1.safetensors: truncated" in p for p in problems)
    assert any("hs_2.safetensors: corrupt" in p for p in problems)
    assert len(problems) == 3


def test_speculators_reads_the_store_into_packed_batches(built):
    """Proof of compatibility: speculators' own dataset, collate and packing sampler."""
    from hs_connectors import FileTransfer
    from speculators.train.data import ArrowDataset, CollateFn
    from speculators.train.distributed_batch_sampler import MultipackDistributedBatchSamplerV2

    params, _, data_dir, store_dir = built
    total_seq_len = 256
    ds = ArrowDataset(max_len=total_seq_len, datapath=str(data_dir), transfer=FileTransfer(store_dir),
                      on_missing="raise", train_ratio=params.data.train_ratio, split="train")
    sampler = MultipackDistributedBatchSamplerV2(
        batch_max_length=total_seq_len, lengths=ds.approx_lengths, num_replicas=1, rank=0, seed=0)
    collate = CollateFn(total_seq_len, 32, num_target_layers=3, dtype=torch.bfloat16)
    batches = list(sampler)
    assert sorted(i for b in batches for i in b) == list(range(len(ds)))
    for indices in batches[:3]:
        batch = collate([ds[i] for i in indices])
        assert batch["input_ids"].shape[-1] == total_seq_len
        assert batch["hidden_states"].shape[-2] == total_seq_len
        assert batch["hidden_states"].shape[-1] == 3 * 32  # the 3 aux layers, concatenated
        assert batch["verifier_last_hidden_states"].shape[-1] == 32  # the pre-norm final layer
        assert int(batch["loss_mask"].sum()) > 0
        assert torch.isfinite(batch["hidden_states"].float()).all()
