"""Shared fixtures: a tiny target, a prepared dataset and a hidden-state store built once per
test session with the real stage functions (small sizes, CPU only)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO = Path(__file__).resolve().parents[1]


def tiny_params(**sections):
    from draftlab.params import parse_params

    raw = {
        "target": {"tiny": {"pretrain_steps": 40, "hidden_size": 32, "intermediate_size": 64}},
        "prepare": {"num_samples": 39, "max_seq_len": 96, "regenerate": True, "max_new_tokens": 24},
        "extract": {"batch_tokens": 512},
    }
    for name, values in sections.items():
        raw.setdefault(name, {}).update(values)
    return parse_params(raw)


@pytest.fixture(scope="session")
def params():
    return tiny_params()


@pytest.fixture(scope="session")
def built(tmp_path_factory, params):
    """(params, target_dir, data_dir, store_dir) after target → prepare → extract."""
    from draftlab.stages import extract, prepare, target

    root = tmp_path_factory.mktemp("pipeline")
    target_dir, data_dir, store_dir = root / "target", root / "prepared", root / "hidden_states"
    target.run(params, out_dir=target_dir, report_path=root / "target.json")
    prepare.run(params, target_dir=target_dir, out_dir=data_dir)
    extract.run(params, target_dir=target_dir, data_dir=data_dir, out_dir=store_dir)
    return params, target_dir, data_dir, store_dir


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny matmuls: a second intra-op thread only spins while the other core is busy (~10x slower)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
