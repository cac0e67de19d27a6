"""Budget-aware Optuna sweeps over epochs, lr and GPU count (`draftlab sweep SPACE.yaml --budget 24h`).

Where Optuna's `timeout=` only stops *starting* trials, a sweep here never spends time it does
not have:

  calibrate  one step-limited trial per GPU count (base lr, epochs 2, max_steps 20+) measures
             start-up, seconds per global step and per epoch boundary (draftlab.plan.costmodel); cached
             in the study, never told to it as a completed trial; E(n) = T(n) / (n · T(n0)) logged
  predict    steps from `draftlab.plan.planning` (the sampler `draftlab plan` and `train` use) ×
             seconds per step + epochs × per-epoch cost + start-up
  reject     a proposal whose prediction × (1 + margin) does not fit the remaining budget (or
             the per-trial cap) is recorded as rejected, with the reason, and never started (nor
             made a trial of the study: draftlab.sweep.propose)
  guard      a started trial is stopped at min(cap, remaining budget): SIGTERM to its process
             groups, SIGKILL after `stop_grace_s`; so the sweep ends within budget + grace
  prune      per-epoch values feed the study's pruner
  pack       trials run concurrently on disjoint device slots (CUDA_VISIBLE_DEVICES; CPU slots)

Spent budget is the wall-clock during which at least one worker of the study was alive: each
worker keeps its own [start, last heartbeat] span in the study's user attributes, and spent is
the *union* of the spans. A second worker on the same storage therefore shares the budget
(neither counts the other's time twice), and a kill -9 stops the clock at the last heartbeat;
the rerun, or on PostgreSQL any other worker (Optuna's trial heartbeat), finds the dead worker's
RUNNING trials, stops their processes, marks them failed.

Everything that waits or measures time goes through a `Clock`, and trials through a `Launcher`,
so the budget logic is tested with simulated durations (tests/unit/test_sweep.py); the real
launcher (draftlab.sweep.trial) runs `draftlab train` + `draftlab evaluate` in a process group.

    space        the space file: what is searched, budget, objective, storage (validated up front)
    budget       the injectable clock and trial interfaces, the worker-span ledger
    calibration  which GPU counts need a calibration trial, what it runs, the points it leaves
    propose      search values from the study's history, so that the study holds only trials that ran
    storage      journal or PostgreSQL/sqlite, the study-wide lock, Optuna's heartbeat on RDB
    peers        this worker's liveness and the death of others (their trials interrupted)
    loop         one worker (~490 lines: its states — queued, running, stopping, killed — and the
                 scheduling that moves trials between them read best in one place)
    study        the Optuna study, the parent MLflow run, `draftlab sweep` itself
    report       the parent run's artifacts: trials.csv, best params, Pareto front, importances
    trial        one trial as a process (`python -m draftlab.sweep.trial`) and the launcher of it

Sits above the stages (it runs `train` and `evaluate` as a trial does).
May import: the shared core, `stages`, `plan`, `training.job`, `store.layout`, `store.hidden_states`
(the source every trial reads: a shared vLLM server is checked once), `registry` (the best trial's
alias), `serve.draft_export` (a trial's draft folder).
"""