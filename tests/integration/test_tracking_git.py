"""git provenance tags against a real git repository."""

import subprocess


def test_git_dirty_ignores_pipeline_outputs(tmp_path):
    from draftlab.tracking import git_tags

    def git(*a):
        subprocess.run(["git", *a], cwd=tmp_path, check=True, capture_output=True)

    git("init", "-q")
    (tmp_path / "dvc.lock").write_text("a")
    (tmp_path / "src.py").write_text("a")
    git("add", "-A")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "x")
    (tmp_path / "dvc.lock").write_text("b")
    tags = git_tags(tmp_path)
    assert tags["git.dirty"] == "false" and len(tags["git.commit"]) == 40
    (tmp_path / "src.py").write_text("b")
    assert git_tags(tmp_path)["git.dirty"] == "true"
