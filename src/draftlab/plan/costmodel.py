"""The one wall-clock model behind `draftlab plan`, the training ETA and `draftlab sweep`:

    wall(n, steps, epochs) = start-up(n) + steps × s/step(n) + epochs × s/epoch(n)   [+ after(n)]

    start-up  process start to the first step and the end-of-run work: imports, accounting,
              vocab maps, torchrun, compile and warm-up (measured as what the steps and epoch
              boundaries do not explain)
    s/step    mean seconds per global optimizer step, warm-up outliers left out (rank 0's records)
    s/epoch   median extra seconds of an epoch boundary: checkpoint + validation
    after     what a sweep trial adds after training (evaluate); None for a plain train run

A `Point` is one measured (device model, GPU count): a calibration (a step-limited
`draftlab train`, tag `draftlab.calibration`) or any finished training run; both log the same
`timing/*` metrics and are found by one lookup, `points_from_mlflow`, with one matching rule.
Another GPU count is scaled from the nearest measured one (`nearest`): s/step held, so the
time falls with the packed steps the sampler gives at that count (linear scaling).
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

from draftlab.params import Params

# what a run's time per step, per epoch and at start-up depends on besides GPU count and epochs
MATCH_PARAMS = ("target.source", "target.path", "target.dtype", "train.total_seq_len", "train.draft_layers",
                "train.ttt_steps", "train.draft_vocab_size", "train.hidden_states_dtype", "train.sharding",
                "train.num_workers", "evaluate.backend", "evaluate.num_prompts", "evaluate.max_new_tokens")
TIMING_KEYS = ("steps", "epochs", "step_s", "epoch_s", "tokens_per_s", "wall_s")
STABLE_WINDOW = 10  # the median of the last 10 step times …
STABLE_FRAC = 0.02  # … moves by less than 2 % when one more step is added: the rate has settled


@dataclass(frozen=True)
class Point:
    gpus: int
    fixed_s: float  # start-up and end-of-run work of one training
    step_s: float  # one global optimizer step
    epoch_s: float  # validation + checkpoint, per epoch boundary
    tokens_per_s: float  # real tokens per second while stepping, all ranks
    steps: int
    epochs: int
    wall_s: float  # the measured training's wall-clock
    trial: int = -1  # the calibration trial's number in a study; -1 otherwise
    source: str = ""  # "calibration trial 3", "mlflow run <id> (calibration)", "stated"
    after_s: float | None = None  # a sweep trial's evaluate; None: not measured
    measured_at: float = 0.0  # unix time of the measurement (for its age)
    stable: bool = True  # the step time had settled (see STABLE_FRAC)
    tail_s: float | None = None  # after the last step: final validation + checkpoint, launcher's checks

    @classmethod
    def from_timing(cls, gpus: int, timing: Mapping, *, trial: int = -1, source: str = "",
                    after_s: float | None = None, measured_at: float | None = None) -> Point:
        steps, epochs = int(timing["steps"]), int(timing["epochs"])
        step_s, epoch_s, wall = float(timing["step_s"]), float(timing["epoch_s"]), float(timing["wall_s"])
        fixed = max(wall - steps * step_s - max(epochs - 1, 0) * epoch_s, 0.0)
        return cls(gpus, fixed, step_s, epoch_s, float(timing.get("tokens_per_s", 0.0)), steps, epochs, wall, trial,
                   source or f"calibration trial {trial}", after_s,
                   time.time() if measured_at is None else measured_at, bool(timing.get("stable", True)),
                   timing.get("tail_s"))

    def train_s(self, steps: int, epochs: int) -> float:
        """The last epoch's boundary (final checkpoint, validation) is in fixed_s: it is the
        end-of-run work every run has, and the only boundary a 1-epoch run has."""
        return self.fixed_s + steps * self.step_s + max(epochs - 1, 0) * self.epoch_s

    def age(self, now: float | None = None) -> str:
        if not self.measured_at:
            return "age unknown"
        s = max((now or time.time()) - self.measured_at, 0)
        for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
            if s >= size:
                return f"{s / size:.0f} {unit} old"
        return f"{s:.0f} s old"


def stated_point(gpus: int, tokens_per_s: float, tokens_per_step: float) -> Point:
    """A throughput a user states: s/step from it, no start-up or epoch cost known."""
    step_s = tokens_per_step / tokens_per_s
    return Point(gpus, 0.0, step_s, 0.0, tokens_per_s, 0, 0, 0.0, source="stated tokens/s", measured_at=0.0)


def nearest(points: Mapping[int, Point], gpus: int) -> tuple[Point, str] | None:
    """The point at `gpus`, else the nearest in log2 GPUs (the larger on a tie), with how."""
    if not points:
        return None
    if gpus in points:
        p = points[gpus]
        return p, f"{p.source} at {gpus} GPU(s)"
    p = min(points.values(), key=lambda q: (abs(math.log2(gpus / q.gpus)), -q.gpus))
    return p, f"{p.source} at {p.gpus} GPU(s), s/step held (linear scaling)"


@dataclass(frozen=True)
class Prediction:
    wall_s: float
    steps: int
    basis: str
    point: Point


class CostModel:
    """wall(params) from the nearest point; `steps_fn(params)` gives the packed global steps."""

    def __init__(self, points: dict[int, Point], steps_fn: Callable[[Params], int], *, with_after: bool = True):
        self.points = points
        self.steps_fn = steps_fn
        self.with_after = with_after

    def predict(self, params: Params) -> Prediction | None:
        found = nearest(self.points, params.train.world_size())
        if found is None:
            return None
        p, basis = found
        steps = self.steps_fn(params)
        wall = p.train_s(steps, params.train.epochs) + ((p.after_s or 0.0) if self.with_after else 0.0)
        return Prediction(wall, steps, basis, p)

    def scaling_efficiency(self) -> dict[int, float]:
        """E(n) = T(n) / (n · T(n0) / n0) against the smallest measured count n0."""
        if not self.points:
            return {}
        n0 = min(self.points)
        per_gpu0 = self.points[n0].tokens_per_s / n0
        return {n: p.tokens_per_s / (n * per_gpu0) if per_gpu0 else 0.0 for n, p in sorted(self.points.items())}


# ---------------------------------------------------------------- measuring a run


OUTLIER_X = 5.0  # a step over 5× the median is a compile or warm-up step: start-up, not rate


def typical_step_s(intervals: Sequence[float]) -> float:
    """Seconds a step adds to a run: the *mean* step time (a sum of N steps is N × mean; under load
    the times skew right and the median runs low), leaving out compile/warm-up outliers."""
    if not intervals:
        return 0.0
    # statistics.median and fmean's own arithmetic, without fmean's per-item generator (rank 0's
    # ETA calls this every step, over up to 200 intervals)
    xs = sorted(intervals)
    half = len(xs) // 2
    cap = OUTLIER_X * (xs[half] if len(xs) % 2 else (xs[half - 1] + xs[half]) / 2)
    kept = [x for x in xs if x <= cap]
    return math.fsum(kept) / len(kept)


def settled(step_times: Sequence[float]) -> bool:
    """True when the median of the last STABLE_WINDOW step times moved < STABLE_FRAC with the last step."""
    if len(step_times) < STABLE_WINDOW + 1:
        return False
    now = statistics.median(step_times[-STABLE_WINDOW:])
    before = statistics.median(step_times[-STABLE_WINDOW - 1:-1])
    return abs(now - before) <= STABLE_FRAC * before


def step_timing(step_end_s: Mapping[int, float], per_epoch: Sequence[int], step_tokens: Sequence[int],
                wall_s: float) -> dict:
    """s/step and s/epoch of a run from when each global step ended (rank 0's step records):
    s/step is the typical interval between steps of one epoch (typical_step_s: compile and
    warm-up fall into start-up), s/epoch the median excess of the intervals across a boundary."""
    ends = [sum(per_epoch[: i + 1]) - 1 for i in range(len(per_epoch))]
    inner = [step_end_s[s + 1] - step_end_s[s] for s in sorted(step_end_s)
             if s + 1 in step_end_s and s not in ends]
    step_s = typical_step_s(inner)
    bounds = [step_end_s[e + 1] - step_end_s[e] - step_s for e in ends[:-1] if e in step_end_s and e + 1 in step_end_s]
    epoch_s = max(statistics.median(bounds), 0.0) if bounds else 0.0
    tokens = statistics.mean(step_tokens) if step_tokens else 0.0
    return {"steps": sum(per_epoch), "epochs": len(per_epoch), "step_s": step_s, "epoch_s": epoch_s,
            "tokens_per_s": tokens / step_s if step_s else 0.0, "wall_s": wall_s, "stable": settled(inner)}


# ---------------------------------------------------------------- the one lookup


def points_from_mlflow(params: Params, gpu_counts: Sequence[int] | None = None, *, client,
                       store_hash: str | None = None, device_model: str | None = None, source: str = "store",
                       experiment: str = "draftlab", max_runs: int = 500) -> dict[int, Point]:
    """The latest finished training per GPU count — a calibration or any run — whose params in
    MATCH_PARAMS, hidden-state source (`source`: `train.source`'s value; `store_hash`, when given:
    the source's `identity()`) and device model (when given) match."""
    return {n: pts[0] for n, pts in matching_points(params, gpu_counts, client=client, store_hash=store_hash,
                                                    source=source,
                                                    device_model=device_model, experiment=experiment,
                                                    max_runs=max_runs, per_count=1).items()}


def matching_points(params: Params, gpu_counts: Sequence[int] | None = None, *, client,
                    store_hash: str | None = None, device_model: str | None = None, source: str = "store",
                    experiment: str = "draftlab", max_runs: int = 500, per_count: int = 1) -> dict[int, list[Point]]:
    """The `per_count` latest matching finished trainings per GPU count (newest first), by the one
    matching rule of points_from_mlflow."""
    from draftlab.params import flatten
    from draftlab.tracking import param_str

    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        return {}
    want = {k: {param_str(v), str(v)} for k, v in flatten(params).items() if k in MATCH_PARAMS}
    runs = client.search_runs([exp.experiment_id], "attributes.status = 'FINISHED' and metrics.`timing/step_s` > 0",
                              max_results=max_runs, order_by=["attributes.start_time DESC"])
    found: dict[int, list[Point]] = {}
    for run in runs:
        p, m, tags = run.data.params, run.data.metrics, run.data.tags
        n = int(p.get("world_size", 0))
        if len(found.get(n, ())) >= per_count or (gpu_counts is not None and n not in gpu_counts):
            continue
        if any(p.get(k) not in v for k, v in want.items()):
            continue
        # a run's source (param hidden_states.source; runs from before online training read a store)
        if p.get("hidden_states.source", "store") != source:
            continue
        if store_hash is not None and tags.get("data.hidden_states_hash") != store_hash:
            continue
        if device_model is not None and tags.get("device.model") != device_model:
            continue
        timing = {k: m[f"timing/{k}"] for k in TIMING_KEYS if f"timing/{k}" in m}
        if set(timing) != set(TIMING_KEYS):
            continue
        timing["stable"] = m.get("timing/stable", 1.0) > 0
        timing["tail_s"] = m.get("timing/tail_s")
        if "timing/ended_at" in m and run.info.end_time:
            # to the run's end (set when the launcher closes it), not to when timing/* was logged
            closing = max(run.info.end_time / 1000 - m["timing/ended_at"], 0.0)
            timing["wall_s"] += closing
            if timing["tail_s"] is not None:
                timing["tail_s"] += closing
        kind = "calibration, " if tags.get("draftlab.calibration") == "true" else ""
        where = f" ({kind}{tags.get('device.model', 'device unknown')})"
        found.setdefault(n, []).append(Point.from_timing(
            n, timing, source=f"mlflow run {run.info.run_id}{where}", after_s=m.get("timing/after_s"),
            measured_at=(run.info.end_time or 0) / 1000))
    return found
