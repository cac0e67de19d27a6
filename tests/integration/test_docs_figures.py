"""The tiny default's figures in docs/figures.md are what `dvc repro` of the default params gives
now: the pipeline runs for real in a temp copy of the repo (as `./quickstart.sh` runs it), and the
page's generated list must equal what scripts/gen_docs.py writes from that run's outputs."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _gen_docs():
    spec = importlib.util.spec_from_file_location("gen_docs", REPO / "scripts" / "gen_docs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_tiny_default_gives_the_figures_the_docs_quote(tmp_path):
    root = tmp_path / "repo"
    files = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True)
    for rel in files.stdout.splitlines():
        if (REPO / rel).is_file():
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / rel, root / rel)
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    env.pop("MLFLOW_TRACKING_URI", None)
    for cmd in (["git", "init", "-q"], ["git", "add", "-A"],
                ["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "copy"], ["dvc", "repro"]):
        done = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True)
        assert done.returncode == 0, f"{' '.join(cmd)}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"

    gen = _gen_docs()
    quoted = gen.region((REPO / "docs" / "figures.md").read_text(), "tiny-default")
    now = gen.tiny_default_figures(root)
    assert quoted == now, (
        "docs/figures.md quotes other tiny-default figures than this code gives; if the change is meant, "
        f"run `python scripts/gen_docs.py --tiny-run <a checkout after dvc repro>` and commit.\n"
        f"quoted:\n{quoted}\nnow:\n{now}")
