"""DVC's conventions after a finished pipeline, tried as a DVC user would in a copy of the
session's `dvc repro` of the tiny default (real `dvc repro`, `dvc exp run`, MLflow, torchrun): `dvc status` says
"Data and pipelines are up to date" and a second `dvc repro` runs no stage, after `dvc repro`
and after `dvc exp run`; a damaged store file is still noticed (DVC's own output check with
`extract.dvc_track: files`, the `verify` stage with `manifest`)."""

from __future__ import annotations

import os

from draftlab.store import layout as store
from tests.checkout import copy_checkout, sh

UP_TO_DATE = "Data and pipelines are up to date."
# the default (offline) pipeline: a bare `dvc status` also lists online/dvc.yaml's stages until the
# online pipeline has been run (DVC's status covers every dvc.yaml of the repo; repro only the one named)
STATUS = ["dvc", "status", "dvc.yaml"]


def _sh(cmd, cwd, env):
    proc = sh(cmd, cwd, env)
    return proc.stdout + proc.stderr


def _ran(output: str) -> set[str]:
    return {line.split("'")[1] for line in output.splitlines() if line.startswith("Running stage '")}


def test_status_is_clean_and_repro_a_no_op_after_repro_and_exp_run_and_a_damaged_file_shows(reproduced, tmp_path):
    session_root, env, first = reproduced
    assert {"verify", "extract", "train", "evaluate", "export"} <= _ran(first)
    root = copy_checkout(session_root, tmp_path / "repo")
    assert UP_TO_DATE in _sh(STATUS, root, env)
    again = _sh(["dvc", "repro"], root, env)
    assert _ran(again) == set(), again

    _sh(["git", "add", "-A"], root, env)
    _sh(["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "pipeline"], root, env)
    exp = _sh(["dvc", "exp", "run", "-S", "train.lr=0.004"], root, env)
    assert "train" in _ran(exp) and "extract" not in _ran(exp), exp  # a train param: the store is kept
    assert UP_TO_DATE in _sh(STATUS, root, env)
    assert _ran(_sh(["dvc", "repro"], root, env)) == set()

    # files mode: DVC sees a damaged store file itself (its output check), and a repro repairs it
    hs = root / "data/hidden_states"
    victim = hs / store.read_manifest(hs).files[0].name
    os.chmod(victim, 0o644)  # DVC links it read-only
    with open(victim, "r+b") as f:
        f.write(b"\0" * 8)  # the safetensors header length
    status = " ".join(_sh(STATUS, root, env).split())
    # the file is a hardlink of its cache object: DVC says the output is "not in cache" (or "modified")
    assert "extract: changed outs:" in status and "data/hidden_states" in status, status
    repaired = _sh(["dvc", "repro"], root, env)
    assert "extract" in _ran(repaired) and store.verify(hs) == [], repaired
    assert UP_TO_DATE in _sh(STATUS, root, env)

    # manifest mode: DVC cannot see the files, so verify runs every time (and names the damage)
    _sh(["draftlab", "dvc-track", "manifest"], root, env)
    _sh(["dvc", "repro"], root, env)
    rerun = _sh(["dvc", "repro"], root, env)
    assert _ran(rerun) == {"verify"}, rerun
    victim = hs / store.read_manifest(hs).files[1].name
    os.chmod(victim, 0o644)
    with open(victim, "r+b") as f:
        f.write(b"\0" * 8)
    noticed = _sh(["dvc", "repro"], root, env)
    assert {"verify", "extract"} <= _ran(noticed) and victim.name in noticed, noticed
    assert store.verify(hs) == []
