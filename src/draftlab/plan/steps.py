"""Packed steps of a train split for `draftlab plan` and the sweep's budget: exact from
per-sample lengths (the computation `draftlab train` logs), or, from sample and token counts
alone, a range over assumed length distributions.

Why counts use a shortcut: `accounting.plan_epochs` (what `draftlab train` runs) builds every
rank's sampler for every epoch; for 35,446 samples × 4 ranks × 5 epochs that is 20 packings of
~0.3–1 s each (18 s measured on a 2-core VM) plus ~10–25 s to import speculators. Steps need
less: every rank's sampler runs the same LPT packing over the same shuffle and keeps only its
own bin, so rank 0's batch count *is* every rank's (plan_epochs asserts they agree), and the
per-epoch reshuffle moves the count by < 0.2 % (measured: 6,581 vs 6,583; 4,998 vs 4,991),
far inside the range spanned by the length distributions. So counts run the sampler once per
(distribution, GPU count) for epoch 0 and multiply by epochs, loading speculators' sampler
file without the package's heavy `__init__` (draftlab.plan.sampler.sampler_class): the same code, a
few seconds in all.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

LENGTH_SIGMAS = (0.35, 0.7, 1.05)  # lognormal spreads tried when only counts are known (narrow → wide)
CENTRAL_SIGMA = 0.7


@dataclass(frozen=True)
class StepEstimate:
    world_size: int
    steps_per_epoch: tuple[int, int]  # (min, max) global optimizer steps of one epoch
    total_steps: tuple[int, int]  # (min, max) over all epochs
    central_total_steps: int
    bounds_per_epoch: tuple[int, int]  # any packing: ceil(tokens / (W × L)) .. floor(samples / W)
    trained_tokens_per_epoch: int  # sum of min(length, total_seq_len) over the train split
    truncated_samples: int  # samples longer than total_seq_len (the collate cuts them)
    exact: bool
    basis: str
    per_distribution: dict[str, list[int]] = field(default_factory=dict)  # steps per epoch


def packing_bounds(trained_tokens: int, num_samples: int, total_seq_len: int, world_size: int) -> tuple[int, int]:
    """A global step holds at most W × L tokens and at least one sample per rank (the sampler
    drops what cannot give every rank one), so lo ≤ steps ≤ hi; lo is capped at hi because a
    sample longer than L still takes a whole row."""
    hi = num_samples // world_size
    return min(math.ceil(trained_tokens / (world_size * total_seq_len)), hi), hi


def epoch_steps(lengths, *, total_seq_len: int, world_size: int, seed: int, epoch: int = 0) -> int:
    """Global optimizer steps of one epoch = rank 0's batches (every rank has as many)."""
    from draftlab.plan.sampler import epoch_batches

    return epoch_batches(lengths, total_seq_len=total_seq_len, world_size=world_size, seed=seed, epoch=epoch)


def plan_from_lengths(lengths: Sequence[int], *, total_seq_len: int, world_size: int, epochs: int,
                      seed: int = 0, exact: bool = True) -> StepEstimate:
    """Steps of a train split whose per-sample lengths are known. exact=True runs
    `accounting.plan_epochs`, the very computation `draftlab train` logs; exact=False counts
    epoch 0 with the same sampler and multiplies by epochs (for other GPU counts in a table)."""
    lengths = [int(n) for n in lengths]
    trained = sum(min(n, total_seq_len) for n in lengths)
    truncated = sum(n > total_seq_len for n in lengths)
    if exact:
        from draftlab.plan import accounting as acc

        per_epoch = [e.steps for e in acc.plan_epochs(lengths, total_seq_len=total_seq_len, world_size=world_size,
                                                      epochs=epochs, seed=seed).epochs]
        basis = f"exact: draftlab.plan.accounting on {len(lengths):,} per-sample lengths, every rank and epoch"
    else:
        per_epoch = [epoch_steps(lengths, total_seq_len=total_seq_len, world_size=world_size, seed=seed)] * epochs
        basis = f"speculators' sampler on {len(lengths):,} per-sample lengths, epoch 0 × {epochs}"
    return StepEstimate(
        world_size=world_size,
        steps_per_epoch=(min(per_epoch), max(per_epoch)),
        total_steps=(sum(per_epoch), sum(per_epoch)),
        central_total_steps=sum(per_epoch),
        bounds_per_epoch=packing_bounds(trained, len(lengths), total_seq_len, world_size),
        trained_tokens_per_epoch=trained,
        truncated_samples=truncated,
        exact=exact,
        basis=basis,
        per_distribution={"measured": per_epoch},
    )


def synthesise_lengths(num_samples: int, num_tokens: int, *, sigma: float, max_len: int, seed: int = 0):
    """`num_samples` lognormal(σ) lengths in [1, max_len] summing to exactly `num_tokens`
    (clipping, then rescaling the unclipped part until the mean is restored)."""
    import numpy as np

    if not num_samples <= num_tokens <= num_samples * max_len:
        raise ValueError(f"{num_tokens:,} tokens cannot be {num_samples:,} samples of 1..{max_len:,} tokens")
    x = np.random.default_rng(seed).lognormal(0.0, sigma, num_samples)
    x *= num_tokens / x.sum()
    for _ in range(50):
        x = np.clip(x, 1, max_len)
        free = (x > 1) & (x < max_len)
        missing = num_tokens - x.sum()
        if abs(missing) < 0.5 or not free.any():
            break
        x[free] *= 1 + missing / x[free].sum()
    out = np.clip(np.rint(x), 1, max_len).astype(np.int64)
    residual = int(num_tokens - out.sum())  # rounding: move single tokens where there is room
    step = 1 if residual > 0 else -1
    room = np.nonzero(out < max_len if step > 0 else out > 1)[0]
    out[room[: abs(residual)]] += step
    assert out.sum() == num_tokens, (out.sum(), num_tokens)
    return out


def plan_from_counts(num_samples: int, num_tokens: int, *, total_seq_len: int, world_size: int, epochs: int,
                     seed: int = 0, max_sample_len: int | None = None,
                     sigmas: Sequence[float] = LENGTH_SIGMAS) -> StepEstimate:
    """Steps of a train split known only by its sample and token counts: lengths are
    synthesised as lognormal(σ) for each σ, matched to the mean and capped at `max_sample_len`
    (default total_seq_len: data prepared for this packing length), and packed by the trainer's
    sampler. The result is the min–max over σ; `bounds_per_epoch` hold for any distribution."""
    max_len = max_sample_len or total_seq_len
    if num_tokens > num_samples * max_len:  # stated counts mean longer samples than L: they get cut
        max_len = math.ceil(3 * num_tokens / num_samples)
    per: dict[str, list[int]] = {}
    for sigma in sigmas:
        lengths = synthesise_lengths(num_samples, num_tokens, sigma=sigma, max_len=max_len, seed=seed)
        per[f"lognormal σ={sigma:g}"] = [epoch_steps(lengths, total_seq_len=total_seq_len, world_size=world_size,
                                                     seed=seed)] * epochs
    per_epoch = [v[0] for v in per.values()]
    central = per.get(f"lognormal σ={CENTRAL_SIGMA:g}", list(per.values())[len(per) // 2])
    trained, truncated = num_tokens, 0  # capped at max_len: only lengths above total_seq_len lose tokens
    if max_len > total_seq_len:  # estimated from the central distribution
        import numpy as np

        mid = synthesise_lengths(num_samples, num_tokens, sigma=CENTRAL_SIGMA, max_len=max_len, seed=seed)
        trained, truncated = int(np.minimum(mid, total_seq_len).sum()), int((mid > total_seq_len).sum())
    mean = num_tokens / num_samples
    return StepEstimate(
        world_size=world_size,
        steps_per_epoch=(min(per_epoch), max(per_epoch)),
        total_steps=(min(per_epoch) * epochs, max(per_epoch) * epochs),
        central_total_steps=sum(central),
        bounds_per_epoch=packing_bounds(trained, num_samples, total_seq_len, world_size),
        trained_tokens_per_epoch=trained,
        truncated_samples=truncated,
        exact=False,
        basis=(f"assumed lengths: lognormal σ ∈ {{{', '.join(f'{s:g}' for s in sigmas)}}} with mean {mean:,.0f}, "
               f"capped at {max_len:,} tokens; speculators' sampler, epoch 0 × {epochs} "
               "(the reshuffle moves a count by < 0.2 %)"),
        per_distribution=per,
    )
