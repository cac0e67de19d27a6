"""Extraction tokens/s: the vLLM backend against the hf backend, on one target and one dataset.

Side by side in every round, order alternating: the hf backend's `extract.run` into a fresh store
(its own tok/s: model loading excluded), and speculators' `generate-offline-data` loop, run in
this process, against one vLLM server draftlab started for extraction (tokens of the files
written ÷ the loop's seconds: the server's start and the generator's imports excluded; the
server's start is printed once, apart). The vLLM server is draftlab's (`vllm_extract`): on a host
without CUDA its synchronous connector, `--enforce-eager`. Nothing passes or fails on timing.

The target is draftlab's tiny target with 2 heads and 1 KV head (head_dim 32: vLLM's CPU
attention serves no smaller), `--hidden-size` wide; needs vLLM (DRAFTLAB_VLLM_PYTHON or .venv-vllm).

    python benchmarks/vllm_extract.py                       # H=64, 160 samples, 3 rounds
    python benchmarks/vllm_extract.py --hidden-size 256 --samples 320 --rounds 5
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import tempfile
import time
from pathlib import Path


def _tokens(store: Path) -> int:
    from safetensors import safe_open

    n = 0
    for f in store.glob("hs_*.safetensors"):
        with safe_open(f, "pt") as h:
            n += h.get_slice("token_ids").get_shape()[0]
    return n


def _generate(model: str, base: str, data: Path, out: Path, concurrency: int) -> float:
    """speculators' generate-offline-data loop in this process; its seconds."""
    from speculators.cli.generate_offline_data import _generate_and_save_hidden_states

    started = time.perf_counter()
    asyncio.run(_generate_and_save_hidden_states(
        model=model, endpoint=f"{base}/v1", preprocessed_data=str(data), output=str(out), max_samples=None,
        concurrency=concurrency, validate_outputs=True, request_timeout=120, max_retries=0, fail_on_error=True,
        max_consecutive_errors=None, world_size=1, rank=0))
    return time.perf_counter() - started


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden-size", type=int, default=64)
    ap.add_argument("--samples", type=int, default=160)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--concurrency", type=int, default=32, help="generate-offline-data --concurrency")
    args = ap.parse_args()

    import socket

    from draftlab.models import resolve
    from draftlab.params import parse_params
    from draftlab.serve import serving
    from draftlab.stages import extract, prepare, target
    from draftlab.store import vllm_extract

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    raw = {"target": {"tiny": {"hidden_size": args.hidden_size, "intermediate_size": 3 * args.hidden_size,
                               "num_heads": args.hidden_size // 32, "num_kv_heads": 1, "pretrain_steps": 0}},
           "prepare": {"num_samples": args.samples, "regenerate": False},
           "extract": {"backend": "vllm", "vllm_port": port}}
    params = parse_params(raw)
    hf_params = parse_params({**raw, "extract": {"backend": "hf"}})
    root = Path(tempfile.mkdtemp(prefix="vllm-extract-bench-"))
    try:
        target.run(params, out_dir=root / "target", report_path=root / "target.json")
        prepare.run(params, target_dir=root / "target", out_dir=root / "prepared")
        python, gpus = vllm_extract.preflight(params)
        model = resolve(params, root / "target")
        shared = vllm_extract.shared_dir(root / "vllm")
        shared.mkdir(parents=True)
        cmd = vllm_extract.server_command(params, python=python, model=model, num_layers=params.target.tiny.num_layers,
                                          hidden_states_path=shared, cuda=bool(gpus))
        t0 = time.perf_counter()
        hf_tps, vllm_tps = [], []
        with serving.running(vllm_extract.guard_command(cmd), port=port, log_path=root / "vllm.log",
                             what="benchmark", startup_timeout_s=1800, env=vllm_extract.server_env(gpus),
                             port_key="--port") as base:
            print(f"vLLM server ({'GPU ' + ','.join(gpus) if gpus else 'CPU'}) answered /health in "
                  f"{time.perf_counter() - t0:.0f} s")
            for r in range(args.rounds):
                for which in (("hf", "vllm") if r % 2 == 0 else ("vllm", "hf")):
                    out = root / f"{which}-{r}"
                    if which == "hf":
                        res = extract.run(hf_params, target_dir=root / "target", data_dir=root / "prepared", out_dir=out)
                        hf_tps.append(res.tokens_per_s)
                    else:
                        seconds = _generate(model, base, root / "prepared", out, args.concurrency)
                        vllm_tps.append(_tokens(out) / seconds)
                    shutil.rmtree(out, ignore_errors=True)
                    shutil.rmtree(out.parent / f".{out.name}.work", ignore_errors=True)
                print(f"round {r}: hf {hf_tps[-1]:,.0f} tok/s, vLLM {vllm_tps[-1]:,.0f} tok/s")
    finally:
        shutil.rmtree(root, ignore_errors=True)

    def spread(xs):
        return f"{statistics.median(xs):,.0f} tok/s (min {min(xs):,.0f}, max {max(xs):,.0f})"

    ratios = [v / h for v, h in zip(vllm_tps, hf_tps)]
    print(f"H={args.hidden_size}, {params.target.tiny.num_layers} layers, {args.samples} samples, {args.rounds} rounds")
    print(f"  hf backend:   {spread(hf_tps)}")
    print(f"  vLLM backend: {spread(vllm_tps)}")
    print(f"  vLLM / hf per round: median {statistics.median(ratios):.2f} (min {min(ratios):.2f}, max {max(ratios):.2f})")


if __name__ == "__main__":
    main()
