"""A sweep with a diverging region of its space (lr too large), on the simulated machine of
tests/sweep_sim.py: the convergence watch stops those trainings early, the sweep prunes the
trials at once, says why, and the budget they would have used goes to other trials."""

from __future__ import annotations

from draftlab.sweep.budget import Outcome
from tests.sweep_sim import FIXED, POLL, STEP_S, FakeClock, SimHandle, SimLauncher, make_spec, make_worker

DIVERGES_ABOVE = 5e-3
STOPPED_AFTER_S = FIXED + 3 * STEP_S[1]  # start-up and three steps: the NaN (watch) stops it there


class DivergingHandle(SimHandle):
    def poll(self):
        if self.spec.role == "search" and self.spec.params.train.lr > DIVERGES_ABOVE:
            if self.clock.now() - self.start >= STOPPED_AFTER_S:
                return Outcome(False, None, STOPPED_AFTER_S, run_id=f"run{self.spec.number}",
                               message="train: train/loss_0 is nan at global step 3", convergence="diverged")
            return None
        return super().poll()


class DivergingLauncher(SimLauncher):
    def start(self, spec):
        h = DivergingHandle(self, spec, self.clock, self.duration(spec.params), self.honors_sigterm)
        self.started.append((spec, self.clock.now(), h))
        return h


def _sweep(tmp_path, launcher_cls, order):
    clock = FakeClock()
    launcher = launcher_cls(clock)
    spec = make_spec(tmp_path, budget=900, space={"train.epochs": {"choices": [2]}, "train.lr": {"choices": [2e-3, 9e-3]},
                                                  "train.gpus": {"choices": [1]}})
    w = make_worker(tmp_path, spec, clock, launcher, devices=("cpu0",), n_trials=len(order) + 1)
    w.start()
    for lr in order:
        w.study.enqueue_trial({"train.epochs": 2, "train.lr": lr, "train.gpus": 1})
    while not w.step():
        clock.sleep(POLL)
    return w, launcher


def test_diverging_trials_are_pruned_at_once_with_the_reason_and_their_budget_released(tmp_path):
    order = [9e-3, 2e-3, 9e-3, 2e-3, 2e-3]
    w, launcher = _sweep(tmp_path, DivergingLauncher, order)
    search = [t for t in w.study.get_trials() if t.user_attrs.get("role") == "search"]
    diverging = [t for t in search if t.params["train.lr"] > DIVERGES_ABOVE]
    assert diverging and all(t.state.name == "PRUNED" for t in diverging)
    for t in diverging:
        assert t.user_attrs["status"] == "pruned"
        assert "loss diverged (train.watch)" in t.user_attrs["reason"] and "released" in t.user_attrs["reason"]
        assert t.user_attrs["wall_s"] < t.user_attrs["predicted_s"] / 2, "stopped long before its predicted end"
    # every search trial ran a training that stops on the watch's trends
    assert all(s.params.train.watch.stop_on == ["stalled", "diverging"] for s, _, _ in launcher.started
               if s.role == "search")
    # what the diverging ones did not spend went to the others: more trials completed than a
    # sweep whose diverging trials ran to their end
    (tmp_path / "full").mkdir()
    w_full, _ = _sweep(tmp_path / "full", SimLauncher, order)
    done = sum(t.user_attrs.get("status") == "completed" for t in search)
    done_full = sum(t.user_attrs.get("status") == "completed" for t in w_full.study.get_trials()
                    if t.user_attrs.get("role") == "search" and t.params["train.lr"] < DIVERGES_ABOVE)
    assert done > done_full


def test_a_trial_that_fails_otherwise_is_not_pruned(tmp_path):
    class Failing(SimHandle):
        def poll(self):
            if self.spec.role == "search" and self.clock.now() - self.start >= FIXED:
                return Outcome(False, None, FIXED, message="train: accounting mismatch")
            return None if self.spec.role == "search" else super().poll()

    class L(SimLauncher):
        def start(self, spec):
            h = Failing(self, spec, self.clock, self.duration(spec.params), self.honors_sigterm)
            self.started.append((spec, self.clock.now(), h))
            return h

    w, _ = _sweep(tmp_path, L, [2e-3])
    search = [t for t in w.study.get_trials() if t.user_attrs.get("role") == "search"]
    assert [t.user_attrs["status"] for t in search] == ["failed"]
