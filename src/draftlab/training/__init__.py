"""How a training job runs, apart from the stage that owns it (`stages/train.py`).

    job        the pieces the launcher and a joining node share: run key, step plan, checks
               before launch, vocabulary maps, speculators' argv, the ranks' command and environment
    launch     the torchrun command, the run folder's lock, node 0's ranks under their observers,
               stopping orphaned ranks
    record     what node 0's launcher records in the MLflow run and the run folder, step by step
    torchrun   `python -m draftlab.training.torchrun`: torch's launcher without the teardown
    rank       `python -m draftlab.training.rank`: one rank, speculators' trainer plus draftlab's
               observers (metrics to MLflow, step and sample records, the convergence watch)
    metrics    rank 0's per-step `metrics.jsonl`, evaluate's loss curves
    compat     the trainer's internals draftlab patches (CPU) or observes, behind one version check
               (the dataset's reader is `store.hidden_states`'; the packing sampler `plan.sampler`'s)
    checkpoint checkpoints visible only complete (written aside, synced, renamed), a free-space
               check before each save, the newest complete one for resume and export
    nodes      a node other than 0 joining node 0's run
    startup    the time to the first step by phase (train.json `startup`)

May import: the shared core, `plan`, `store.layout`, `store.capture` (fingerprints),
`store.hidden_states` (what the ranks read), `observe` (telemetry, the live and final verdict).
Never a stage.
"""
