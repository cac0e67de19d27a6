"""Fixtures of the integration tier: a tiny target, a prepared dataset and a hidden-state store
built once per test run with the real stage functions (small sizes, CPU only), shared by the
workers of a parallel run (tests.conftest.made_once)."""

from __future__ import annotations

import pytest

from tests.conftest import made_once, tiny_params


@pytest.fixture(scope="session")
def params():
    return tiny_params()


@pytest.fixture(scope="session")
def built(tmp_path_factory, params):
    """(params, target_dir, data_dir, store_dir) after target → prepare → extract."""

    def make(root):
        from draftlab.stages import extract, prepare, target

        target.run(params, out_dir=root / "target", report_path=root / "target.json")
        prepare.run(params, target_dir=root / "target", out_dir=root / "prepared")
        extract.run(params, target_dir=root / "target", data_dir=root / "prepared", out_dir=root / "hidden_states")

    root = made_once(tmp_path_factory, "pipeline", make)
    return params, root / "target", root / "prepared", root / "hidden_states"


@pytest.fixture(scope="session")
def reproduced(tmp_path_factory):
    """(root, env, output) of one `dvc repro` of the whole pipeline on the default params.yaml, in a
    checkout copy (tests/checkout.py), once per run. A test that only reads its outputs reads
    them here; one that changes anything changes its own `copy_checkout` of it."""
    from tests.checkout import checkout_copy, sh, user_env

    def make(folder):
        root, env = checkout_copy(folder / "repo")
        done = sh(["dvc", "repro"], root, env)
        (folder / "repro.out").write_text(done.stdout + done.stderr)

    folder = made_once(tmp_path_factory, "reproduced", make)
    return folder / "repo", user_env(), (folder / "repro.out").read_text()


@pytest.fixture(scope="session")
def wide_prepared(tmp_path_factory):
    """(params_path, target_dir, data_dir) for the tests that stop a `draftlab extract` after its
    Nth batch: a wider tiny target (H = 256, not pre-trained) and 60 prepared samples (its own
    responses kept), so an extraction at 256 tokens a batch has many batches; written by the real
    stages once per run, on one torch thread (its weights are the seed's random init, so the
    thread count changes nothing written; a second thread on the loaded 2-core host made target.run
    several times slower). Tests read them and extract into folders of their own."""

    def make(root):
        import torch
        import yaml

        from draftlab.params import load_params
        from draftlab.stages import prepare, target

        raw = {"target": {"tiny": {"hidden_size": 256, "intermediate_size": 512, "num_heads": 4,
                                   "num_kv_heads": 2, "pretrain_steps": 0}},
               "prepare": {"num_samples": 60, "max_seq_len": 128, "regenerate": False},
               "extract": {"batch_tokens": 256, "dtype": "float32"}}
        (root / "params.yaml").write_text(yaml.safe_dump(raw))
        params = load_params(root / "params.yaml")
        before = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            target.run(params, out_dir=root / "target", report_path=root / "target.json")
            prepare.run(params, target_dir=root / "target", out_dir=root / "prepared")
        finally:
            torch.set_num_threads(before)

    root = made_once(tmp_path_factory, "wide", make)
    return root / "params.yaml", root / "target", root / "prepared"
