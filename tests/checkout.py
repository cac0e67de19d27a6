"""A copy of the repository as a user's checkout, for tests that run `dvc` or the CLI in it: the
tracked files in a fresh git repository (DVC needs one, and `git.dirty` reads it), the params a
test asks for merged over params.yaml, and the environment a user's shell would have (this venv on
PATH, no MLFLOW_TRACKING_URI: the checkout's own ./mlflow.db)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
COMMIT = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm"]


def sh(cmd: list[str], cwd: Path, env: dict, ok: bool = True, **kw) -> subprocess.CompletedProcess:
    """Run `cmd`; unless `ok` is False it must exit 0 (the failure shows both streams' tails)."""
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, **kw)
    if ok:
        assert proc.returncode == 0, f"{cmd} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def user_env() -> dict:
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    env.pop("MLFLOW_TRACKING_URI", None)
    return env


def checkout_copy(dest: Path, *, params: dict | None = None, whole_params: dict | None = None,
                  placed: dict[str, Path] | None = None) -> tuple[Path, dict]:
    """The repo's tracked files in `dest`, with `params` merged over its params.yaml
    (draftlab.params.merge) or `whole_params` as the whole file, and `placed` folders copied in at
    their paths (e.g. {"data/hidden_states": a built store}); all of it one commit. (dest, env)."""
    files = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True)
    for rel in files.stdout.splitlines():
        if (REPO / rel).is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / rel, dest / rel)
    if params is not None:
        from draftlab.params import merge

        whole_params = merge(yaml.safe_load((REPO / "params.yaml").read_text()), params)
    if whole_params is not None:
        (dest / "params.yaml").write_text(yaml.safe_dump(whole_params, sort_keys=False))
    for rel, src in (placed or {}).items():
        shutil.copytree(src, dest / rel)
    env = user_env()
    for cmd in (["git", "init", "-q"], ["git", "add", "-A"], [*COMMIT, "copy"]):
        sh(cmd, dest, env)
    return dest, env


def copy_checkout(src: Path, dest: Path) -> Path:
    """`cp -a` of a checkout: hardlinks kept (the store, its work folder and DVC's cache share inodes
    as in a real repo), so a test may change its copy and no other test sees it."""
    subprocess.run(["cp", "-a", str(src), str(dest)], check=True)
    return dest


def git_commit(root: Path, files: dict[str, str]) -> None:
    """`files` (path → text) written in `root`, committed as a new git repository's first commit."""
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    for cmd in (["git", "init", "-q"], ["git", "add", "-A"], [*COMMIT, "x"]):
        subprocess.run(cmd, cwd=root, check=True, capture_output=True)
