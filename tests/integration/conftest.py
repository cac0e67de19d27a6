"""Fixtures of the integration tier: a tiny target, a prepared dataset and a hidden-state store
built once per test session with the real stage functions (small sizes, CPU only)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import yaml

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


@pytest.fixture
def mlflow_store(tmp_path, monkeypatch):
    """A fresh MLflow sqlite store for this test, the one every draftlab call in it uses."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    import mlflow

    mlflow.set_tracking_uri(uri)
    return mlflow.MlflowClient(uri)


def train_command(built, params, tmp_path: Path, out: Path, name: str = "params.yaml") -> list[str]:
    """`draftlab train` of `params` on the session's pipeline into `out`, as a user types it."""
    _, target_dir, data_dir, store_dir = built
    path = tmp_path / name
    path.write_text(yaml.safe_dump(params.model_dump()))
    return [sys.executable, "-m", "draftlab.cli", "train", "--params", str(path), "--target", str(target_dir),
            "--data", str(data_dir), "--store", str(store_dir), "--out", str(out)]
