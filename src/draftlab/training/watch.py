"""The convergence watch of a training: is it learning?

Fed every logged step's all-reduced train metrics (the same values on every rank, so every rank
reaches the same decision at the same step and stops together, with no rank left waiting in a
collective):

- a NaN or inf loss (`train/loss`, `train/loss_k`, or a grad norm where the trainer reports one)
  is `diverged`: the run stops (draftlab.training.rank);
- after warm-up (`train.warmup_steps`) the first `window_steps` steps are each position's early
  window; every `window_steps` steps after the next window each position is checked. The noise of
  a difference of two medians is 2.5 standard errors (the spread estimated from each value's
  distance to its own window's median). Each verdict is a finding, shown beyond that noise:
    `learning`   the latest window's median has fallen below the early one's by more than
                 `stall_frac` of it and more than the noise;
    `diverging`  it has risen likewise by more than `diverge_frac`;
    `stalled`    the loss is flat: split every step since warm-up in two halves, the fall from the
                 first half's median to the second's, plus its noise, is below `stall_frac`
                 (the loss is shown not to fall by that much; the halves grow with the run, so a
                 noisy loss is found flat later, never sooner than its noise allows);
    `cannot tell yet`  none of those shown (a slow fall inside the noise, a short window): nothing
                 stops on it.
  `stalled` and `diverging` must show in two checks in a row before they are the trend (so a run
  is never stopped at its first check); `learning` and `cannot tell yet` take effect at once.

The run's trend is `diverging` if any TTT position diverges, `learning` if any learns, `stalled`
if every position is flat, else `cannot tell yet`. `train.watch.stop_on` names trends that stop
the run too (a sweep's trials stop on `stalled` and `diverging`). After a resume the early window
is collected again from the resumed steps.

Pure Python (no torch): unit-tested in tests/unit/test_watch.py.
"""

from __future__ import annotations

import math
import statistics
from array import array
from collections import deque
from dataclasses import dataclass, field

WARMING_UP, LEARNING, STALLED, DIVERGING, DIVERGED = "warming up", "learning", "stalled", "diverging", "diverged"
UNSURE = "cannot tell yet"
HALF_SAMPLE = 2048  # values per half the flatness test reads at most (a check stays ~ms on 177 k steps)
CONFIRMED_TWICE = (STALLED, DIVERGING)  # the trends a run may be stopped on
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
    centres = [statistics.median(w) for w in windows]
    return statistics.median(abs(x - c) for w, c in zip(windows, centres) for x in w)


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
        self.since_warmup: dict[str, array] = {}  # every value (8 bytes each): the flatness test's halves
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
            self.since_warmup.setdefault(k, array("d")).append(v)
            early = self.early.setdefault(k, [])
            if len(early) < self.window and self.seen <= self.window:
                early.append(v)
            else:
                self.recent.setdefault(k, deque(maxlen=self.window)).append(v)
        if self.seen < 2 * self.window or self.seen % self.window:
            return None
        return self._check(step)

    @staticmethod
    def _noise(a, b) -> float:
        """2.5 standard errors of the difference of the medians of `a` and `b`: σ ≈ 1.4826 MAD of
        the values about their own window's median; a median's error ≈ 1.2533 σ / √n."""
        sigma = 1.4826 * _pooled_mad(a, b)
        return NOISE_SE * 1.2533 * sigma * math.sqrt(1 / len(a) + 1 / len(b))

    def _flat(self, key: str) -> tuple[float, float, float]:
        """(relative fall from the first half of the steps since warm-up to the second, its noise
        relative to the first half's median, that median)."""
        values = self.since_warmup[key]
        half = len(values) // 2
        stride = -(-half // HALF_SAMPLE)  # a long run: every stride-th step (its noise counts the sample)
        first, second = values[:half:stride], values[half::stride]
        m1, m2 = statistics.median(first), statistics.median(second)
        scale = abs(m1) or 1.0
        return (m1 - m2) / scale, self._noise(first, second) / scale, m1

    def _check(self, step: int) -> Check:
        per: dict[str, dict] = {}
        overall = None
        for k, early in self.early.items():
            recent = self.recent.get(k)
            if not recent or not early:
                continue
            e, latest = statistics.median(early), statistics.median(recent)
            noise = self._noise(early, recent)
            change = (latest - e) / e if e else 0.0
            fall_h = noise_h = None
            if latest - e > max(self.diverge_frac * abs(e), noise):
                trend = DIVERGING
            elif e - latest > max(self.stall_frac * abs(e), noise):
                trend = LEARNING
            elif (flat := self._flat(k))[0] + flat[1] < self.stall_frac:
                fall_h, noise_h = flat[0], flat[1]
                trend = STALLED  # shown: the loss does not fall by stall_frac (flat, or rising below diverge_frac)
            else:
                fall_h, noise_h, trend = flat[0], flat[1], UNSURE
            fig = {"early": e, "latest": latest, "change": change, "noise": noise, "trend": trend,
                   "halves_fall": fall_h, "halves_noise": noise_h}
            if k == "loss":
                overall = change
                if len(self.early) > 1:
                    continue  # the positions decide; the total is the headline figure
            per[k] = fig
        trends = {p["trend"] for p in per.values()}
        found = (DIVERGING if DIVERGING in trends else LEARNING if LEARNING in trends
                 else STALLED if trends == {STALLED} else UNSURE)
        # a trend a run may be stopped on must show in two checks in a row (one window's median of
        # a noisy loss crosses the noise bound now and then; and never at the first check)
        if found not in CONFIRMED_TWICE or found == self.state or found == self.pending:
            self.state, self.pending = found, None
        else:
            self.pending = found
            if self.state == WARMING_UP:
                self.state = UNSURE
        self.last = Check(step=step, state=self.state, window=self.window, positions=per, overall_change=overall)
        return self.last
