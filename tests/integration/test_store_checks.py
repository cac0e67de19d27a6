"""The store's checks: headers named (never a SafetensorError), the training loader's verified"""

from __future__ import annotations

import shutil

import pytest

from draftlab.store import layout as store
from draftlab.store import hidden_states


def _records(store_dir):
    return {f.index: f.model_dump() for f in store.read_manifest(store_dir).files}


@pytest.fixture
def store_copy(built, tmp_path):
    copy = tmp_path / "store"
    shutil.copytree(built[3], copy)
    return copy


def test_a_garbage_header_is_named_by_the_quick_check(store_copy):
    blob = (store_copy / "hs_4.safetensors").read_bytes()
    (store_copy / "hs_4.safetensors").write_bytes(b"\xff" * 8 + blob[8:])
    six = (store_copy / "hs_6.safetensors").read_bytes()
    (store_copy / "hs_6.safetensors").write_bytes(six[:8] + b"{not json" + six[17:])  # same size
    problems = store.verify(store_copy, full=False)
    assert [p.split(": ", 1)[0].rsplit("/", 1)[1] for p in problems] == ["hs_4.safetensors", "hs_6.safetensors"]
    assert all("garbage header" in p for p in problems), problems


def test_a_header_for_other_data_is_named(store_copy):
    rec = _records(store_copy)[1]
    other = _records(store_copy)[2]
    assert store.header_problem(store_copy / "hs_2.safetensors", rec) is not None
    assert store.header_problem(store_copy / "hs_2.safetensors", other) is None


@pytest.fixture
def dataset(built, store_copy, monkeypatch):
    """speculators' own ArrowDataset over the copy, built after hidden_states' wrap (undone after)."""
    from hs_connectors import FileTransfer
    from speculators.train import data

    monkeypatch.setattr(data.ArrowDataset, "__init__", data.ArrowDataset.__init__)
    hidden_states.verify_hidden_state_reads(store_copy)
    params, _, data_dir, _ = built
    return data.ArrowDataset(max_len=256, datapath=str(data_dir), transfer=FileTransfer(store_copy),
                             on_missing="raise", train_ratio=params.data.train_ratio, split="train")


def test_verified_reads_return_what_speculators_would_read(dataset, store_copy):
    import torch
    from safetensors.torch import load_file

    assert isinstance(dataset.transfer, hidden_states.VerifiedTransfer)
    got = dataset.transfer.get_cached(3)
    want = load_file(store_copy / "hs_3.safetensors")
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert dataset[3]["input_ids"].shape[0] == want["token_ids"].shape[0]


@pytest.mark.parametrize("damage, why", [
    (lambda b: b[:-1] + bytes([b[-1] ^ 0xFF]), "corrupt (sha256 differs from the manifest)"),
    (lambda b: b"\xff" * 8 + b[8:], "garbage header"),
    (lambda b: b[:-10], "truncated"),
])
def test_the_first_bad_file_read_stops_with_its_name_and_the_repair(dataset, store_copy, damage, why):
    path = store_copy / "hs_2.safetensors"
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(hidden_states.HiddenStateFileError) as err:
        dataset[2]
    msg = str(err.value)
    assert msg.startswith(f"{path}: ") and why in msg and store.REPAIR in msg


def test_journal_forget_keeps_the_good_records(store_copy):
    key = store.read_manifest(store_copy).key
    journal = store.Journal.open(store_copy, key)
    n = len(journal.done)
    journal.forget({0, 5})
    again = store.Journal.open(store_copy, key)
    assert set(again.done) == set(range(n)) - {0, 5}
    assert again.done[1] == journal.done[1]
