"""speculators' packing sampler as the planner sees it: the global steps of an epoch, the batches
each rank gets, and what `--max-steps` leaves of each epoch. The sampler's own file is executed
alone when speculators is not imported (`draftlab.pinned.speculators_module`), so `draftlab plan`
and the launcher skip the package's 10–25 s import; the trainer runs the very same code.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

from draftlab.pinned import speculators_module


def steps_under_max_steps(steps_per_epoch: Sequence[int], max_steps: int | None) -> list[int]:
    """Global steps each epoch trains with ``--max-steps`` in speculators 0.9.0.

    ``Trainer.train_epoch`` breaks once ``global_step >= max_steps``, checked only *after* a
    step, while ``run_training`` keeps looping over every epoch (checkpoint and validation
    included): each epoch after the limit still trains one step. So ``--epochs E --max-steps N``
    trains N + E − 1 steps when N ≤ the first epoch's steps, and a calibration
    (``--epochs 2``) has exactly one epoch boundary to time. ``--scheduler-total-steps``, which
    draftlab always passes, overrides the schedule length ``max_steps`` would set.
    tests/integration/test_compat_torchrun.py runs the real trainer against this.
    """
    out, done = [], 0
    for steps in steps_per_epoch:
        trained = 0
        for _ in range(steps):
            done += 1
            trained += 1
            if max_steps is not None and done >= max_steps:
                break
        out.append(trained)
    return out


def sampler_class():
    """speculators' MultipackDistributedBatchSamplerV2: the imported one if speculators is
    loaded, else the same file executed alone (skipping the package's 10–25 s import)."""
    return speculators_module("train.distributed_batch_sampler").MultipackDistributedBatchSamplerV2


def epoch_batches(lengths: Sequence[int], *, total_seq_len: int, world_size: int, seed: int, epoch: int = 0) -> int:
    """Global optimizer steps of one epoch = rank 0's batches from the packing sampler (every
    rank has as many)."""
    with warnings.catch_warnings():  # its "samples longer than batch_max_length" note: the plan warns itself
        warnings.simplefilter("ignore", UserWarning)
        sampler = sampler_class()(batch_max_length=total_seq_len, lengths=lengths, num_replicas=world_size,
                                  rank=0, seed=seed)
    sampler.set_epoch(epoch)
    return len(sampler)
