"""`extract.dvc_track`: `draftlab dvc-track MODE` keeps params.yaml and dvc.yaml's extract outputs in
step (DVC itself reads the result), and `draftlab extract` refuses to run when they disagree,
before anything is read, moved or written."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from draftlab.cli import app

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def repo(tmp_path, monkeypatch):
    for name in ("dvc.yaml", "params.yaml"):
        shutil.copy(REPO / name, tmp_path / name)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _dvc_outs(root: Path) -> list:
    """extract's outputs as DVC itself resolves dvc.yaml + params.yaml."""
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    subprocess.run(["dvc", "init", "--no-scm", "-q"], cwd=root, env=env, check=True)
    code = ("from dvc.repo import Repo; r = Repo('.'); s = next(s for s in r.index.stages if s.name == 'extract');"
            "print([(str(o.def_path), o.use_cache, o.persist) for o in s.outs])")
    out = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, check=True)
    return eval(out.stdout.strip().splitlines()[-1])  # noqa: S307 (our own repr of a list of tuples)


def test_the_default_tracks_every_file_of_the_store(repo):
    from draftlab.params import load_params
    from draftlab.store import dvc_track

    assert load_params(repo / "params.yaml").extract.dvc_track == "files"
    assert dvc_track.declared(repo / "dvc.yaml") == "files"
    assert _dvc_outs(repo) == [("data/hidden_states", True, False), ("reports/extract.json", False, True)]


def test_manifest_mode_makes_only_the_manifest_an_output_and_back(repo):
    before_dvc, before_params = (repo / "dvc.yaml").read_text(), (repo / "params.yaml").read_text()
    res = CliRunner().invoke(app, ["dvc-track", "manifest"])
    assert res.exit_code == 0, res.output
    assert yaml.safe_load((repo / "params.yaml").read_text())["extract"]["dvc_track"] == "manifest"
    assert _dvc_outs(repo) == [("data/hidden_states/manifest.json", False, True), ("reports/extract.json", False, True)]
    # the rest of both files is untouched: every other stage, the comments
    assert "# The whole store" in (repo / "dvc.yaml").read_text()
    assert "# null = [2, L//2, L-3]" in (repo / "params.yaml").read_text()
    other = lambda text: {k: v for k, v in yaml.safe_load(text)["stages"].items() if k not in ("extract", "verify")}  # noqa: E731
    assert other((repo / "dvc.yaml").read_text()) == other(before_dvc)
    # DVC cannot see the store's files in this mode: the store check runs on every `dvc repro`
    assert yaml.safe_load((repo / "dvc.yaml").read_text())["stages"]["verify"]["always_changed"] is True
    assert "always_changed" not in yaml.safe_load(before_dvc)["stages"]["verify"]

    assert CliRunner().invoke(app, ["dvc-track", "files"]).exit_code == 0
    assert yaml.safe_load((repo / "dvc.yaml").read_text()) == yaml.safe_load(before_dvc)
    assert yaml.safe_load((repo / "params.yaml").read_text()) == {
        **yaml.safe_load(before_params),
        "extract": {**yaml.safe_load(before_params)["extract"], "dvc_track": "files"}}


def test_extract_refuses_params_and_dvc_yaml_that_disagree(repo):
    text = (repo / "params.yaml").read_text().replace("  min_free_disk_frac:", "  dvc_track: manifest\n  min_free_disk_frac:")
    (repo / "params.yaml").write_text(text)
    res = CliRunner().invoke(app, ["extract"])
    assert res.exit_code == 2
    line = " ".join(res.output.split())
    assert "extract.dvc_track is manifest" in line and "draftlab dvc-track manifest" in line
    assert not (repo / "data").exists()  # refused before anything was read or written


@pytest.mark.parametrize("mode", ["both", "", "Files"])
def test_an_unknown_mode_is_one_line_and_changes_nothing(repo, mode):
    before = (repo / "dvc.yaml").read_text(), (repo / "params.yaml").read_text()
    res = CliRunner().invoke(app, ["dvc-track", mode])
    assert res.exit_code == 2 and "not one of files, manifest" in res.output
    assert ((repo / "dvc.yaml").read_text(), (repo / "params.yaml").read_text()) == before
