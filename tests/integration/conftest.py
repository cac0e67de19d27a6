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
