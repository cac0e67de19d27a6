"""The fp8 store: hs_connectors' layout written by extract, read back by speculators' own dataset
with its FP8 transfer, known to the manifest, verify, plan and train; bad dtypes refused."""

import os
from pathlib import Path

import pytest
import torch

from draftlab.params import ParamsError
from draftlab.plan import planning
from draftlab.store import layout as store
from tests.conftest import tiny_params


def test_unknown_dtype_and_missing_fp8_are_one_line_errors(monkeypatch):
    from draftlab.store.capture import check_dtype

    with pytest.raises(ParamsError, match="extract.dtype"):
        tiny_params(extract={"dtype": "float8"})
    check_dtype("float8_e4m3fn")
    monkeypatch.delattr(torch, "float8_e4m3fn")  # a torch that predates float8
    with pytest.raises(ParamsError, match=r"^extract.dtype: float8_e4m3fn needs a torch"):
        check_dtype("float8_e4m3fn")
    check_dtype("bfloat16")


def test_train_reads_an_fp8_store_with_speculators_fp8_backend(tmp_path):
    from hs_connectors import HiddenStatesBackend

    from draftlab.store.hidden_states import StoreSource
    from draftlab.training.job import speculators_argv

    params = tiny_params()
    kw = dict(verifier="v", data_dir=tmp_path, out_dir=tmp_path, layer_ids=[2, 4, 5],
              total_steps=10, d2t=tmp_path / "d2t", t2d=tmp_path / "t2d", device="cpu")

    def backend_of(argv):
        return argv[argv.index("--hidden-states-backend") + 1]

    fp8, bf16 = StoreSource(tmp_path, "float8_e4m3fn"), StoreSource(tmp_path, "bfloat16")
    assert backend_of(speculators_argv(params, source=fp8, **kw)) == "fp8"
    assert backend_of(speculators_argv(params, source=bf16, **kw)) == "file"
    assert {"fp8", "file"} <= set(HiddenStatesBackend.registry)


def test_plan_bytes_know_fp8():
    h, tokens, files = 7168, 87_800_000, 37_312
    bf16 = planning.store_bytes(tokens, files, h, "bfloat16")
    fp8 = planning.store_bytes(tokens, files, h, "float8_e4m3fn")
    assert 0.499 < fp8 / bf16 < 0.501
    # the loader's shared-memory batches hold dequantized bf16, whatever the store's dtype
    assert planning.batch_bytes(8192, h, "float8_e4m3fn") == planning.batch_bytes(8192, h, "bfloat16")


def test_journal_append_never_writes_through_a_dvc_cache_link(tmp_path):
    j = store.Journal.open(tmp_path, "k")
    j.record([{"index": 0, "name": "hs_0.safetensors"}])
    cached = tmp_path / "cache-object"
    os.link(j.path, cached)  # what `dvc commit` with cache.type hardlink leaves behind
    os.chmod(cached, 0o444)
    before = cached.read_bytes()
    store.Journal.open(tmp_path, "k").record([{"index": 1, "name": "hs_1.safetensors"}])
    assert cached.read_bytes() == before
    assert set(store.Journal.open(tmp_path, "k").done) == {0, 1}
    assert Path(j.path).stat().st_nlink == 1


def test_draftlab_dequantize_is_hs_connectors_bit_for_bit(monkeypatch):
    from hs_connectors.fp8_utils import dequantize_fp8_tensor

    from draftlab.store import hidden_states

    # every fp8 byte (NaNs, subnormals, ±0, ±448) at per-token scales from tiny to huge, with more
    # tokens than one lookup chunk
    codes = torch.arange(256, dtype=torch.uint8).repeat(40).view(40, 4, 64).view(torch.float8_e4m3fn)
    scales = torch.logspace(-30, 30, 40).view(40, 1, 1).float()
    scales[3] = 1.0
    monkeypatch.setattr(hidden_states, "_FP8_LUT_CHUNK", 7 * 256)  # several chunks, the last one partial
    want, got = dequantize_fp8_tensor(codes, scales), hidden_states.dequantize_fp8(codes, scales)
    assert got.dtype == want.dtype == torch.bfloat16 and got.shape == want.shape
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan) and nan.any()
    assert torch.equal(got.view(torch.int16)[~nan], want.view(torch.int16)[~nan])
    # another dtype than bf16 takes the stock expression
    assert torch.equal(hidden_states.dequantize_fp8(codes, scales, torch.float32)[~nan],
                       dequantize_fp8_tensor(codes, scales, dtype=torch.float32)[~nan])
