"""`dvc repro` for real, in a temp copy of the repo on the tiny default: the pipeline runs up to
extract, a second run does nothing and says so, and changing an extract param re-runs extract
but not prepare."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from draftlab import store

REPO = Path(__file__).resolve().parents[2]


def _run(cmd, cwd, env):
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, f"{cmd} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def repo_copy(tmp_path_factory):
    dest = tmp_path_factory.mktemp("repo")
    files = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True)
    for rel in files.stdout.splitlines():
        src = REPO / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    env.pop("MLFLOW_TRACKING_URI", None)
    _run(["git", "init", "-q"], dest, env)
    _run(["git", "add", "-A"], dest, env)
    _run(["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "copy"], dest, env)
    return dest, env


@pytest.mark.slow
def test_dvc_repro_up_to_extract_then_nothing_then_only_extract(repo_copy):
    root, env = repo_copy
    out = _run(["dvc", "repro", "extract"], root, env)
    assert "Running stage 'extract'" in out
    manifest = store.read_manifest(root / "data/hidden_states")
    prepared = yaml.safe_load((root / "data/prepared/prepare.json").read_text())
    assert manifest["num_files"] == prepared["num_samples"] > 0
    assert store.verify(root / "data/hidden_states") == []

    again = _run(["dvc", "repro", "extract"], root, env)
    # Only the store check runs again (always_changed, seconds); it finds nothing, so no stage
    # that depends on it runs.
    ran = {line.split("'")[1] for line in again.splitlines() if line.startswith("Running stage '")}
    assert ran == {"verify"}, again
    assert "Stage 'extract' didn't change, skipping" in again

    params = yaml.safe_load((root / "params.yaml").read_text())
    params["extract"]["dtype"] = "float16"
    (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    changed = _run(["dvc", "repro", "extract"], root, env)
    assert "Running stage 'extract'" in changed
    assert "Running stage 'prepare'" not in changed and "Running stage 'target'" not in changed
    assert store.read_manifest(root / "data/hidden_states")["dtype"] == "float16"
    # The old store was moved aside, not mixed in and not deleted.
    assert list(root.glob("data/.stale-hidden_states-*"))


def test_dvc_cache_uses_links_not_copies():
    from configparser import ConfigParser

    cfg = ConfigParser()
    cfg.read(REPO / ".dvc/config")
    types = [t.strip() for t in cfg['cache']['type'].strip('"').split(",")]
    assert "copy" not in types and set(types) <= {"reflink", "hardlink", "symlink"}
