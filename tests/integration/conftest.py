"""Fixtures of the integration tier: a tiny target, a prepared dataset and a hidden-state store
built once per test session with the real stage functions (small sizes, CPU only)."""

from __future__ import annotations

import pytest

from tests.conftest import tiny_params


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


@pytest.fixture(scope="session")
def reproduced(tmp_path_factory):
    """(root, env, output) of one `dvc repro` of the whole pipeline on the default params.yaml, in a
    checkout copy (tests/checkout.py), once per session. A test that only reads its outputs reads
    them here; one that changes anything changes its own `copy_checkout` of it."""
    from tests.checkout import checkout_copy, sh

    root, env = checkout_copy(tmp_path_factory.mktemp("reproduced") / "repo")
    done = sh(["dvc", "repro"], root, env)
    return root, env, done.stdout + done.stderr


@pytest.fixture(scope="session")
def wide_prepared(tmp_path_factory):
    """(params_path, target_dir, data_dir) for the tests that stop a `draftlab extract` after its
    Nth batch: a wider tiny target (H = 256, not pre-trained) and 60 prepared samples (its own
    responses kept), so an extraction at 256 tokens a batch has many batches; written by the real
    stages once per session, on one torch thread (its weights are the seed's random init, so the
    thread count changes nothing written; a second thread on the loaded 2-core host made target.run
    several times slower). Tests read them and extract into folders of their own."""
    import torch
    import yaml

    from draftlab.params import load_params
    from draftlab.stages import prepare, target

    root = tmp_path_factory.mktemp("wide")
    raw = {"target": {"tiny": {"hidden_size": 256, "intermediate_size": 512, "num_heads": 4,
                               "num_kv_heads": 2, "pretrain_steps": 0}},
           "prepare": {"num_samples": 60, "max_seq_len": 128, "regenerate": False},
           "extract": {"batch_tokens": 256, "dtype": "float32"}}
    params_path = root / "params.yaml"
    params_path.write_text(yaml.safe_dump(raw))
    params = load_params(params_path)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        target.run(params, out_dir=root / "target", report_path=root / "target.json")
        prepare.run(params, target_dir=root / "target", out_dir=root / "prepared")
    finally:
        torch.set_num_threads(before)
    return params_path, root / "target", root / "prepared"
