"""Bad input and corrupt data, tried as a user would on a finished tiny pipeline (a temp copy of
the repo, real `dvc repro`, real MLflow, real torchrun): every refusal is exit code 2 and one
line naming the key or file, and every file produced before is byte-identical afterwards; a
damaged store is named by training and repaired by `extract`, file by file."""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

import pytest
import yaml

from draftlab.rundir import RunDir, StoreDir
from draftlab.store import layout as store
from tests.checkout import checkout_copy, copy_checkout
from tests.checkout import sh as _sh

TINY = {  # the session's tiny sizes (tests/conftest.py), one short epoch of training
    "target": {"tiny": {"pretrain_steps": 40, "hidden_size": 32, "intermediate_size": 64}},
    "prepare": {"num_samples": 39, "max_seq_len": 96, "max_new_tokens": 24},
    "extract": {"batch_tokens": 512},
    "train": {"epochs": 1, "total_seq_len": 128, "draft_vocab_size": 64},
}
SKIP = {".git", ".dvc", "params.yaml", "__pycache__"}  # what a test edits, or DVC's own state


def _flat(proc) -> str:
    """Both streams as one line: rich wraps long lines at the terminal width."""
    return " ".join((proc.stdout + proc.stderr).split())


def _stage_cmd(root: Path, stage: str) -> list[str]:
    cmd = yaml.safe_load((root / "dvc.yaml").read_text())["stages"][stage]["cmd"].split()
    return [sys.executable, "-m", "draftlab.cli", *cmd[1:]]


def snapshot(root: Path) -> dict[str, str]:
    """sha256 of every file under root but what the test edits (params.yaml) and git/DVC state."""
    out = {}
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root)
        if path.is_file() and not (set(rel.parts) & SKIP):
            out[str(rel)] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


def _set(root: Path, text: str) -> None:
    (root / "params.yaml").write_text(text)


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A temp copy of the repo after `dvc repro train` on the tiny sizes."""
    root, env = checkout_copy(tmp_path_factory.mktemp("finished"), params=TINY)
    _sh(["dvc", "repro", "train"], root, env)
    return root, env


@pytest.fixture
def copy(finished, tmp_path):
    root, env = finished
    return copy_checkout(root, tmp_path / "repo"), env


def _refused(proc, *needles):
    lines = [l for l in proc.stderr.splitlines() if l.strip()]
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


CASES = {
    # name: (params edit on the tiny params, stage, what the line names, also under `dvc repro`)
    "total_seq_len": (lambda p: p["train"].update(total_seq_len=3), "train", "train.total_seq_len: 3 would truncate", True),
    # under dvc repro, verify refuses it before DVC deletes extract's output (the published store)
    "layer_ids": (lambda p: p["extract"].update(layer_ids=[2, 4, 99]), "extract", "extract.layer_ids", True),
    "missing_target": (lambda p: p["target"].update(source="local", path="no/such/model"), "target", "target.path", True),
    "num_samples": (lambda p: p["prepare"].update(num_samples=-1), "prepare", "prepare.num_samples", True),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_bad_param_is_refused_and_nothing_produced_changes(copy, case):
    root, env = copy
    edit, stage, needle, under_dvc = CASES[case]
    params = yaml.safe_load((root / "params.yaml").read_text())
    edit(params)
    _set(root, yaml.safe_dump(params, sort_keys=False))
    before = snapshot(root)
    store_files = [rel for rel in before if rel.startswith("data/hidden_states/")]
    assert len(store_files) > 1 and "data/hidden_states/manifest.json" in store_files, "the store is hashed too"
    _refused(_sh(_stage_cmd(root, stage), root, env, ok=False), needle)
    assert snapshot(root) == before
    if under_dvc:
        repro = _sh(["dvc", "repro", stage], root, env, ok=False)
        assert repro.returncode != 0 and needle in repro.stdout + repro.stderr
        assert snapshot(root) == before, "dvc repro deleted or changed a previous output"
    assert not list(root.glob("data/.stale-*")) and not list(root.glob("runs/.stale-*"))


def test_empty_and_duplicated_params_files_are_refused(copy):
    root, env = copy
    before = snapshot(root)
    good = (root / "params.yaml").read_text()
    _set(root, "# nothing here\n")
    _refused(_sh(_stage_cmd(root, "train"), root, env, ok=False), "params.yaml: empty params file")
    assert _sh(["dvc", "repro"], root, env, ok=False).returncode != 0
    assert snapshot(root) == before
    _set(root, good + "\ntrain:\n  epochs: 5\n")
    _refused(_sh(_stage_cmd(root, "train"), root, env, ok=False), "duplicated key 'train'")
    _set(root, good.replace("  epochs: 1\n", "  epochs: 1\n  epochs: 4\n"))
    _refused(_sh(_stage_cmd(root, "train"), root, env, ok=False), "duplicated key 'train.epochs'")
    assert snapshot(root) == before


def test_a_shallow_target_default_layer_ids_are_refused_from_its_config(copy):
    """A 6-layer Qwen3: the default [2, L//2, L-3] = [2, 3, 3] is refused before the store is
    set aside, the target is loaded or an MLflow run is logged (mlflow.db is in the snapshot)."""
    from transformers import Qwen3Config

    root, env = copy
    Qwen3Config(num_hidden_layers=6, hidden_size=48, intermediate_size=96, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, vocab_size=300).save_pretrained(root / "qwen6")
    params = yaml.safe_load((root / "params.yaml").read_text())
    params["target"].update(source="local", path="qwen6")
    _set(root, yaml.safe_dump(params, sort_keys=False))
    before = snapshot(root)
    line = _refused(_sh(_stage_cmd(root, "extract"), root, env, ok=False), "extract.layer_ids")
    assert "[2, 3, 3]" in line and "6 layers" in line
    assert snapshot(root) == before and not list(root.glob("data/.stale-*"))


def _flip_byte(path: Path) -> None:
    blob = bytearray(path.read_bytes())
    blob[-5] ^= 0xFF  # inside the tensor data, past the header
    path.write_bytes(bytes(blob))


def _rot(path: Path) -> None:
    """Bit rot: a flipped byte, size and mtime as they were."""
    st = path.stat()
    _flip_byte(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_damaged_files_are_named_by_train_and_repaired_by_extract(copy):
    root, env = copy
    hs = root / "data/hidden_states"
    original = {p.name: p.read_bytes() for p in hs.glob("hs_*.safetensors")}
    (hs / "hs_5.safetensors").write_bytes(original["hs_5.safetensors"][:-100])  # truncated
    (hs / "hs_7.safetensors").unlink()  # deleted
    (hs / "hs_9.safetensors").write_bytes(b"\xff" * 8 + original["hs_9.safetensors"][8:])  # garbage header
    _flip_byte(hs / "hs_3.safetensors")
    before = snapshot(root)
    line = _refused(_sh(_stage_cmd(root, "train"), root, env, ok=False), "hidden_states/hs_", store.REPAIR)
    assert "3 bad file(s)" in line  # sizes and headers: the flipped byte is the loader's (below)
    after = snapshot(root)
    bad_files = StoreDir(Path(".")).bad_files_path.name
    recorded = {rel for rel in after if rel.endswith(bad_files)}
    assert recorded == {f"data/hidden_states/{bad_files}", f"data/.hidden_states.work/{bad_files}"}, \
        "what training named is recorded in the store, for extract"
    assert {k: v for k, v in after.items() if k not in recorded} == before, "a refused training must not touch runs/train"
    verify = _sh([sys.executable, "-m", "draftlab.cli", "verify", str(hs)], root, env, ok=False)
    assert verify.returncode == 2
    for n, what in ((3, "corrupt"), (5, "truncated"), (7, "missing"), (9, "garbage header")):
        assert f"hs_{n}.safetensors: {what}" in verify.stderr

    untouched = {n: (hs / n).stat().st_mtime_ns for n in original if n not in
                 {"hs_3.safetensors", "hs_5.safetensors", "hs_7.safetensors", "hs_9.safetensors"}}
    repro = _sh(["dvc", "repro", "extract"], root, env)
    assert "Running stage 'extract'" in repro.stdout
    assert {p.name: p.read_bytes() for p in hs.glob("hs_*.safetensors")} == original
    assert {n: (hs / n).stat().st_mtime_ns for n in untouched} == untouched, "only the bad files are rewritten"
    assert store.verify(hs) == []
    again = _sh(["dvc", "repro", "extract"], root, env)
    # the check's report went back to "no problems": extract runs once more, a no-op
    assert "Running stage 'extract'" not in again.stdout or "(0 tokens extracted now" in _flat(again)


def test_a_flipped_byte_stops_training_at_the_file(copy):
    """Size and header are right, so only the loader's sha256 sees it: the run stops naming the
    file and the repair command, the MLflow run is FAILED, and `draftlab extract` repairs it."""
    root, env = copy
    hs = root / "data/hidden_states"
    good = (hs / "hs_0.safetensors").read_bytes()
    _rot(hs / "hs_0.safetensors")  # extract alone would trust it (size and mtime as written)
    cmd = _stage_cmd(root, "train")
    cmd[cmd.index("--out") + 1] = "runs/other"
    proc = _sh(cmd, root, env, ok=False)
    assert proc.returncode == 1
    last = [l for l in proc.stderr.splitlines() if l.startswith("error:")][-1]
    assert "hs_0.safetensors: corrupt (sha256 differs from the manifest)" in last and store.REPAIR in last
    assert not RunDir(root / "runs/other").train.exists()
    run_id = RunDir(root / "runs/other").run.read().run_id
    assert run_id in last
    for word in last.split():  # a path it names must exist
        if word.startswith(("runs/", str(root))):
            assert Path(root, word.rstrip(";,")).exists(), word
    import mlflow

    client = mlflow.MlflowClient(f"sqlite:///{root / 'mlflow.db'}")
    assert client.get_run(run_id).info.status == "FAILED"
    assert "hs_0.safetensors" in store.recorded_bad(hs), "the loader recorded what it named"
    status = " ".join(_sh(["dvc", "status", "dvc.yaml"], root, env).stdout.split())
    assert "extract: changed outs:" in status and "data/hidden_states" in status, status  # the record is new there
    fix = _sh(_stage_cmd(root, "extract"), root, env)
    assert "re-extracting" in fix.stderr and "hs_0.safetensors: corrupt" in _flat(fix)
    assert (hs / "hs_0.safetensors").read_bytes() == good


def test_a_set_aside_store_is_reused_when_the_params_return(copy):
    root, env = copy
    hs = root / "data/hidden_states"
    original = {p.name: p.read_bytes() for p in hs.iterdir() if p.is_file()}
    good = (root / "params.yaml").read_text()
    _set(root, good.replace("  dtype: bfloat16\n", "  dtype: float16\n", 1))
    assert "dtype: float16" in (root / "params.yaml").read_text()
    _sh(_stage_cmd(root, "extract"), root, env)
    assert store.read_manifest(hs).dtype == "float16"
    _set(root, good)
    back = _sh(_stage_cmd(root, "extract"), root, env)
    assert "reusing the store set aside" in _flat(back) and "(0 tokens extracted now" in _flat(back)
    assert {p.name: p.read_bytes() for p in hs.iterdir() if p.is_file()} == original
    assert len(list(root.glob("data/.stale-hidden_states-*"))) == 1  # the float16 one, kept
