"""fp8 stores on the tiny pipeline: hs_connectors' layout, read back by speculators, verify names a file of another dtype."""


import pytest
import torch

from draftlab.rundir import StoreDir
from draftlab.store import layout as store
from tests.conftest import tiny_params


@pytest.fixture(scope="module")
def fp8_store(built, tmp_path_factory):
    """The session's target and prepared data, extracted again as float8_e4m3fn."""
    from draftlab.stages import extract

    params, target_dir, data_dir, bf16_dir = built
    out = tmp_path_factory.mktemp("fp8") / "hidden_states"
    extract.run(tiny_params(extract={"batch_tokens": 512, "dtype": "float8_e4m3fn"}),
                target_dir=target_dir, data_dir=data_dir, out_dir=out)
    return data_dir, bf16_dir, out


def test_fp8_files_are_hs_connectors_layout_and_half_the_bytes(fp8_store):
    from hs_connectors.fp8_utils import SCALES_KEY
    from safetensors.torch import load_file

    _, bf16_dir, fp8_dir = fp8_store
    assert store.SCALES_KEY == SCALES_KEY
    m8, m16 = store.read_manifest(fp8_dir), store.read_manifest(bf16_dir)
    assert m8.dtype == "float8_e4m3fn" and m8.key != m16.key
    assert m8.num_tokens == m16.num_tokens
    d = load_file(fp8_dir / "hs_0.safetensors")
    t = d["hidden_states"].shape[0]
    assert d["hidden_states"].dtype == torch.float8_e4m3fn and d["hidden_states"].shape == (t, 4, 32)
    assert d[SCALES_KEY].dtype == torch.float32 and d[SCALES_KEY].shape == (t, 1, 1)
    assert d["token_ids"].dtype == torch.int64
    h = 32
    assert store.bytes_per_token(h, "float8_e4m3fn") == 4 * h + 12

    def payload(m, d):  # bytes on disk less each file's safetensors header
        return m.total_bytes - sum(8 + int.from_bytes((d / r.name).read_bytes()[:8], "little")
                                      for r in m.files)

    assert payload(m8, fp8_dir) == m8.num_tokens * (4 * h + 12)
    assert payload(m8, fp8_dir) / payload(m16, bf16_dir) == pytest.approx((4 * h + 12) / (8 * h + 8))
    # these 41-token files carry ~0.2 kB headers each; at the reference's 2,353 tokens/file ~0.01%
    assert m8.total_bytes / m16.total_bytes < 0.56
    assert store.verify(fp8_dir) == []


def test_speculators_arrow_dataset_reads_fp8_within_quantization_error(fp8_store):
    from hs_connectors import FileTransfer, FP8Transfer
    from speculators.train.data import ArrowDataset

    data_dir, bf16_dir, fp8_dir = fp8_store
    common = dict(max_len=256, datapath=str(data_dir), on_missing="raise")
    ref = ArrowDataset(transfer=FileTransfer(bf16_dir), **common)
    got = ArrowDataset(transfer=FP8Transfer(fp8_dir), **common)
    assert len(ref) == len(got) > 0
    for i in range(len(ref)):
        a, b = ref[i], got[i]
        assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["loss_mask"], b["loss_mask"])
        assert b["hidden_states"].dtype == torch.bfloat16
        # e4m3 keeps 3 mantissa bits: ≤ 2^-4 relative rounding per element; RMS well below that
        for x, y in ((a["hidden_states"], b["hidden_states"]),
                     (a["verifier_last_hidden_states"], b["verifier_last_hidden_states"])):
            x, y = x.float(), y.float()
            rel = (x - y).norm() / x.norm()
            assert rel < 0.05, f"sample {i}: relative error {rel:.3f}"
            assert not torch.equal(x, y)  # it is quantized, not a bf16 copy


def test_verify_names_a_file_of_another_dtype(fp8_store, tmp_path):
    import shutil

    from typer.testing import CliRunner

    from draftlab.cli import app

    _, bf16_dir, fp8_dir = fp8_store
    mixed = tmp_path / "hidden_states"
    shutil.copytree(fp8_dir, mixed)
    manifest = store.read_manifest(mixed)
    # a bf16 file where the manifest promises fp8, its record updated so only the dtype differs
    shutil.copy(bf16_dir / "hs_3.safetensors", mixed / "hs_3.safetensors")
    rec = next(r for r in manifest.files if r.index == 3)
    rec.bytes = (mixed / "hs_3.safetensors").stat().st_size
    from draftlab.util import sha256_file

    rec.sha256 = sha256_file(mixed / "hs_3.safetensors")
    StoreDir(mixed).manifest.write(manifest)
    problems = store.verify(mixed, full=False)
    assert len(problems) == 1 and "hs_3.safetensors" in problems[0] and "bfloat16" in problems[0]
    result = CliRunner().invoke(app, ["verify", str(mixed)])
    assert result.exit_code == 2 and "hs_3.safetensors" in result.output
    assert (mixed / "hs_3.safetensors").exists()  # nothing deleted


def test_verified_fp8_reads_equal_speculators_fp8_transfer(fp8_store):
    from hs_connectors import FP8Transfer

    from draftlab.store import hidden_states

    _, _, fp8_dir = fp8_store
    records = {f.index: f.model_dump() for f in store.read_manifest(fp8_dir).files}
    verified = hidden_states.VerifiedTransfer(FP8Transfer(fp8_dir), fp8_dir, records)
    for i in sorted(records)[:8]:
        for _ in range(2):  # the first read is hashed, the second trusted by size and mtime
            got, want = verified.get_cached(i), FP8Transfer(fp8_dir).get_cached(i)
            assert got.keys() == want.keys() == {"hidden_states", "token_ids"}
            assert all(got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]) for k in want)


def test_verified_transfer_reaches_spawned_loader_workers(fp8_store):
    """train.num_workers > 0: the dataset, its VerifiedTransfer included, is pickled into each
    spawned worker."""
    import pickle

    from hs_connectors import FP8Transfer

    from draftlab.store import hidden_states

    _, _, fp8_dir = fp8_store
    records = {f.index: f.model_dump() for f in store.read_manifest(fp8_dir).files}
    copy = pickle.loads(pickle.dumps(hidden_states.VerifiedTransfer(FP8Transfer(fp8_dir), fp8_dir, records)))
    assert isinstance(copy.inner, FP8Transfer) and copy.dequantize_dtype == torch.bfloat16
    assert torch.equal(copy.get_cached(0)["hidden_states"], FP8Transfer(fp8_dir).get_cached(0)["hidden_states"])
