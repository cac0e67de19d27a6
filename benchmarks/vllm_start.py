"""How long vLLM's CPU build takes to answer, started as draftlab starts it: the model in the engine's
process (draftlab's default on CPU, `vllm_env.cpu_server_env`: VLLM_ENABLE_V1_MULTIPROCESSING=0)
against vLLM's own default (a worker process of its own: a third Python process importing vLLM and
torch), in pairs whose order alternates.

Each start is draftlab's extraction server for the target (`vllm_extract.server_command`, the
synchronous connector, `--enforce-eager`) through `serving.running`: from the spawn to the first
answer of /v1/models, then stopped. A start also counts the CPU seconds of its process group (the
API server, the engine, any worker) up to that answer. Every server draftlab starts on CPU pays
this: online training, `evaluate.backend: vllm` (two servers), extraction through vLLM, and the
suite. Nothing passes or fails on timing.

Needs vLLM (DRAFTLAB_VLLM_PYTHON or .venv-vllm) and a target vLLM's CPU attention serves (head
size ≥ 32: the tiny default's models/target).

    python benchmarks/vllm_start.py                 # 4 pairs, about 3 min here
    python benchmarks/vllm_start.py --pairs 8 --target models/target
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def group_usage(pgid: int) -> tuple[int, float]:
    """(processes, utime + stime seconds) of the live processes in `pgid` (a server's children are
    not reaped yet). benchmarks/mlflow_server_start.py uses it too."""
    tick, count, total = os.sysconf("SC_CLK_TCK"), 0, 0
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
                if int(fields[2]) == pgid:
                    count += 1
                    total += int(fields[11]) + int(fields[12])
            except (OSError, ValueError, IndexError):
                continue
    return count, total / tick


def start_once(params, target: Path, work: Path, *, in_engine: bool) -> dict:
    from draftlab.serve import serving, vllm_env
    from draftlab.store import vllm_extract

    shared = work / "hs"
    shared.mkdir(parents=True, exist_ok=True)
    cmd = vllm_extract.server_command(params, python=vllm_env.vllm_python(), model=str(target),
                                      num_layers=params.target.tiny.num_layers, hidden_states_path=shared, cuda=False)
    env = vllm_extract.server_env([])
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if in_engine else "1"
    t0 = time.perf_counter()
    with serving.running(cmd, log_path=work / "vllm.log", what="benchmark", startup_timeout_s=600, env=env,
                         api_key=False) as server:
        server.get("/v1/models")
        wall = time.perf_counter() - t0
        _, cpu = group_usage(server.pid)
    return {"wall_s": wall, "cpu_s": cpu}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", type=Path, default=REPO / "params.yaml")
    ap.add_argument("--target", type=Path, default=REPO / "models/target")
    ap.add_argument("--pairs", type=int, default=4)
    args = ap.parse_args()
    from draftlab.params import load_params

    params = load_params(args.params)
    runs: dict[str, list[dict]] = {"engine": [], "worker": []}
    with tempfile.TemporaryDirectory(prefix="vllm_start-") as tmp:
        for i in range(args.pairs):
            order = ("engine", "worker") if i % 2 == 0 else ("worker", "engine")
            got = {}
            for kind in order:
                got[kind] = start_once(params, args.target, Path(tmp) / f"{kind}-{i}", in_engine=kind == "engine")
                runs[kind].append(got[kind])
            print(f"pair {i} ({','.join(order)}): to the first answer, model in the engine "
                  f"{got['engine']['wall_s']:.1f} s ({got['engine']['cpu_s']:.1f} s CPU), in a worker "
                  f"{got['worker']['wall_s']:.1f} s ({got['worker']['cpu_s']:.1f} s CPU), ratio "
                  f"{got['engine']['wall_s'] / got['worker']['wall_s']:.2f}", flush=True)

    def spread(xs):
        return f"median {statistics.median(xs):.2f} (spread {min(xs):.2f}–{max(xs):.2f})"

    ratios = [e["wall_s"] / w["wall_s"] for e, w in zip(runs["engine"], runs["worker"], strict=True)]
    for kind, what in (("engine", "model in the engine's process (draftlab's default on CPU)"),
                       ("worker", "a worker process of its own (vLLM's default)")):
        print(f"RESULT start, {what}: wall {spread([r['wall_s'] for r in runs[kind]])} s, "
              f"CPU {spread([r['cpu_s'] for r in runs[kind]])} s")
    print(f"RESULT start in the engine ÷ with a worker, per pair: {spread(ratios)} over {args.pairs} pairs")


if __name__ == "__main__":
    main()
