"""draftlab.plan.run_timing.Eta: time left = steps left × s/step + epoch boundaries left × s/epoch,
re-estimated as the rate changes, with a 10–90 % range."""

from __future__ import annotations

import random

import pytest

from draftlab.plan.run_timing import Eta
from draftlab.rundir import RankPlan

PLAN = RankPlan(total_steps=30, epoch_steps=[10, 10, 10], val_steps=6)


def timeline(step_s, boundary_s=3.0, per_epoch=10, epochs=3, jitter=0.0, seed=0, first_boundary_extra=0.0):
    """End time of every global step; an epoch boundary (validation + checkpoint) after each epoch,
    the first one `first_boundary_extra` longer (its loader's workers start)."""
    rng, t, ends = random.Random(seed), 10.0, []
    for step in range(per_epoch * epochs):
        t += step_s(step) * (1 + rng.uniform(-jitter, jitter))
        ends.append(t)
        if step % per_epoch == per_epoch - 1:
            t += boundary_s + (first_boundary_extra if step == per_epoch - 1 else 0.0)
    return ends, t  # t: the run's end, after the last validation + checkpoint


def feed(eta, ends, upto):
    for step in range(upto + 1):
        eta.step_ended(step, ends[step], 0.0)
    return eta.estimate(upto)


def test_eta_at_ten_percent_counts_the_epoch_boundaries_still_ahead():
    ends, end = timeline(lambda s: 0.5)
    got = feed(Eta(PLAN.model_copy(update={"epoch_s_prior": 3.0})), ends, 3)
    assert got["perf/eta_s"] == pytest.approx(end - ends[3])  # 26 × 0.5 s + 3 boundaries × 3 s
    # without a measured prior: the validation pass at a third of a step per batch
    assert feed(Eta(PLAN), ends, 3)["perf/eta_s"] == pytest.approx(26 * 0.5 + 3 * 6 * 0.5 / 3)  # tail: one boundary
    # after the first boundary, its own measurement wins over the prior
    assert feed(Eta(PLAN.model_copy(update={"epoch_s_prior": 100.0})), ends, 12)["perf/eta_s"] == pytest.approx(end - ends[12])


def test_the_first_boundarys_one_offs_are_not_counted_again_for_every_epoch_ahead():
    """The first validation starts its loader's workers (once): an ETA that charged every epoch
    ahead with it said twice the time left at 10 % of a 12-epoch run on the tiny default."""
    plan = RankPlan(total_steps=60, epoch_steps=[10] * 6, val_steps=6, epoch_s_prior=3.0)
    ends, end = timeline(lambda s: 0.5, epochs=6, first_boundary_extra=10.0)
    got = feed(Eta(plan), ends, 12)
    assert got["perf/eta_s"] == pytest.approx(end - ends[12])  # a matching run's boundary
    assert got["perf/eta_p10_s"] <= end - ends[12] <= got["perf/eta_p90_s"]
    # from the second boundary on, the boundaries after the first, with or without a prior
    assert feed(Eta(plan.model_copy(update={"epoch_s_prior": None})), ends, 22)["perf/eta_s"] == pytest.approx(end - ends[22])


def test_eta_follows_a_rate_that_changes_and_its_range_holds_the_end():
    ends, end = timeline(lambda s: 0.5 if s < 12 else 1.0, jitter=0.2)
    got = feed(Eta(PLAN.model_copy(update={"epoch_s_prior": 3.0})), ends, 24)
    actual = end - ends[24]
    assert got["perf/eta_s"] == pytest.approx(actual, rel=0.15), "the recent rate, not the run's mean"
    assert got["perf/eta_p10_s"] <= actual <= got["perf/eta_p90_s"]


def test_the_tail_after_the_last_step_comes_from_a_matching_run():
    ends, end = timeline(lambda s: 0.5)
    launcher_checks = 2.0  # after the final validation + checkpoint: accounting check, artifacts
    got = feed(Eta(PLAN.model_copy(update={"epoch_s_prior": 3.0, "tail_s_prior": 3.0 + launcher_checks})), ends, 3)
    assert got["perf/eta_s"] == pytest.approx(end + launcher_checks - ends[3])


def test_the_range_holds_a_tail_that_varies_from_run_to_run():
    ends, end = timeline(lambda s: 0.5, jitter=0.1)
    tails = [2.0, 5.0, 3.0]  # three matching runs' tails: the ETA takes their median …
    plan = PLAN.model_copy(update={"epoch_s_prior": 3.0, "tail_s_prior": 3.0, "tail_s_lo": min(tails),
                                   "tail_s_hi": max(tails)})
    eta = Eta(plan)
    for step in range(len(ends)):
        eta.step_ended(step, ends[step], 0.0)
        if step >= 11:
            got = eta.estimate(step)
            # … and its range spans theirs: the run ending with its tail anywhere in it is inside
            for tail in (2.2, 4.8):
                left = end - 3.0 + tail - ends[step]
                assert got["perf/eta_p10_s"] <= left <= got["perf/eta_p90_s"], (step, tail, got)
    # one measured tail: its spread is unknown, the range says so (0.5–2× it)
    one = feed(Eta(PLAN.model_copy(update={"epoch_s_prior": 3.0, "tail_s_prior": 3.0})), ends, 28)
    assert one["perf/eta_p90_s"] - one["perf/eta_s"] >= 3.0 - 1e-9
