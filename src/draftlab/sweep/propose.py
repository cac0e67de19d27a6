"""Where a search trial's values come from, so that the study holds only trials that ran.

Optuna's `ask()` creates a RUNNING trial, with its start time, before draftlab can predict what
the values cost; a proposal that then does not fit the budget would stay in the study as a trial
that ran (optuna-dashboard draws a timeline bar from `datetime_start` to `datetime_complete` for
every finished trial, and Optuna requires a start time for every trial that is not WAITING). So
a worker draws its proposals from a *proposal study* in memory that mirrors the real one — its
completed, pruned and running search trials, plus every proposal any worker rejected (kept in the
real study's user attributes, `draftlab.rejected.<worker>`, and mirrored as PRUNED so that TPE
steers away from them) — with TPE seeded by the history's length. Only a proposal that is
launched becomes a trial of the real study (`create_running`), RUNNING from its launch; the
rejected ones are in the report (trials.csv, status `rejected`) and not in the study.
"""

from __future__ import annotations

from typing import Any

from draftlab.params import Params
from draftlab.sweep.space import SweepSpec

REJECTED_ATTR = "draftlab.rejected."  # + worker id → [{"values", "distributions", "reason", …}]


def suggest(trial, spec: SweepSpec, base: Params) -> dict[str, Any]:
    """The trial's values for the space's keys (int or float ranges as the params key's type)."""
    raw = base.model_dump()
    out = {}
    for key, dim in spec.space.items():
        section, name = key.split(".", 1)
        is_int = isinstance(raw[section][name], int) and not isinstance(raw[section][name], bool)
        if dim.choices is not None:
            out[key] = trial.suggest_categorical(key, dim.choices)
        elif is_int:
            out[key] = trial.suggest_int(key, int(dim.low), int(dim.high), step=int(dim.step or 1), log=dim.log)
        else:
            out[key] = trial.suggest_float(key, dim.low, dim.high, step=dim.step, log=dim.log)
    return out


def sampler(spec: SweepSpec, offset: int = 0):
    """TPE, seeded; constant_liar: concurrent trials see each other as pending, so it spreads them."""
    import optuna

    return optuna.samplers.TPESampler(seed=spec.seed + offset, constant_liar=True)


def rejected(study) -> list[dict]:
    """Every worker's rejected proposals, oldest first."""
    out = [r for k, v in study.user_attrs.items() if k.startswith(REJECTED_ATTR) for r in v]
    return sorted(out, key=lambda r: r.get("at", 0))


def propose(study, spec: SweepSpec, base: Params, own_rejected: list[dict] = (),
            queued: list[tuple[dict, dict]] = ()) -> tuple[dict, dict]:
    """(values, distributions) of the next search proposal, from the study's history; `queued`:
    this worker's proposals waiting for slots, pending like running trials (constant liar)."""
    import optuna
    from optuna.distributions import json_to_distribution
    from optuna.trial import TrialState, create_trial

    history = []
    for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED, TrialState.RUNNING)):
        if t.user_attrs.get("role") == "calibration" or not t.distributions:
            continue
        history.append(create_trial(state=t.state, params=t.params, distributions=t.distributions,
                                    value=t.value if t.state == TrialState.COMPLETE else None,
                                    intermediate_values=t.intermediate_values))
    seen = set()
    for r in [*rejected(study), *own_rejected]:  # own: not yet read back from the storage's cache
        if r["id"] in seen:
            continue
        seen.add(r["id"])
        history.append(create_trial(state=TrialState.PRUNED, params=r["values"],
                                    distributions={k: json_to_distribution(d) for k, d in r["distributions"].items()}))
    for values, distributions in queued:
        history.append(create_trial(state=TrialState.RUNNING, params=values, distributions=distributions))
    shadow = optuna.create_study(direction=spec.objective.direction, sampler=sampler(spec, len(history)))
    shadow.add_trials(history)
    trial = shadow.ask()
    values = suggest(trial, spec, base)
    return values, dict(trial.distributions)


def create_running(study, values: dict, distributions: dict, user_attrs: dict):
    """A RUNNING trial of the real study with these values, started now (what `ask()` would make,
    without sampling): the pruner, `report` and `tell` work on it as on any asked trial."""
    import optuna
    from optuna.trial import TrialState, create_trial

    frozen = create_trial(state=TrialState.RUNNING, params=values, distributions=distributions, user_attrs=user_attrs)
    trial_id = study._storage.create_new_trial(study._study_id, template_trial=frozen)
    return optuna.Trial(study, trial_id)
