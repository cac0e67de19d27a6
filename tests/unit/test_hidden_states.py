"""The hidden-state seam (draftlab.store.hidden_states): the source a launcher names in the
trainer's flags is the one a rank rebuilds from them, so the store's path reaches the ranks once."""

from __future__ import annotations

from pathlib import Path

from draftlab.rundir import RankPlan
from draftlab.store import layout as store
from draftlab.store.hidden_states import HiddenStateSource, StoreSource, source_from_trainer_args
from draftlab.training.job import speculators_argv
from tests.conftest import tiny_params


def test_a_rank_rebuilds_the_launchers_source_from_the_trainer_flags(tmp_path):
    source = StoreSource(tmp_path / "hs", dtype=store.FP8)
    argv = speculators_argv(tiny_params(), verifier="v", data_dir=tmp_path, source=source, out_dir=tmp_path,
                            layer_ids=[2, 4, 5], total_steps=3, d2t=tmp_path / "d2t", t2d=tmp_path / "t2d",
                            device="cpu")
    rebuilt = source_from_trainer_args(argv)
    assert isinstance(rebuilt, HiddenStateSource)
    assert rebuilt.trainer_args() == source.trainer_args() == ["--hidden-states-path", str(tmp_path / "hs"),
                                                               "--hidden-states-backend", "fp8"]
    assert rebuilt.mlflow_params() == {"store.dtype": store.FP8, "hidden_states_backend": "fp8"}


def test_the_store_path_is_in_the_trainer_flags_alone():
    assert "store_dir" not in RankPlan.model_fields
    assert source_from_trainer_args(["--epochs", "1"]) is None, "no store named: nothing to check reads against"


def test_a_store_source_reads_its_dtype_from_the_manifest_when_not_told(tmp_path):
    from draftlab.rundir import Manifest, StoreDir, TargetInfo

    StoreDir(tmp_path).manifest.write(Manifest(
        key="k", target=TargetInfo(source="tiny", num_layers=8, hidden_size=32), layer_ids=[2, 4, 5],
        num_files=0, num_tokens=0, total_bytes=0, files=[], dtype="bfloat16"))
    assert StoreSource(Path(tmp_path)).mlflow_params() == {"store.dtype": "bfloat16", "hidden_states_backend": "file"}
