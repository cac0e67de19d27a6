"""What a training will cost before it starts, and what it did after: step accounting, the cost
model, `draftlab plan` and the run's ETA.

    accounting  the exact global steps, drops, tokens and per-rank sample sets of every epoch
                (speculators' own packing sampler), and the end-of-run check against them
    steps       the steps of a plan from sample lengths alone (no store, no model)
    inputs      what `plan` reads: a prepared dataset, a manifest, counts or a profile
    costmodel   start-up + steps × s/step + epoch boundaries × s/epoch, from measured points
    planning    `draftlab plan`: bytes, steps, wall-clock and GPU-hours per GPU count
    run_timing  the live ETA of a running training, its 10–90 % range, the harness's CPU
    sampler     speculators' packing sampler (loaded without the package) and its --max-steps rule
    cache       the launcher's split, accounting and validation steps, kept by the hash of their inputs

May import: the shared core, `store.layout`, `store.hidden_states` (the dtype a trainer reads),
`store.capture` (the dataset's fingerprint, the cache's key), `observe.telemetry`. Never `training` (which imports the plan), never a stage.
"""
