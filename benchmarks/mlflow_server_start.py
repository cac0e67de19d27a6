"""How long compose.yaml's MLflow tracking server takes to answer, and what it runs, with MLflow's job
runners off (MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false, compose's setting) against MLflow's default
(on: huey consumers for its GenAI jobs, which serve nothing draftlab logs), in pairs whose order
alternates.

Each start is the `mlflow` service's own command (tests/mlflow_server.py: the basic-auth app, one
worker) on a fresh sqlite store: from the spawn to the first answer of /health, then SETTLE_S
more, when its processes and their CPU seconds are counted, then stopped. Every start of the
team server pays it, and each test of the suite that starts one. Nothing passes or fails on timing.

    python benchmarks/mlflow_server_start.py            # 4 pairs, about 2 min here
    python benchmarks/mlflow_server_start.py --pairs 8
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # tests.mlflow_server
sys.path.insert(0, str(Path(__file__).resolve().parent))
from vllm_start import group_usage  # noqa: E402  (the same /proc count as vllm_start.py's)

SETTLE_S = 5.0  # the job runners start after /health answers


def start_once(work: Path, *, job_runners: bool) -> dict:
    from tests.mlflow_server import MlflowServer

    server = MlflowServer(f"sqlite:///{work / 'mlflow.db'}", work / "mlartifacts",
                          env={"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "true" if job_runners else "false"})
    try:
        t0 = time.perf_counter()
        server.start()
        wall = time.perf_counter() - t0
        time.sleep(SETTLE_S)
        processes, cpu = group_usage(server.proc.pid)
    finally:
        server.stop()
    return {"wall_s": wall, "cpu_s": cpu, "processes": processes}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pairs", type=int, default=4)
    args = ap.parse_args()
    runs: dict[str, list[dict]] = {"off": [], "on": []}
    with tempfile.TemporaryDirectory(prefix="mlflow_server_start-") as tmp:
        for i in range(args.pairs):
            order = ("off", "on") if i % 2 == 0 else ("on", "off")
            got = {}
            for kind in order:
                got[kind] = start_once(Path(tmp) / f"{kind}-{i}", job_runners=kind == "on")
                runs[kind].append(got[kind])
            print(f"pair {i} ({','.join(order)}): to /health, job runners off {got['off']['wall_s']:.1f} s "
                  f"({got['off']['processes']} processes, {got['off']['cpu_s']:.1f} s CPU), on "
                  f"{got['on']['wall_s']:.1f} s ({got['on']['processes']} processes, {got['on']['cpu_s']:.1f} s CPU)",
                  flush=True)

    def spread(xs):
        return f"median {statistics.median(xs):.2f} (spread {min(xs):.2f}–{max(xs):.2f})"

    for kind, what in (("off", "job runners off (compose.yaml)"), ("on", "job runners on (MLflow's default)")):
        print(f"RESULT start, {what}: to /health {spread([r['wall_s'] for r in runs[kind]])} s; "
              f"{SETTLE_S:.0f} s later {spread([r['processes'] for r in runs[kind]])} processes, "
              f"CPU {spread([r['cpu_s'] for r in runs[kind]])} s")
    ratios = [a["wall_s"] / b["wall_s"] for a, b in zip(runs["off"], runs["on"], strict=True)]
    cpu = [a["cpu_s"] / b["cpu_s"] for a, b in zip(runs["off"], runs["on"], strict=True)]
    print(f"RESULT off ÷ on, per pair: to /health {spread(ratios)}, CPU {spread(cpu)} over {args.pairs} pairs")


if __name__ == "__main__":
    main()
