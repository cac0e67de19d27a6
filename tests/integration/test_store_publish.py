"""extract keeps the store in its work folder and publishes it as hardlinks: DVC's removal of the
published output before a re-run (it is not `persist`) costs nothing and re-extracts nothing."""

import os
import shutil

from draftlab.store import layout as store
from tests.conftest import tiny_params


def test_a_removed_output_is_published_again_without_extracting(built, tmp_path):
    from draftlab.stages import extract

    params, target_dir, data_dir, _ = built
    out = tmp_path / "hidden_states"
    first = extract.run(params, target_dir=target_dir, data_dir=data_dir, out_dir=out)
    work = store.work_dir(out)
    assert first.extracted_now > 0
    assert {p.name for p in out.iterdir()} == {p.name for p in work.iterdir()}
    assert all(os.stat(p).st_ino == os.stat(work / p.name).st_ino for p in out.iterdir())  # no byte copied
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    shutil.rmtree(out)  # what `dvc repro` does to a non-persist output before the stage runs
    again = extract.run(params, target_dir=target_dir, data_dir=data_dir, out_dir=out)
    assert again.extracted_now == 0
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert store.verify(out) == []


def test_a_store_published_for_other_params_is_set_aside_not_deleted(built, tmp_path):
    from draftlab.stages import extract

    params, target_dir, data_dir, _ = built
    out = tmp_path / "hidden_states"
    extract.run(params, target_dir=target_dir, data_dir=data_dir, out_dir=out)
    old = store.read_manifest(out)
    fp16 = tiny_params(extract={"batch_tokens": 512, "dtype": "float16"})
    extract.run(fp16, target_dir=target_dir, data_dir=data_dir, out_dir=out)
    assert store.read_manifest(out).dtype == "float16" and store.verify(out) == []
    aside = store.stale_dir(out, old.key)
    assert store.read_manifest(aside).key == old.key and store.verify(aside) == []
