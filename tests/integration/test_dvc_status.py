"""DVC's conventions after a finished pipeline, tried as a DVC user would in a temp copy of the
repo on the tiny sizes (real `dvc repro`, `dvc exp run`, MLflow, torchrun): `dvc status` says
"Data and pipelines are up to date" and a second `dvc repro` runs no stage, after `dvc repro`
and after `dvc exp run`; a damaged store file is still noticed (DVC's own output check with
`extract.dvc_track: files`, the `verify` stage with `manifest`)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

from draftlab.store import layout as store

REPO = Path(__file__).resolve().parents[2]
TINY = {  # tests/integration/test_bad_input.py's sizes: one short epoch of training
    "target": {"tiny": {"pretrain_steps": 40, "hidden_size": 32, "intermediate_size": 64}},
    "prepare": {"num_samples": 39, "max_seq_len": 96, "max_new_tokens": 24},
    "extract": {"batch_tokens": 512},
    "train": {"epochs": 1, "total_seq_len": 128, "draft_vocab_size": 64},
    "evaluate": {"num_prompts": 4, "max_new_tokens": 12},
}
UP_TO_DATE = "Data and pipelines are up to date."


def _sh(cmd, cwd, env):
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, f"{cmd} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout + proc.stderr


def _ran(output: str) -> set[str]:
    return {line.split("'")[1] for line in output.splitlines() if line.startswith("Running stage '")}


def _repo(dest: Path) -> tuple[Path, dict]:
    files = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True)
    for rel in files.stdout.splitlines():
        if (REPO / rel).is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / rel, dest / rel)
    from draftlab.params import merge

    params = merge(yaml.safe_load((REPO / "params.yaml").read_text()), TINY)
    (dest / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    env.pop("MLFLOW_TRACKING_URI", None)
    for cmd in (["git", "init", "-q"], ["git", "add", "-A"],
                ["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "copy"]):
        _sh(cmd, dest, env)
    return dest, env


def test_status_is_clean_and_repro_a_no_op_after_repro_and_exp_run_and_a_damaged_file_shows(tmp_path):
    root, env = _repo(tmp_path / "repo")
    first = _sh(["dvc", "repro"], root, env)
    assert {"verify", "extract", "train", "evaluate", "export"} <= _ran(first)
    assert UP_TO_DATE in _sh(["dvc", "status"], root, env)
    again = _sh(["dvc", "repro"], root, env)
    assert _ran(again) == set(), again

    _sh(["git", "add", "-A"], root, env)
    _sh(["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "pipeline"], root, env)
    exp = _sh(["dvc", "exp", "run", "-S", "train.lr=0.004"], root, env)
    assert "train" in _ran(exp) and "extract" not in _ran(exp), exp  # a train param: the store is kept
    assert UP_TO_DATE in _sh(["dvc", "status"], root, env)
    assert _ran(_sh(["dvc", "repro"], root, env)) == set()

    # files mode: DVC sees a damaged store file itself (its output check), and a repro repairs it
    hs = root / "data/hidden_states"
    victim = hs / store.read_manifest(hs).files[0].name
    os.chmod(victim, 0o644)  # DVC links it read-only
    with open(victim, "r+b") as f:
        f.write(b"\0" * 8)  # the safetensors header length
    status = " ".join(_sh(["dvc", "status"], root, env).split())
    # the file is a hardlink of its cache object: DVC says the output is "not in cache" (or "modified")
    assert "extract: changed outs:" in status and "data/hidden_states" in status, status
    repaired = _sh(["dvc", "repro"], root, env)
    assert "extract" in _ran(repaired) and store.verify(hs) == [], repaired
    assert UP_TO_DATE in _sh(["dvc", "status"], root, env)

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
