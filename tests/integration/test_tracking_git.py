"""git provenance tags against a real git repository."""

from tests.checkout import git_commit


def test_git_dirty_ignores_pipeline_outputs(tmp_path):
    from draftlab.tracking import git_tags

    git_commit(tmp_path, {"dvc.lock": "a", "src.py": "a"})
    (tmp_path / "dvc.lock").write_text("b")
    tags = git_tags(tmp_path)
    assert tags["git.dirty"] == "false" and len(tags["git.commit"]) == 40
    (tmp_path / "src.py").write_text("b")
    assert git_tags(tmp_path)["git.dirty"] == "true"


def test_a_dvc_experiments_params_are_the_experiment_not_dirt(tmp_path, monkeypatch):
    """Inside `dvc exp run -S …` (DVC sets DVC_EXP_NAME and DVC_EXP_BASELINE_REV for the stage
    commands and has edited params.yaml) the run records the experiment and is not dirty."""
    import hashlib

    from draftlab.tracking import git_tags, run_name

    git_commit(tmp_path, {"params.yaml": "train:\n  lr: 0.001\n", "src.py": "a"})
    (tmp_path / "params.yaml").write_text("train:\n  lr: 0.002\n")  # what `-S train.lr=0.002` does
    assert git_tags(tmp_path)["git.dirty"] == "true", "outside an experiment a params edit is a change"
    baseline = git_tags(tmp_path)["git.commit"]
    monkeypatch.setenv("DVC_EXP_NAME", "lr-2e-3")
    monkeypatch.setenv("DVC_EXP_BASELINE_REV", baseline)
    tags = git_tags(tmp_path)
    assert tags["git.dirty"] == "false"
    assert tags["dvc.exp.name"] == "lr-2e-3" and tags["dvc.exp.baseline"] == baseline
    assert tags["dvc.exp.params_sha256"] == hashlib.sha256(b"train:\n  lr: 0.002\n").hexdigest()
    assert run_name("train") == "train-lr-2e-3"
    (tmp_path / "src.py").write_text("b")
    assert git_tags(tmp_path)["git.dirty"] == "true", "a code change is still dirt inside an experiment"
