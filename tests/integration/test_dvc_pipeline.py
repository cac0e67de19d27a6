"""`dvc repro` for real, in a copy of the session's `dvc repro` of the tiny default: the pipeline
ran up to extract and DVC caches the store by hardlink; a second run does nothing; `dvc push` to a local
remote and `dvc pull` in a fresh clone give the same bytes, which verify and do not re-extract;
changing an extract param re-runs extract alone, and `git checkout` + `dvc checkout` bring the
old store back byte for byte; with `extract.dvc_track: manifest` DVC versions the manifest alone."""

import json
import os
import subprocess
from pathlib import Path

import yaml

from draftlab.store import layout as store
from tests.checkout import copy_checkout, sh

REPO = Path(__file__).resolve().parents[2]


def _run(cmd, cwd, env):
    proc = sh(cmd, cwd, env)
    return proc.stdout + proc.stderr


def _files(store_dir: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(store_dir.iterdir()) if p.is_file()}


def _du_bytes(root: Path, *paths: str) -> list[int]:
    """`du` of several paths in one call: a hardlinked inode counts once, for the first path."""
    out = subprocess.run(["du", "-s", "-B1", *paths], cwd=root, capture_output=True, text=True, check=True).stdout
    return [int(line.split()[0]) for line in out.splitlines()]


def test_dvc_versions_the_store_push_pull_checkout(reproduced, tmp_path):
    # the session's `dvc repro` of the tiny default (tests/integration/conftest.py), in a copy of
    # its own: the pipeline ran up to extract (and on) there, in a fresh checkout
    session_root, env, first = reproduced
    assert "Running stage 'extract'" in first
    root = copy_checkout(session_root, tmp_path / "repo")
    hs = root / "data/hidden_states"
    manifest = store.read_manifest(hs)
    prepared = yaml.safe_load((root / "data/prepared/prepare.json").read_text())
    assert manifest.num_files == prepared["num_samples"] > 0
    assert store.verify(hs) == []

    # Cached by hardlink, never copied: every file is its cache object (same inode; identical
    # samples share one), and the store adds nothing to the disk beyond itself.
    lock = yaml.safe_load((root / "dvc.lock").read_text())
    out = next(o for o in lock["stages"]["extract"]["outs"] if o["path"] == "data/hidden_states")
    cache = root / ".dvc/cache/files/md5"
    listing = json.loads((cache / out["md5"][:2] / out["md5"][2:]).read_text())
    assert sorted(e["relpath"] for e in listing) == sorted(p.name for p in hs.iterdir())
    for e in listing:
        assert os.stat(hs / e["relpath"]).st_ino == os.stat(cache / e["md5"][:2] / e["md5"][2:]).st_ino, e
    # extract's work folder keeps the same inodes (a file whose bytes another sample shares is
    # relinked by DVC to that sample's cache object)
    work, md5s = store.work_dir(hs), [e["md5"] for e in listing]
    assert all(os.stat(work / e["relpath"]).st_ino == os.stat(hs / e["relpath"]).st_ino
               for e in listing if md5s.count(e["md5"]) == 1)
    (cache_du,) = _du_bytes(root, ".dvc/cache")
    (store_du,) = _du_bytes(root, "data/hidden_states")
    together = sum(_du_bytes(root, ".dvc/cache", "data/hidden_states"))
    assert store_du >= manifest.total_bytes > 1e6 and cache_du >= manifest.total_bytes
    assert together <= cache_du + 0.05 * store_du  # a copied store would add another store_du
    assert os.stat(hs / manifest.files[0].name).st_mode & 0o222 == 0  # linked files are read-only

    again = _run(["dvc", "repro", "extract"], root, env)
    # Nothing changed: no stage runs, the store check included (DVC sees a changed store file
    # itself in this mode, extract.dvc_track: files)
    ran = {line.split("'")[1] for line in again.splitlines() if line.startswith("Running stage '")}
    assert ran == set(), again
    assert "Stage 'extract' didn't change, skipping" in again

    remote = tmp_path / "remote"
    _run(["dvc", "remote", "add", "-d", "local", str(remote)], root, env)
    _run(["git", "add", "-A"], root, env)
    _run(["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "v1"], root, env)
    v1 = _files(hs)
    _run(["dvc", "push"], root, env)

    clone = tmp_path / "clone"
    _run(["git", "clone", "-q", str(root), str(clone)], tmp_path, env)
    _run(["dvc", "pull", "--with-deps", "extract"], clone, env)  # extract and what it needs, alone
    assert _files(clone / "data/hidden_states") == v1
    _run(["draftlab", "verify", "data/hidden_states"], clone, env)
    pulled = _run(["dvc", "repro", "extract"], clone, env)
    assert "Running stage 'extract'" not in pulled and "Running stage 'prepare'" not in pulled, pulled

    params = yaml.safe_load((root / "params.yaml").read_text())
    params["extract"]["dtype"] = "float8_e4m3fn"
    (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    changed = _run(["dvc", "repro", "extract"], root, env)
    assert "Running stage 'extract'" in changed
    assert "Running stage 'prepare'" not in changed and "Running stage 'target'" not in changed
    assert store.read_manifest(hs).dtype == "float8_e4m3fn" and store.verify(hs) == []
    assert list(root.glob("data/.stale-hidden_states-*"))  # the old store's work folder, set aside
    _run(["git", "add", "-A"], root, env)
    _run(["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "v2 fp8"], root, env)

    _run(["git", "checkout", "-q", "HEAD~1"], root, env)
    _run(["dvc", "checkout", "extract"], root, env)  # extract's outputs alone
    assert _files(hs) == v1
    _run(["git", "checkout", "-q", "-"], root, env)
    _run(["dvc", "checkout", "extract"], root, env)  # extract's outputs alone
    assert store.read_manifest(hs).dtype == "float8_e4m3fn"

    # The old params back: extract finds the old store it set aside, nothing re-extracted (DVC's
    # run-cache is off for extract: a restore would check out damaged files from their own inodes)
    params["extract"]["dtype"] = "bfloat16"
    (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    back = _run(["dvc", "repro", "extract"], root, env)
    said = " ".join(back.split())  # rich wraps long lines
    assert "reusing the store set aside" in said and "(0 tokens extracted now" in said, said[-2000:]
    assert _files(hs) == v1

    # The opt-out (extract.dvc_track: manifest): only the manifest is extract's output, and a new
    # store adds no object to DVC's cache (DVC hashed none of its files); the store is complete.
    _run(["draftlab", "dvc-track", "manifest"], root, env)
    objects = {p.relative_to(cache) for p in cache.rglob("*") if p.is_file()}
    params = yaml.safe_load((root / "params.yaml").read_text())
    params["extract"]["dtype"] = "float16"
    (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    assert "Running stage 'extract'" in _run(["dvc", "repro", "extract"], root, env)
    lock = yaml.safe_load((root / "dvc.lock").read_text())
    assert [o["path"] for o in lock["stages"]["extract"]["outs"]] == ["data/hidden_states/manifest.json",
                                                                      "reports/extract.json"]
    assert {p.relative_to(cache) for p in cache.rglob("*") if p.is_file()} == objects
    assert store.read_manifest(hs).dtype == "float16" and store.verify(hs) == []
    assert "Stage 'extract' didn't change, skipping" in _run(["dvc", "repro", "extract"], root, env)


def test_dvc_cache_uses_links_not_copies():
    from configparser import ConfigParser

    cfg = ConfigParser()
    cfg.read(REPO / ".dvc/config")
    types = [t.strip() for t in cfg['cache']['type'].strip('"').split(",")]
    # reflink first falls back to a copy on ext4; hardlink first links (README "DVC")
    assert types == ["hardlink", "symlink"]
