"""What a training's time is made of, for the cost model (draftlab.plan.costmodel) and the ETA:
the launcher's side (timing/* of a finished run, the ETA's inputs in the rank plan) and the rank's
(`Eta`, updated at every step by draftlab.training.rank). Nothing here imports torch.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from draftlab.rundir import RankPlan, RunDir, Timing

if TYPE_CHECKING:  # a rank imports this module for its ETA: the params' pydantic models are the launcher's
    from draftlab.params import Params


def val_steps(params: Params, data_dir: Path) -> int:
    """Batches of one validation pass on rank 0 (the val loader packs with the same sampler)."""
    from draftlab.plan import cache

    t = params.train
    key = cache.plan_key(data_dir, params.data.train_ratio, {
        "val_steps": True, "total_seq_len": t.total_seq_len, "world_size": t.world_size(), "seed": t.seed})
    if (hit := cache.read("plan", key)) is not None:
        return hit["val_steps"]
    val = cache.split(data_dir, params.data.train_ratio)["val_lengths"]
    from draftlab.plan import accounting as acc

    n = len(acc.rank_batches(val, total_seq_len=t.total_seq_len, world_size=t.world_size(), rank=0,
                             seed=t.seed, epoch=0)) if val else 0
    cache.write("plan", key, {"val_steps": n})
    return n


TAIL_RUNS = 5  # matching runs whose tails give the ETA's tail and its range


def priors(params: Params, manifest_sha: str, device: str) -> dict:
    """From up to TAIL_RUNS matching measured runs (draftlab.plan.costmodel, newest first): s/epoch of
    the latest, and the tail after the last step (final validation + checkpoint, the ranks' and
    torchrun's exit, the launcher's checks, to the run's end) as their median, min and max, for
    the ETA before this run has measured its own; None each when there is none or the store
    cannot be read."""
    out = {"epoch_s_prior": None, "tail_s_prior": None, "tail_s_lo": None, "tail_s_hi": None}
    try:
        from draftlab import tracking
        from draftlab.devices import device_tags
        from draftlab.plan import costmodel

        n = params.train.world_size()
        points = costmodel.matching_points(params, [n], store_hash=manifest_sha,
                                           device_model=device_tags(device)["device.model"],
                                           client=tracking.client(), max_runs=50,
                                           per_count=TAIL_RUNS).get(n, [])
    except Exception:  # noqa: BLE001 — the ETA falls back to its own estimate
        return out
    if points:
        import statistics

        out["epoch_s_prior"] = points[0].epoch_s
        tails = [p.tail_s for p in points if p.tail_s is not None]
        if tails:
            out.update(tail_s_prior=statistics.median(tails), tail_s_lo=min(tails), tail_s_hi=max(tails))
    return out


def log_timing(a, step_tokens: list[int], out_dir: Path, started_at: float, ended_at: float, tracker) -> dict:
    """costmodel.step_timing of this run from rank 0's step records, logged as timing/* (what
    `draftlab plan` and the sweep read back as a cost-model point)."""
    from draftlab.observe import telemetry
    from draftlab.plan import costmodel

    ends = {r["step"]: r["t"] for r in telemetry.read_step_records(out_dir) if r.get("rank") == 0}
    per_epoch = a.trained_steps if a.max_steps is not None else [e.steps for e in a.epochs]
    timing = costmodel.step_timing(ends, per_epoch, step_tokens, ended_at - started_at)
    if ends:  # what the ETA cannot see from the steps: before the first one, after the last
        timing["startup_s"] = min(ends.values()) - started_at
        timing["tail_s"] = ended_at - max(ends.values())
        timing["ended_at"] = ended_at  # the next run's ETA adds what follows, to the run's end time
    tracker.log_metrics({f"timing/{k}": float(v) for k, v in timing.items()})
    RunDir(out_dir).timing.write(Timing(timing))
    return timing


def harness_cpu(out_dir: Path, launcher_cpu_s: float, steps: int, relay_s: float = 0.0) -> dict:
    """CPU seconds draftlab itself spent per training step: the launcher process while the ranks
    ran (telemetry sampler, MLflow system metrics, the relay's uploads of rank 0's records, waiting)
    plus rank 0's observers (step records, metric handler with its relay-file writes, watch).
    `relay_s`, the relay thread's share of the launcher's, is shown apart (`launcher_relay_s`).
    Unlike tokens/s ratios it holds under load."""
    done = RunDir(out_dir).rank_done.read_or_none()
    rank = done.harness_cpu_s if done is not None else {}
    total = launcher_cpu_s + sum(rank.values())
    return {"launcher_s": launcher_cpu_s, "launcher_relay_s": relay_s, "rank0": rank, "total_s": total,
            "per_step_s": total / max(steps, 1)}


class Eta:
    """Time left, by the cost model of draftlab.plan.costmodel applied to this run as it goes:

        left = steps left × s/step + epoch boundaries left × s/epoch + tail

    s/step is the typical (outlier-free mean) of the last RECENT intervals between step ends (so
    it follows a rate that changes under load); s/epoch the median excess of the boundaries seen
    so far after the first (which pays one-offs: the validation loader's workers, the first
    checkpoint), with only the first seen the smaller of it and a matching MLflow run's
    (RankPlan.epoch_s_prior), before any the prior, else the
    validation pass at ~1/3 of a training step per batch (forward only); the tail (after the last
    step, to the run's end) the median of up to 5 matching runs' (`tail_s_prior`), else one
    boundary. The 10–90 % range takes each term's own spread: the steps at the 10th and 90th
    percentiles of the last WIDE intervals over their typical, the boundaries at the smallest
    and largest seen (until one is seen, 0.5–2× the estimate), the tail at the smallest and
    largest of those runs' but at least 0.7–1.4× their median (TAIL_SPREAD; from one run or
    none, 0.5–2× it: an unmeasured spread)."""

    RECENT, WIDE = 20, 200
    FORWARD_FRACTION = 1 / 3
    UNMEASURED = (0.5, 2.0)  # the range of a term whose spread nothing has measured yet
    # the least spread of the tail: consecutive runs on a loaded 2-core VM ended 0.8–1.3× their
    # median tail (2.3–3.6 s) with the step rate unchanged
    TAIL_SPREAD = (0.7, 1.4)

    def __init__(self, plan: RankPlan):
        self.total = plan.total_steps
        per_epoch = plan.epoch_steps or [self.total]
        self.ends = [sum(per_epoch[: i + 1]) - 1 for i in range(len(per_epoch))]
        self.val_steps = plan.val_steps
        self.epoch_prior = plan.epoch_s_prior
        self.tail_prior = plan.tail_s_prior
        lo, hi = plan.tail_s_lo, plan.tail_s_hi
        self.tail_range = (lo, hi) if lo is not None and hi is not None and hi > lo else None
        self.last: tuple[int, float] | None = None
        self.intervals: list[float] = []
        self.boundaries: list[float] = []
        self.step_s_fallback = 0.0

    def step_ended(self, step: int, t: float, step_s: float) -> None:
        if step_s:
            self.step_s_fallback = step_s
        if self.last is not None and step == self.last[0] + 1:
            dt = t - self.last[1]
            if self.last[0] in self.ends:  # the interval holds a validation + checkpoint
                self.boundaries.append(dt)
            else:
                self.intervals.append(dt)
                del self.intervals[: -self.WIDE]
        self.last = (step, t)

    def estimate(self, step: int) -> dict[str, float]:
        import statistics

        from draftlab.plan.costmodel import typical_step_s

        recent = self.intervals[-self.RECENT:]
        step_s = typical_step_s(recent) if recent else self.step_s_fallback
        lo_f, hi_f = self.UNMEASURED
        excess = [max(b - step_s, 0.0) for b in self.boundaries]
        if len(excess) >= 2:  # the first boundary's one-offs (below) left out
            epoch_s, epoch_lo, epoch_hi = statistics.median(excess[1:]), min(excess[1:]), max(excess[1:])
        elif excess and self.epoch_prior is not None and self.epoch_prior < excess[0]:
            # the first boundary holds one-offs the others do not (the validation loader's workers
            # start, the first checkpoint is written): 1.4 s against 0.1-0.14 s for each later one
            # on the tiny default, which made the ETA at 10 % of a 12-epoch run twice the time left.
            # Until a second is seen, a matching run's boundary, with this one as the range's top.
            epoch_s, epoch_lo, epoch_hi = self.epoch_prior, self.epoch_prior * lo_f, excess[0]
        elif excess:
            epoch_s = epoch_lo = epoch_hi = excess[0]
        else:
            epoch_s = (self.epoch_prior if self.epoch_prior is not None
                       else self.val_steps * step_s * self.FORWARD_FRACTION)
            epoch_lo, epoch_hi = epoch_s * lo_f, epoch_s * hi_f
        # boundaries still ahead, then the tail after the last step (its final validation and
        # checkpoint, the ranks' exit, the launcher's checks): measured on matching runs, else one boundary
        inner = sum(step <= e < self.total - 1 for e in self.ends)
        tail = self.tail_prior if self.tail_prior is not None else epoch_s
        if self.tail_range:  # a few runs' min–max is no 10–90 % range: at least the run-to-run spread seen here
            tail_lo = min(self.tail_range[0], tail * self.TAIL_SPREAD[0])
            tail_hi = max(self.tail_range[1], tail * self.TAIL_SPREAD[1])
        else:
            tail_lo, tail_hi = tail * lo_f, tail * hi_f
        steps_left = self.total - step - 1
        out = {"perf/eta_s": steps_left * step_s + inner * epoch_s + tail}
        if len(self.intervals) >= 10 and step_s > 0:
            q = statistics.quantiles(self.intervals, n=10)
            typical = typical_step_s(self.intervals)
            out["perf/eta_p10_s"] = steps_left * step_s * q[0] / typical + inner * epoch_lo + min(tail_lo, tail)
            out["perf/eta_p90_s"] = steps_left * step_s * q[-1] / typical + inner * epoch_hi + max(tail_hi, tail)
        return out
