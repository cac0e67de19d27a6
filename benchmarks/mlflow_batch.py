"""What one training step's metrics cost MLflow's store to write, by how many steps go in one
`log_batch`: the relay's uploads (draftlab.tracking.Relay, about once a second) against larger
batches, side by side in one run.

Each round writes STEPS steps of the metric names rank 0 logs every step (train/loss_k,
full_acc_k and cond_acc_k of 3 TTT steps, train/loss, epoch, the learning rate and the perf/*
rates and ETA: 18) into a fresh sqlite store through draftlab's MlflowTracker.log_metrics_many,
in batches of each size in turn (the order rotates every round), and measures this thread's CPU
time. It prints the median and min-max CPU per step of each batch size. Nothing passes or fails
on timing.

    python benchmarks/mlflow_batch.py                # 3 rounds, 960 steps each
    python benchmarks/mlflow_batch.py --rounds 5 --batches 24 120 480 960
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import tempfile
import time

NAMES = ([f"train/{m}_{k}" for m in ("loss", "full_acc", "cond_acc") for k in range(3)]
         + ["train/loss", "epoch", "lr/AdamW", "perf/steps_per_s", "perf/tokens_per_s", "perf/data_wait_frac",
            "perf/eta_s", "perf/eta_p10_s", "perf/eta_p90_s"])


def one(batch: int, steps: int) -> float:
    """CPU ms per step of writing `steps` steps `batch` at a time into a fresh store."""
    import mlflow

    from draftlab.tracking import MlflowTracker

    with tempfile.TemporaryDirectory() as tmp:
        uri = f"sqlite:///{tmp}/mlflow.db"
        os.environ["MLFLOW_TRACKING_URI"] = uri
        client = mlflow.MlflowClient(uri)
        tracker = MlflowTracker(client.create_run(client.create_experiment("batch")).info.run_id)
        records = [({k: 1.0 / (s + 1) + i for i, k in enumerate(NAMES)}, s, 1_000 + s) for s in range(steps)]
        started = time.thread_time()
        for lo in range(0, steps, batch):
            tracker.log_metrics_many(records[lo : lo + batch])
        return 1000 * (time.thread_time() - started) / steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=960)
    ap.add_argument("--batches", type=int, nargs="+", default=[24, 120, 480],
                    help="steps per log_batch (24: a second of the tiny default's steps)")
    args = ap.parse_args()
    logging.getLogger("mlflow").setLevel(logging.WARNING)
    one(args.batches[0], args.batches[0])  # the store's migrations and MLflow's first-call costs: not measured
    per: dict[int, list[float]] = {b: [] for b in args.batches}
    for r in range(args.rounds):
        order = args.batches[r % len(args.batches):] + args.batches[: r % len(args.batches)]
        for b in order:
            per[b].append(one(b, args.steps))
    for b, xs in per.items():
        print(f"{b:5d} steps a batch: median {statistics.median(xs):.2f} ms CPU per step "
              f"({min(xs):.2f}–{max(xs):.2f}, {len(xs)} rounds, {len(NAMES)} metrics a step)")


if __name__ == "__main__":
    main()
