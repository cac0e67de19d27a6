"""The convergence watch of a training: is it learning?

Fed every logged step's all-reduced train metrics (the same values on every rank, so every rank
reaches the same decision at the same step and stops together, with no rank left waiting in a
collective):

- a NaN or inf loss (`train/loss`, `train/loss_k`, or a grad norm where the trainer reports one)
  is `diverged`: the run stops (draftlab.training.rank);
- after warm-up (`train.warmup_steps`) the first `window_steps` steps are each position's early
  window; every `window_steps` steps after the next window the median of the latest window is
  compared with the early one's: fallen by more than `stall_frac` of it and more than the
  noise (2.5 standard errors of the difference of the two medians, the spread estimated from each
  value's distance to its own window's median) is `learning`, risen likewise by
  `diverge_frac` is `diverging`, otherwise `stalled`. The first check sets the trend; a change
  after it must show in two checks in a row.

The run's trend is `diverging` if any TTT position diverges, `learning` if any learns, else
`stalled`. `train.watch.stop_on` names trends that stop the run too (a sweep's trials stop on
both). After a resume the early window is collected again from the resumed steps.

Pure Python (no torch): unit-tested in tests/unit/test_watch.py.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field

WARMING_UP, LEARNING, STALLED, DIVERGING, DIVERGED = "warming up", "learning", "stalled", "diverging", "diverged"
TAG = "draftlab.convergence"
NOISE_SE = 2.5  # a change smaller than this many standard errors is noise
EXIT_DIVERGED, EXIT_STOPPED = 3, 5  # a rank's and `draftlab train`'s exit codes


def default_window(total_steps: int) -> int:
    return min(500, max(5, total_steps // 100))


def non_finite(train: dict) -> tuple[str, float] | None:
    """The first loss or grad-norm metric of a step's `train` record that is NaN or inf (the
    total `loss` first: it is the one a user knows)."""
    for key, value in sorted(train.items(), key=lambda kv: kv[0] != "loss"):
        if (key == "loss" or key.startswith("loss_") or "grad_norm" in key) and isinstance(value, float | int):
            if not math.isfinite(value):
                return key, float(value)
    return None


def positions(train: dict) -> list[str]:
    """The per-TTT-position loss keys of a record (`loss_0`, `loss_1`, …), in position order."""
    keys = [k for k in train if k.startswith("loss_") and k[5:].isdigit()]
    return sorted(keys, key=lambda k: int(k[5:])) or (["loss"] if "loss" in train else [])


@dataclass
class Check:
    """One trend check: the run's trend and each position's figures."""

    step: int
    state: str
    window: int
    positions: dict[str, dict] = field(default_factory=dict)  # key → early, latest, change, noise, trend
    overall_change: float | None = None  # train/loss's relative change since the early window

    def line(self) -> str:
        change = "" if self.overall_change is None else f" (loss {_pct(self.overall_change)} since warmup)"
        per = ", ".join(f"{k} {_pct(p['change'])}" for k, p in self.positions.items())
        return f"{self.state}{change}; {per}" if per else f"{self.state}{change}"

    def to_json(self) -> dict:
        return {"step": self.step, "state": self.state, "window": self.window,
                "overall_change": self.overall_change, "positions": self.positions}


def _pooled_mad(*windows) -> float:
    """Median absolute deviation of every value from its own window's median: the step-to-step
    noise, not the fall within the early window (right after warm-up a learning loss falls fast)."""
    return statistics.median(abs(x - statistics.median(w)) for w in windows for x in w)


def _pct(x: float) -> str:
    return f"{x * 100:+.0f}%".replace("-", "−")


class ConvergenceWatch:
    def __init__(self, *, warmup_steps: int, total_steps: int, window_steps: int | None = None,
                 stall_frac: float = 0.02, diverge_frac: float = 0.10):
        self.start = warmup_steps
        self.window = window_steps or default_window(total_steps)
        self.stall_frac, self.diverge_frac = stall_frac, diverge_frac
        self.early: dict[str, list[float]] = {}
        self.recent: dict[str, deque] = {}
        self.seen = 0  # steps observed since warm-up
        self.state = WARMING_UP
        self.pending: str | None = None
        self.last: Check | None = None

    def observe(self, step: int, train: dict) -> Check | None:
        """Take one step's `train` record; a Check when this step is a check point."""
        if step < self.start:
            return None
        keys = positions(train)
        if "loss" in train and "loss" not in keys:
            keys = [*keys, "loss"]
        self.seen += 1
        for k in keys:
            v = float(train[k])
            early = self.early.setdefault(k, [])
            if len(early) < self.window and self.seen <= self.window:
                early.append(v)
            else:
                self.recent.setdefault(k, deque(maxlen=self.window)).append(v)
        if self.seen < 2 * self.window or self.seen % self.window:
            return None
        return self._check(step)

    def _check(self, step: int) -> Check:
        per: dict[str, dict] = {}
        overall = None
        for k, early in self.early.items():
            recent = self.recent.get(k)
            if not recent or not early:
                continue
            e, latest = statistics.median(early), statistics.median(recent)
            # the standard error of a difference of two window medians: σ ≈ 1.4826 MAD of the
            # values about their own window's median; a median's error ≈ 1.2533 σ / √n
            sigma = 1.4826 * _pooled_mad(early, recent)
            noise = NOISE_SE * 1.2533 * sigma * math.sqrt(1 / len(early) + 1 / len(recent))
            change = (latest - e) / e if e else 0.0
            if latest - e > max(self.diverge_frac * abs(e), noise):
                trend = DIVERGING
            elif e - latest > max(self.stall_frac * abs(e), noise):
                trend = LEARNING
            else:
                trend = STALLED
            fig = {"early": e, "latest": latest, "change": change, "noise": noise, "trend": trend}
            if k == "loss":
                overall = change
                if len(self.early) > 1:
                    continue  # the positions decide; the total is the headline figure
            per[k] = fig
        trends = {p["trend"] for p in per.values()}
        found = DIVERGING if DIVERGING in trends else LEARNING if LEARNING in trends else STALLED
        # the first check sets the trend; a change after it must show in two checks in a row (one
        # window's median of a noisy loss crosses the noise bound now and then)
        if self.state == WARMING_UP or found == self.state or found == self.pending:
            self.state, self.pending = found, None
        else:
            self.pending = found
        self.last = Check(step=step, state=self.state, window=self.window, positions=per, overall_change=overall)
        return self.last
