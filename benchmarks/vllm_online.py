"""Online against offline, side by side in one run on the tiny default: training tokens/s with
hidden states from a live vLLM (`train.source: vllm`) against training from the store, and
extraction tokens/s of the vLLM backend against the hf backend.

One vLLM server draftlab starts for hidden states (`store.vllm_extract`'s command: on a host
without CUDA its synchronous connector, `--enforce-eager`) serves both the vLLM extraction (speculators'
`generate-offline-data` loop in this process, as benchmarks/vllm_extract.py) and the online trainings
(`train.vllm_url` names it, so the server's start is printed once, apart, and counted in neither).
Every round runs the four, order alternating: hf extraction into a fresh store (its own tok/s,
model loading excluded), vLLM extraction (tokens of the files ÷ the loop's seconds), then
`draftlab train` from that round's hf store and online, each into a fresh run folder (1 rank, 1 epoch).

Training figures, both from the run folder: `stepping` = real tokens ÷ the steps' own time
(speculators' step profile: fetch + forward + backward + optimizer, step 0 excluded), where the
online fetch holds the target's forward through vLLM; `run` = the train record's tokens/s (the
trained tokens ÷ torchrun's wall time, start-up included). Nothing passes or fails on timing.

Needs vLLM (DRAFTLAB_VLLM_PYTHON or .venv-vllm).

    python benchmarks/vllm_online.py                 # the tiny default (H=64, 160 samples), 3 rounds
    python benchmarks/vllm_online.py --rounds 5
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vllm_extract import _generate, _tokens  # noqa: E402  (the same generator loop and token count)


def _stepping_tokens_per_s(run_dir: Path) -> float:
    """Real tokens ÷ step time over rank 0's steps after the first (speculators' own profile)."""
    tokens = seconds = 0.0
    for line in (run_dir / "profile" / "rank0.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec["step"] == 0:
            continue
        tokens += rec["tokens_per_s"] * rec["step_ms"] / 1000
        seconds += rec["step_ms"] / 1000
    return tokens / seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--concurrency", type=int, default=32, help="generate-offline-data --concurrency")
    args = ap.parse_args()

    import socket

    import yaml

    from draftlab.models import resolve
    from draftlab.params import parse_params
    from draftlab.rundir import RunDir
    from draftlab.serve import serving
    from draftlab.stages import extract, prepare, target, train
    from draftlab.store import vllm_extract

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    raw = yaml.safe_load((Path(__file__).resolve().parents[1] / "params.yaml").read_text())  # the tiny default
    raw["train"].update({"epochs": 1, "gpus": 1})
    raw["extract"].update({"vllm_port": port})
    params = parse_params(raw)
    root = Path(tempfile.mkdtemp(prefix="vllm-online-bench-"))
    os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{root / 'mlflow.db'}"
    figures = {k: [] for k in ("hf extract", "vLLM extract", "offline train", "online train",
                               "offline run", "online run")}
    try:
        target.run(params, out_dir=root / "target", report_path=root / "target.json")
        prepare.run(params, target_dir=root / "target", out_dir=root / "prepared")
        python, gpus = vllm_extract.preflight(params)
        model = resolve(params, root / "target")
        shared = root / ".vllm-bench"
        shared.mkdir()
        cmd = vllm_extract.server_command(params, python=python, model=model, num_layers=params.target.tiny.num_layers,
                                          hidden_states_path=shared, cuda=bool(gpus))
        t0 = time.perf_counter()
        with serving.running(vllm_extract.guard_command(cmd), port=port, log_path=root / "vllm.log",
                             what="benchmark", startup_timeout_s=1800, env=vllm_extract.server_env(gpus),
                             port_key="--port", api_key=False) as server:
            print(f"vLLM server ({'GPU ' + ','.join(gpus) if gpus else 'CPU'}) answered in "
                  f"{time.perf_counter() - t0:.0f} s")
            online = parse_params({**raw, "train": {**raw["train"], "source": "vllm",
                                                    "vllm_url": f"{server.base_url}/v1"}})
            for r in range(args.rounds):
                store = root / f"hf-{r}"
                order = ["hf", "vllm", "offline", "online"]
                for which in (order if r % 2 == 0 else ["vllm", "hf", "online", "offline"]):
                    if which == "hf":
                        res = extract.run(params, target_dir=root / "target", data_dir=root / "prepared", out_dir=store)
                        figures["hf extract"].append(res.tokens_per_s)
                    elif which == "vllm":
                        out = root / f"vllm-{r}"
                        seconds = _generate(model, server.base_url, root / "prepared", out, args.concurrency)
                        figures["vLLM extract"].append(_tokens(out) / seconds)
                        shutil.rmtree(out, ignore_errors=True)
                    else:
                        run_dir = root / f"{which}-{r}"
                        train.run(online if which == "online" else params, target_dir=root / "target",
                                  data_dir=root / "prepared", store_dir=store if which == "offline" else None,
                                  out_dir=run_dir)
                        figures[f"{which} train"].append(_stepping_tokens_per_s(run_dir))
                        figures[f"{which} run"].append(RunDir(run_dir).train.read().tokens_per_s)
                        shutil.rmtree(run_dir, ignore_errors=True)
                shutil.rmtree(store, ignore_errors=True)
                shutil.rmtree(store.parent / f".{store.name}.work", ignore_errors=True)
                print(f"round {r}: " + ", ".join(f"{k} {v[-1]:,.0f}" for k, v in figures.items()) + " tok/s")
    finally:
        shutil.rmtree(root, ignore_errors=True)

    def spread(xs):
        return f"{statistics.median(xs):,.0f} tok/s (min {min(xs):,.0f}, max {max(xs):,.0f})"

    def ratio(a, b):
        rs = [x / y for x, y in zip(figures[a], figures[b])]
        return f"median {statistics.median(rs):.2f} (min {min(rs):.2f}, max {max(rs):.2f})"

    t = params.target.tiny
    print(f"tiny default: H={t.hidden_size}, {t.num_layers} layers, {params.prepare.num_samples} samples, "
          f"1 rank, 1 epoch, {args.rounds} rounds")
    print(f"  training, stepping:  offline (store) {spread(figures['offline train'])}")
    print(f"                       online (vLLM)   {spread(figures['online train'])}")
    print(f"                       online / offline per round: {ratio('online train', 'offline train')}")
    print(f"  training, whole run: offline {spread(figures['offline run'])}; online {spread(figures['online run'])}; "
          f"online / offline {ratio('online run', 'offline run')}")
    print(f"  extraction:          hf backend {spread(figures['hf extract'])}")
    print(f"                       vLLM backend {spread(figures['vLLM extract'])}")
    print(f"                       vLLM / hf per round: {ratio('vLLM extract', 'hf extract')}")


if __name__ == "__main__":
    main()
