"""How long `draftlab status` takes on a run folder with 10^5 steps of records, against one with
10^3 (side by side, interleaved): the answer must not grow with the run (goal: < 1 s).

    python benchmarks/status_speed.py [--steps 100000] [--repeats 7]

Generates both run folders in a temp dir with the records a training writes (metrics.jsonl and
two ranks' profile/*.jsonl, one line a step; samples/; progress.json; checkpoints; a spool of
10^4 records waiting), then times `draftlab status --json` as a new process (what a user on
another shell runs: interpreter start, imports, reads) and `status()` in process. Prints the
median and spread of each, and the ratio of the big folder to the small one.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def make_run(path: Path, steps: int) -> Path:
    from draftlab.rundir import Progress, RankPlan, RunDir, RunState

    rd = RunDir(path)
    path.mkdir(parents=True)
    rd.run.write(RunState(key="k", run_id="0123456789abcdef"))
    rd.plan.write(RankPlan(total_steps=steps * 2, step_tokens=[8192] * (steps * 2)))
    now = time.time()
    with open(rd.step_metrics_path, "w") as f:
        for s in range(steps):
            f.write(json.dumps({"step": s, "epoch": s // 35_446, "train/loss": 3.0, "train/loss_0": 1.1,
                                "train/loss_1": 1.0, "train/loss_2": 0.9, "train/full_acc_0": 0.5}) + "\n")
    for rank in (0, 1):
        p = rd.profile_file(rank)
        p.parent.mkdir(parents=True, exist_ok=True)
        with open(p, "w") as f:
            for s in range(steps):
                f.write(json.dumps({"t": now - steps + s, "rank": rank, "step": s, "fetch_ms": 10.0, "fwd_ms": 200.0,
                                    "bwd_ms": 400.0, "opt_ms": 50.0, "step_ms": 700.0}) + "\n")
    with open(rd.spool_path, "w") as f:
        for s in range(10_000):
            f.write(json.dumps({"run_id": "0123456789abcdef", "kind": "metrics", "metrics": {"train/loss": 3.0},
                                "step": s, "timestamp": 0}) + "\n")
    for epoch in range(3):
        ck = rd.checkpoints / str(epoch)
        ck.mkdir(parents=True)
        (ck / "training_state.json").write_text(json.dumps({"epoch": epoch, "local_step": 0,
                                                            "global_step": (epoch + 1) * steps // 3}))
        (ck / "model.safetensors").write_bytes(b"\0" * 1024)
    rd.progress.write(Progress(step=steps - 1, total_steps=steps * 2, epoch=2, updated_at=now, eta_s=3600.0,
                               eta_p10_s=3500.0, eta_p90_s=3700.0, losses={"loss_0": 1.1, "loss": 3.0},
                               convergence="learning", experiment_id="1"))
    return path


def time_cli(path: Path) -> float:
    t = time.perf_counter()
    subprocess.run([sys.executable, "-m", "draftlab.cli", "status", str(path), "--json"], check=True,
                   capture_output=True)
    return time.perf_counter() - t


def time_inproc(path: Path) -> float:
    from draftlab.status import status

    t = time.perf_counter()
    status(path)
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=100_000)
    ap.add_argument("--repeats", type=int, default=7)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        big, small = make_run(Path(tmp) / "big", a.steps), make_run(Path(tmp) / "small", 1_000)
        size = sum(p.stat().st_size for p in big.rglob("*") if p.is_file()) / 1e6
        print(f"run folder: {a.steps:,} steps of records, {size:,.0f} MB")
        cli = {"big": [], "small": []}
        inproc = {"big": [], "small": []}
        for _ in range(a.repeats):  # interleaved: the host's drift hits both alike
            for name, path in (("big", big), ("small", small)):
                cli[name].append(time_cli(path))
                inproc[name].append(time_inproc(path))
        for label, d in (("`draftlab status --json` (new process)", cli), ("status() in process", inproc)):
            med = {k: statistics.median(v) for k, v in d.items()}
            print(f"{label}: {a.steps:,} steps {med['big']:.3f} s (min {min(d['big']):.3f}, max {max(d['big']):.3f}); "
                  f"1,000 steps {med['small']:.3f} s; ratio {med['big'] / med['small']:.2f}")
        worst = max(cli["big"])
        print(f"goal < 1 s on {a.steps:,} steps: {'met' if statistics.median(cli['big']) < 1 else 'NOT met'} "
              f"(median {statistics.median(cli['big']):.3f} s, slowest of {a.repeats} {worst:.3f} s)")


if __name__ == "__main__":
    main()
