"""The search-space file of `draftlab sweep` (experiments/sweep-*.yaml): what is searched, under
which budget, with which objective, storage and pruner, validated before anything is launched.

    study: tiny-default
    budget: 8m                # total wall-clock, calibration included (flag --budget overrides)
    space:
      train.epochs: {low: 1, high: 3}
      train.lr: {low: 1.0e-3, high: 1.0e-2, log: true}
      train.gpus: {choices: [1, 2]}

Every value a dimension can take is merged into the base params and validated by the params
tree itself, so `lr ≤ 0` fails with the same one line as in params.yaml. Only `train.*` keys can
be swept: every trial shares the target, the prepared data and the hidden-state store.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, StrictBool, ValidationError, model_validator

from draftlab.errors import UserError
from draftlab.params import Params, ParamsError, flatten, merge, parse_params
from draftlab.sweep.budget import HEARTBEAT_S, STALE_AFTER_S

OBJECTIVES = {  # metric → (direction, where a trial's final value comes from)
    "eval/simulated_acc_len": "maximize",
    "eval/measured_acc_len": "maximize",
    "val/loss": "minimize",
}
_DURATION = re.compile(r"^\s*(?:(\d+(?:\.\d+)?)\s*d)?\s*(?:(\d+(?:\.\d+)?)\s*h)?\s*(?:(\d+(?:\.\d+)?)\s*m)?\s*"
                       r"(?:(\d+(?:\.\d+)?)\s*s)?\s*$")


class SpaceError(UserError, ValueError):
    """A user error in a sweep space: one line naming the key and what to do."""


def parse_duration(text: str | float | int, key: str) -> float:
    """'24h', '90m', '1h30m', '300s' or a number of seconds → seconds (> 0)."""
    if isinstance(text, str) and re.fullmatch(r"\s*-?\d+(\.\d+)?\s*", text):
        text = float(text)  # a bare number (e.g. from --budget 300) is seconds
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        seconds = float(text)
    else:
        m = _DURATION.match(str(text))
        if not m or not any(m.groups()):
            raise SpaceError(f"{key}: {text!r} is not a duration; write e.g. 24h, 90m, 1h30m or 300s")
        d, h, mi, s = (float(g) if g else 0.0 for g in m.groups())
        seconds = d * 86400 + h * 3600 + mi * 60 + s
    if seconds <= 0:
        raise SpaceError(f"{key}: {text!r} must be longer than zero")
    return seconds


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Dim(_Model):
    """One searched key: `choices`, or a `low`..`high` range (int or float as the key's type)."""

    choices: list[Any] | None = Field(None, description="Values to choose from.")
    low: float | None = Field(None, description="Lower bound (inclusive).")
    high: float | None = Field(None, description="Upper bound (inclusive).")
    log: StrictBool = Field(False, description="Sample the range on a log scale (lr).")
    step: float | None = Field(None, description="Grid step of the range.")

    @model_validator(mode="after")
    def _one_kind(self) -> Dim:
        if self.choices is not None:
            if self.low is not None or self.high is not None:
                raise ValueError("give either choices or low/high, not both")
            if not self.choices:
                raise ValueError("choices is empty")
        elif self.low is None or self.high is None:
            raise ValueError("give choices, or both low and high")
        elif self.low > self.high:
            raise ValueError(f"low {self.low:g} is above high {self.high:g}")
        elif self.log and self.low <= 0:
            raise ValueError("a log range needs low > 0")
        return self

    def extremes(self) -> list[Any]:
        return list(self.choices) if self.choices is not None else [self.low, self.high]


class Objective(_Model):
    metric: Literal["eval/simulated_acc_len", "eval/measured_acc_len", "val/loss"] = Field(
        "eval/simulated_acc_len", description="What a trial is scored by: an `evaluate` metric, or the last "
        "val/loss_epoch of training.")

    @property
    def direction(self) -> str:
        return OBJECTIVES[self.metric]


class Pruner(_Model):
    kind: Literal["median", "hyperband", "none"] = Field("median", description="Optuna pruner on per-epoch values.")
    startup_trials: int = Field(2, ge=0, description="Completed trials before the median pruner prunes.")
    warmup_epochs: int = Field(0, ge=0, description="Epochs of a trial before it can be pruned.")


class Calibration(_Model):
    steps: int = Field(20, ge=20, description="Optimizer steps of a calibration (`draftlab train` with "
                       "epochs: 2, max_steps: this): step time, one epoch boundary and start-up, at a cost that "
                       "does not grow with the dataset. Doubled (up to max_steps) until the median of the last "
                       "10 step times moves by < 2 %.")
    max_steps: int = Field(320, ge=20, description="Most steps a calibration may be doubled to.")
    budget_share: float = Field(0.4, gt=0, le=1, description="Most of the budget that calibration may take, all "
                                "GPU counts together (stated in the report). A calibration is redone with twice "
                                "the steps only when it trained every step it asked for and the redo fits this "
                                "share; otherwise an unsettled step time widens the safety margin "
                                "(UNSETTLED_MARGIN) of the trials predicted from it.")
    max_s: float = Field(900, gt=0, description="Longest a calibration trial may run; the budget must exceed "
                         "their sum over the GPU counts not yet calibrated.")
    reuse: StrictBool = Field(True, description="Take a GPU count's calibration from a finished calibration or sweep "
                        "trial in MLflow (any study) with the same draft, packing, evaluation, store and device "
                        "model, if there is one.")


class SweepSpec(_Model):
    """A sweep: base params, space, objective, budget and where the study lives."""

    study: str = Field(..., pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$", description="Study name (also the folder "
                       "under runs/sweeps/ and optuna-dashboard's study).")
    params: str = Field("params.yaml", description="Base params every trial starts from.")
    objective: Objective = Field(default_factory=Objective)
    budget: str | float = Field(..., description="Total wall-clock of the sweep, calibration included: 24h, 90m.")
    trial_cap: str | float | None = Field(None, description="Longest one trial may run (null: the budget).")
    storage: str | None = Field(None, description="Optuna storage: null = a journal file in the study folder; "
                                "sqlite:///…, postgresql://… for several machines; or a .log journal path.")
    heartbeat_s: int = Field(HEARTBEAT_S, ge=1, description="Seconds between a worker's heartbeats: its span in "
                             "the budget ledger and, on RDB storage, Optuna's heartbeat of each trial it holds.")
    stale_after_s: int = Field(STALE_AFTER_S, ge=2, description="A worker (and on RDB storage, a trial) without a "
                               "heartbeat for this long is dead: its RUNNING trials end FAIL as interrupted and "
                               "its processes on the checking worker's host are stopped.")
    devices: int | list[str] | None = Field(None, description="Device slots of this worker: a count or ids "
                                            "(null: every visible GPU; on CPU, process slots = CPU cores).")
    stop_grace_s: float = Field(10, ge=0, le=120, description="SIGTERM → SIGKILL grace for a trial that "
                                "reaches its cap (speculators' own save timeout is 120 s).")
    safety_margin: float = Field(0.1, ge=0, description="A trial starts only if predicted × (1 + margin) fits.")
    pruner: Pruner = Field(default_factory=Pruner)
    calibration: Calibration = Field(default_factory=Calibration)
    seed: int = Field(0, description="Seed of Optuna's TPE sampler.")
    space: dict[str, Dim] = Field(default_factory=dict, description="Dotted train.* key → dimension.")

    @property
    def budget_s(self) -> float:
        return parse_duration(self.budget, "budget")

    @property
    def trial_cap_s(self) -> float | None:
        return None if self.trial_cap is None else parse_duration(self.trial_cap, "trial_cap")

    def gpu_counts(self, base: Params) -> list[int]:
        dim = self.space.get("train.gpus")
        return sorted({int(v) for v in dim.choices}) if dim else [base.train.gpus]

    def epochs_range(self, base: Params) -> tuple[int, int]:
        dim = self.space.get("train.epochs")
        if dim is None:
            return base.train.epochs, base.train.epochs
        vals = [int(v) for v in dim.extremes()]
        return min(vals), max(vals)


def _first_line(err: ValidationError, source: str) -> str:
    e = err.errors()[0]
    where = ".".join(str(p) for p in e["loc"])
    msg = e["msg"].removeprefix("Value error, ")
    if e["type"] == "bool_type" and isinstance(e.get("input"), str):  # strict booleans: no "yes"
        msg = f"{e['input']!r} is a string, not a boolean; write true or false (unquoted)"
    return f"{source}: {where}: {msg}" if where else f"{source}: {msg}"


def read_spec(path: Path, **overrides: Any) -> SweepSpec:
    """Parse a space file; `overrides` (flags) replace its top-level keys when not None."""
    if not path.is_file():
        raise SpaceError(f"{path}: no such sweep space (see experiments/sweep-tiny.yaml)")
    from draftlab.strict_yaml import DuplicateKey, UniqueKeyLoader

    try:
        raw = yaml.load(path.read_text(), Loader=UniqueKeyLoader) or {}  # noqa: S506 — a SafeLoader subclass
    except DuplicateKey as err:
        raise SpaceError(f"{path}:{err.line}: duplicated key {err.key!r} (the second value would silently "
                         "win); keep one") from None
    except yaml.YAMLError as err:
        raise SpaceError(f"{path}: not valid YAML ({getattr(err, 'problem', err)})") from None
    if not isinstance(raw, dict):
        raise SpaceError(f"{path}: expected a mapping (study, budget, space, …)")
    raw.update({k: v for k, v in overrides.items() if v is not None})
    try:
        spec = SweepSpec.model_validate(raw)
    except ValidationError as err:
        raise SpaceError(_first_line(err, str(path))) from None
    spec.budget_s, spec.trial_cap_s  # noqa: B018 — durations parse now, not mid-sweep
    if spec.stale_after_s < 2 * spec.heartbeat_s:
        raise SpaceError(f"{path}: stale_after_s ({spec.stale_after_s}) must be at least twice heartbeat_s "
                         f"({spec.heartbeat_s}), or a live worker would be taken for dead")
    return spec


def dotted_to_nested(values: dict[str, Any]) -> dict:
    out: dict = {}
    for key, value in values.items():
        node = out
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return out


def trial_params(base: Params, values: dict[str, Any]) -> Params:
    """The base params with a trial's values (dotted keys) merged in, validated."""
    return parse_params(merge(base.model_dump(), dotted_to_nested(values)))


def check_spec(spec: SweepSpec, base: Params, *, num_devices: int, calibrated: set[int] = frozenset()) -> None:
    """Everything that can be wrong before a launch, each as one SpaceError line."""
    if not spec.space:
        raise SpaceError("space: empty; declare at least one of train.epochs, train.lr, train.gpus "
                         "(see experiments/sweep-tiny.yaml)")
    known = set(flatten(base))
    for key, dim in spec.space.items():
        if not key.startswith("train.") or key not in known:
            hint = ("only train.* keys can be swept: every trial shares the target, prepared data and hidden states"
                    if key in known else "not a params key (see `draftlab params`)")
            raise SpaceError(f"space.{key}: {hint}")
        if key in ("train.nnodes", "train.node_rank", "train.rdzv_endpoint", "train.device"):
            raise SpaceError(f"space.{key}: a trial runs on one worker's devices; this key is not searchable")
        if key in ("train.source", "train.vllm_url"):
            raise SpaceError(f"space.{key}: every trial reads the same hidden states; set it in {spec.params}, "
                             "not in the space")
        for value in dim.extremes():
            try:
                trial_params(base, {key: value})
            except ParamsError as err:
                raise SpaceError(f"space.{key} = {value!r}: {str(err).split(': ', 1)[-1]}") from None
            if key == "train.lr" and value <= 0:  # valid params (the watch calls it stalled), never worth a trial
                raise SpaceError(f"space.{key} = {value!r}: an lr of 0 trains nothing; the range must be above 0")
    gpus = spec.space.get("train.gpus")
    if gpus is not None and gpus.choices is None:
        raise SpaceError("space.train.gpus: declare choices, e.g. {choices: [1, 2, 4, 8]}; each count is "
                         "calibrated once")
    if base.train.nnodes != 1:
        raise SpaceError(f"{spec.params}: train.nnodes is {base.train.nnodes}; a sweep trial runs on one node")
    if base.train.source == "vllm" and base.train.vllm_url is None:
        raise SpaceError(f"{spec.params}: train.source is vllm without train.vllm_url: every trial would start "
                         "its own vLLM server and load the target again; start one server (docs/gpu-host.md) and "
                         "set train.vllm_url so the trials share it, or sweep from the store (train.source: store)")
    top = max(spec.gpu_counts(base))
    if top > num_devices:
        raise SpaceError(f"space.train.gpus: {top} exceeds the {num_devices} device slot(s) of this worker; "
                         "lower it or give more devices (--devices / devices:)")
    uncalibrated = [n for n in spec.gpu_counts(base) if n not in calibrated]
    need = len(uncalibrated) * spec.calibration.max_s
    if uncalibrated and spec.budget_s <= need:
        raise SpaceError(f"budget: {spec.budget_s:,.0f} s is shorter than the calibration itself "
                         f"({len(uncalibrated)} GPU count(s) {uncalibrated} × calibration.max_s "
                         f"{spec.calibration.max_s:,.0f} s = {need:,.0f} s); raise the budget or lower "
                         "calibration.max_s")
