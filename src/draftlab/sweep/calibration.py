"""The calibration trials of a sweep: which GPU counts still need one, what a calibration runs,
and the measured points the cost model is built from (kept in the study, shared by workers).

A calibration is a step-limited `draftlab train` + `draftlab evaluate` at the base lr: epochs 2
with `train.max_steps` N trains N steps, one epoch boundary and one more step
(draftlab.plan.sampler.steps_under_max_steps), so one trial measures start-up, s/step, s/epoch and evaluate.
It is queued as a WAITING trial of the study (any worker may take it), queued once per GPU
count even when workers start together (the caller holds the study lock), never told to the
study as a completed trial (FAIL with status `calibration`), and its point goes into the
study's user attribute `draftlab.calibration`.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any, Callable

from draftlab.params import Params
from draftlab.plan.costmodel import Point
from draftlab.sweep.space import SweepSpec

CALIBRATION_ATTR = "draftlab.calibration"  # GPU count → Point
CALIBRATION_EPOCHS = 2


def points(study) -> dict[int, Point]:
    return {int(n): Point(**p) for n, p in study.user_attrs.get(CALIBRATION_ATTR, {}).items()}


def save(study, point: Point) -> None:
    """Add one GPU count's point (read-modify-write of one attribute: hold the study lock)."""
    raw = dict(study.user_attrs.get(CALIBRATION_ATTR, {}))
    raw[str(point.gpus)] = asdict(point)
    study.set_user_attr(CALIBRATION_ATTR, raw)


def values(spec: SweepSpec, base: Params, gpus: int) -> dict[str, Any]:
    """What a calibration records as its values: the base params, clipped into the space."""
    raw = base.model_dump()
    out: dict[str, Any] = {}
    for key, dim in spec.space.items():
        section, name = key.split(".", 1)
        v = raw[section][name]
        if dim.choices is not None:
            v = v if v in dim.choices else dim.choices[0]
        else:
            v = min(max(v, dim.low), dim.high)
            v = int(v) if isinstance(raw[section][name], int) else float(v)
        out[key] = v
    if "train.epochs" in spec.space:  # what the trial records; it runs CALIBRATION_EPOCHS (run_values)
        lo, hi = spec.epochs_range(base)
        out["train.epochs"] = min(max(CALIBRATION_EPOCHS, lo), hi)
    out["train.gpus"] = gpus if "train.gpus" in spec.space else None
    return {k: v for k, v in out.items() if v is not None}


def run_values(trial_values: dict[str, Any], steps: int) -> dict[str, Any]:
    """What a calibration trial trains with."""
    return {**trial_values, "train.epochs": CALIBRATION_EPOCHS, "train.max_steps": steps}


def live(study) -> set[int]:
    """GPU counts whose calibration waits or runs (on any worker)."""
    from optuna.trial import TrialState

    return {t.user_attrs.get("gpus") for t in study.get_trials(deepcopy=False, states=(TrialState.WAITING,
                                                                                       TrialState.RUNNING))
            if t.user_attrs.get("role") == "calibration"}


def enqueue(study, spec: SweepSpec, base: Params, num_devices: int, log: Callable[[str], None],
            gpus: int | None = None, steps: int | None = None) -> None:
    """Queue a calibration for every GPU count (≤ this worker's devices) that has neither a point
    nor a live calibration; or, with `gpus`/`steps`, one more at twice the steps."""
    if gpus is not None:
        study.enqueue_trial(values(spec, base, gpus), user_attrs={"role": "calibration", "gpus": gpus,
                                                                  "calibration_steps": steps})
        return
    have, running = points(study), live(study)
    for n in spec.gpu_counts(base):
        if n in have or n in running or n > num_devices:
            continue
        v = values(spec, base, n)
        study.enqueue_trial(v, user_attrs={"role": "calibration", "gpus": n})
        log(f"calibration: trial queued at {n} GPU(s) ({v})")
