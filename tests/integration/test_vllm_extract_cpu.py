"""`extract.backend: vllm` against the real vLLM (the CPU build), started and stopped by draftlab:
its store passes verify, matches the hf backend's within the bound docs/reliability.md states,
trains, survives a kill -9 (byte-identical after the rerun, nothing left running), and its fp8
store is what speculators' fp8 reader dequantizes.

Needs vLLM (DRAFTLAB_VLLM_PYTHON or the checkout's .venv-vllm); skips with the reason without it.
The tiny target has 2 heads and 1 KV head (head_dim 32): vLLM's CPU attention serves no smaller."""

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from draftlab.store import layout as store
from draftlab.serve import vllm_env
from draftlab.store import vllm_extract

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(vllm_env.vllm_unavailable_reason() is not None,
                                 reason=vllm_env.vllm_unavailable_reason() or "")]

NUM_SAMPLES = 240  # a few seconds of generation: room to kill it in the middle


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _raw(**extract) -> dict:
    return {"target": {"tiny": {"hidden_size": 64, "intermediate_size": 128, "num_heads": 2, "num_kv_heads": 1,
                                "pretrain_steps": 0}},
            "prepare": {"num_samples": NUM_SAMPLES, "max_seq_len": 96, "regenerate": False},
            "extract": {"backend": "vllm", "vllm_port": _free_port(), **extract}}


def _extract(root: Path, raw: dict, out: str) -> subprocess.Popen:
    params_path = root / f"params-{out}.yaml"
    params_path.write_text(yaml.safe_dump(raw))
    return subprocess.Popen(
        [sys.executable, "-m", "draftlab.cli", "extract", "--params", str(params_path), "--target", str(root / "target"),
         "--data", str(root / "prepared"), "--out", str(root / out)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=root,
        env=dict(os.environ, MLFLOW_TRACKING_URI=f"sqlite:///{root / 'mlflow.db'}", DRAFTLAB_TEST_MARK=str(root)))


def _ok(proc: subprocess.Popen) -> None:
    assert proc.wait(timeout=900) == 0, proc.stderr.read()[-3000:]


def _ours(root: Path) -> list[int]:
    """Live processes that extract started here (the server, its engine, the generator): they carry
    this test's marker in their environment (vLLM retitles its engine, so not in their command line)."""
    mark = f"DRAFTLAB_TEST_MARK={root}".encode()
    pids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                env = (d / "environ").read_bytes().split(b"\0")
                state = (d / "stat").read_text().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue
            if mark in env and state not in ("Z", "X"):
                pids.append(int(d.name))
    return pids


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory, one_torch_thread):
    """A target and prepared data, the hf backend's store and the vLLM backend's (uninterrupted).
    Built on one torch thread (the module's, tests/conftest.py): the target is the seed's random
    init and the data procedural (no pre-training, no regeneration), so the thread count changes
    nothing they hold; the hf store is held to vLLM's within a bound, not to fixed bytes; and a
    second thread on the loaded 2-core host only spins."""
    from draftlab.params import parse_params
    from draftlab.stages import extract, prepare, target

    root = tmp_path_factory.mktemp("vllm-cpu")
    params = parse_params({**_raw(), "extract": {"backend": "hf"}})
    target.run(params, out_dir=root / "target", report_path=root / "target.json")
    prepare.run(params, target_dir=root / "target", out_dir=root / "prepared")
    extract.run(params, target_dir=root / "target", data_dir=root / "prepared", out_dir=root / "hf")
    _ok(_extract(root, _raw(), "vllm"))
    return root


def test_the_vllm_store_verifies_and_matches_the_hf_backend(pipeline):
    from safetensors.torch import load_file

    root = pipeline
    assert store.verify(root / "vllm") == []
    m_vllm, m_hf = store.read_manifest(root / "vllm"), store.read_manifest(root / "hf")
    assert m_vllm.layer_ids == m_hf.layer_ids and m_vllm.key != m_hf.key  # never mixed with an hf store
    assert [f.tokens for f in m_vllm.files] == [f.tokens for f in m_hf.files]
    differing = total = 0
    for f in m_hf.files:
        a, b = load_file(root / "vllm" / f.name), load_file(root / "hf" / f.name)
        assert torch.equal(a["token_ids"], b["token_ids"]), f.name
        x, y = a["hidden_states"].float(), b["hidden_states"].float()
        assert a["hidden_states"].dtype == torch.bfloat16 and x.shape == y.shape, f.name
        # the bound docs/reliability.md states: one bf16 step of the larger magnitude, or 1e-5 near zero
        bound = torch.exp2(torch.floor(torch.log2(torch.maximum(x.abs(), y.abs()).clamp(min=1e-30))) - 7) + 1e-5
        assert ((x - y).abs() <= bound).all(), f"{f.name}: max |vLLM - hf| {(x - y).abs().max():.3g}"
        differing += int((x != y).sum())
        total += x.numel()
    assert differing / total < 0.01, f"{differing} of {total} values differ"  # the same computation, rounded


def test_the_vllm_store_trains(pipeline, tmp_path, monkeypatch):
    from draftlab.params import parse_params
    from draftlab.stages import train

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    raw = _raw()
    raw["train"] = {"epochs": 1, "total_seq_len": 256, "draft_vocab_size": 64}
    root = pipeline
    result = train.run(parse_params(raw), target_dir=root / "target", data_dir=root / "prepared",
                       store_dir=root / "vllm", out_dir=tmp_path / "run")
    assert result.total_steps > 0
    assert (tmp_path / "run" / "accounting-check.json").read_text().count('"problems": []') == 1


def test_kill_9_mid_extraction_then_rerun_is_byte_identical_and_nothing_runs(pipeline):
    root = pipeline
    proc = _extract(root, _raw(), "killed")
    work = store.work_dir(root / "killed")
    deadline = time.monotonic() + 600
    while len(list(work.glob("hs_*.safetensors"))) < 10:
        assert proc.poll() is None, proc.stderr.read()[-3000:]
        assert time.monotonic() < deadline, "no file written in 10 min"
        time.sleep(0.01)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    written = len(list(work.glob("hs_*.safetensors")))
    assert written < NUM_SAMPLES, "killed in the middle"
    deadline = time.monotonic() + 60
    while _ours(root) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _ours(root) == [], "the server, its engine and the generator die with extract"
    assert not (root / "killed").exists() and not store.has_manifest(work), "a killed run must not look finished"

    _ok(_extract(root, _raw(), "killed"))
    names = sorted(p.name for p in (root / "vllm").iterdir() if not p.name.startswith("."))
    assert names == sorted(p.name for p in (root / "killed").iterdir() if not p.name.startswith("."))
    for name in names:
        assert (root / "killed" / name).read_bytes() == (root / "vllm" / name).read_bytes(), name
    assert _ours(root) == []


def test_fp8_through_vllm_is_what_speculators_fp8_reader_reads(pipeline):
    from hs_connectors import FP8Transfer
    from safetensors.torch import load_file

    root = pipeline
    _ok(_extract(root, _raw(dtype="float8_e4m3fn"), "fp8"))
    assert store.verify(root / "fp8") == []
    m8 = store.read_manifest(root / "fp8")
    assert m8.dtype == "float8_e4m3fn"
    ref = store.read_manifest(root / "vllm")
    assert [f.tokens for f in m8.files] == [f.tokens for f in ref.files]
    reader = FP8Transfer(root / "fp8")
    for f in m8.files[:20]:
        d = load_file(root / "fp8" / f.name)
        assert d["hidden_states"].dtype == torch.float8_e4m3fn and d[store.SCALES_KEY].shape == (f.tokens, 1, 1)
        got = reader.get_cached(f.index)["hidden_states"].float()
        want = load_file(root / "vllm" / f.name)["hidden_states"].float()
        assert (got - want).norm() / want.norm() < 0.05, f.name  # e4m3: 3 mantissa bits
