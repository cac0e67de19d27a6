"""Step accounting: exactly what a training job will do, computed before step one with the
trainer's own packing sampler, and checked against what the ranks did at the end.

speculators trains with batch_size = 1 where one "sample" of a rank's step is a row packed with
whole conversations up to `total_seq_len` tokens; a global optimizer step is one packed row on
each of the W data-parallel ranks, so it holds at most W × total_seq_len tokens. Its sampler
(`MultipackDistributedBatchSamplerV2`) reshuffles every epoch (seed + epoch), so the number of
packed steps can differ per epoch, and it drops the samples that cannot give every rank a batch.

The same functions serve `draftlab train` (exact, from the per-sample lengths) and `draftlab plan`.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class EpochPlan:
    epoch: int
    steps: int  # global optimizer steps = batches per rank
    samples_used: int
    dropped_samples: int
    rank_digests: list[str]  # sha256 of each rank's sorted sample ids
    rank_samples: list[int]


@dataclass(frozen=True)
class Accounting:
    world_size: int
    train_samples: int
    train_tokens: int
    train_loss_tokens: int
    total_seq_len: int
    epochs: list[EpochPlan] = field(default_factory=list)
    max_steps: int | None = None  # a step-limited (calibration) run: speculators' --max-steps
    trained_steps: list[int] = field(default_factory=list)  # per epoch under max_steps (compat's rule)

    @property
    def steps_per_epoch(self) -> int:
        return self.epochs[0].steps

    @property
    def total_steps(self) -> int:
        """Global steps the run trains: all of every epoch, or what max_steps leaves of them."""
        return sum(self.trained_steps) if self.max_steps is not None else sum(e.steps for e in self.epochs)

    @property
    def tokens_per_step(self) -> int:
        return self.world_size * self.total_seq_len

    @property
    def dropped_samples(self) -> list[int]:
        return [e.dropped_samples for e in self.epochs]

    def mlflow_params(self) -> dict:
        return {
            "world_size": self.world_size,
            "train_samples": self.train_samples,
            "train_tokens": self.train_tokens,
            "train_loss_tokens": self.train_loss_tokens,
            # every epoch, as `dropped_samples`: the sampler reshuffles, so epoch 0 is not all of them
            "steps_per_epoch": [e.steps for e in self.epochs],
            "total_steps": self.total_steps,
            "tokens_per_step": self.tokens_per_step,
            "dropped_samples": self.dropped_samples,
        }

    def to_json(self) -> dict:
        out = asdict(self)
        out.update(self.mlflow_params())
        out["steps_per_epoch_list"] = [e.steps for e in self.epochs]
        if self.max_steps is not None:
            out["trained_steps_per_epoch"] = list(self.trained_steps)
        return out

    def limited(self, max_steps: int | None) -> Accounting:
        """This plan under speculators' --max-steps (draftlab.plan.sampler.steps_under_max_steps)."""
        if max_steps is None:
            return self
        from dataclasses import replace

        from draftlab.plan.sampler import steps_under_max_steps

        return replace(self, max_steps=max_steps,
                       trained_steps=steps_under_max_steps([e.steps for e in self.epochs], max_steps))


def digest(sample_ids) -> str:
    return hashlib.sha256(",".join(map(str, sorted(int(i) for i in sample_ids))).encode()).hexdigest()


def rank_batches(lengths: list[int], *, total_seq_len: int, world_size: int, rank: int, seed: int, epoch: int):
    """The batches (lists of train-split sample ids) rank `rank` gets in `epoch`: the trainer's
    own sampler, constructed as speculators' dataloader constructs it."""
    from draftlab.plan.sampler import sampler_class

    sampler = sampler_class()(
        batch_max_length=total_seq_len, lengths=lengths, num_replicas=world_size, rank=rank, seed=seed
    )
    sampler.set_epoch(epoch)
    return [[int(i) for i in b] for b in sampler]


def plan_epochs(
    lengths: list[int],
    *,
    loss_tokens: int | None = None,
    total_seq_len: int,
    world_size: int,
    epochs: int,
    seed: int,
    batches: list[list[list[list[int]]]] | None = None,
) -> Accounting:
    """Exact per-epoch steps, drops and per-rank sample sets for a train split of `lengths`.
    `batches`: `rank_batches` of every (epoch, rank), when the caller has them already."""
    plans = []
    for epoch in range(epochs):
        per_rank = batches[epoch] if batches is not None else [
            rank_batches(lengths, total_seq_len=total_seq_len, world_size=world_size, rank=r, seed=seed, epoch=epoch)
            for r in range(world_size)
        ]
        steps = {len(b) for b in per_rank}
        assert len(steps) == 1, f"ranks disagree on the number of steps: {steps}"
        ids = [[i for batch in b for i in batch] for b in per_rank]
        used = sum(len(x) for x in ids)
        plans.append(EpochPlan(
            epoch=epoch,
            steps=steps.pop(),
            samples_used=used,
            dropped_samples=len(lengths) - used,
            rank_digests=[digest(x) for x in ids],
            rank_samples=[len(x) for x in ids],
        ))
    return Accounting(
        world_size=world_size,
        train_samples=len(lengths),
        train_tokens=int(sum(lengths)),
        train_loss_tokens=int(loss_tokens if loss_tokens is not None else sum(lengths)),
        total_seq_len=total_seq_len,
        epochs=plans,
    )


def check_observed(plan: Accounting, observed: dict[int, dict[int, list[int]]], observed_steps: int,
                   observed_per_epoch: dict[int, int] | None = None) -> list[str]:
    """Compare what the ranks did with the plan. `observed[epoch][rank]` = sample ids the rank
    was given; `observed_per_epoch[epoch]` = global step at the end of each epoch (checked for
    a step-limited run, whose epochs stop early). Returns one message per mismatch."""
    problems = []
    if observed_steps != plan.total_steps:
        problems.append(f"global steps: observed {observed_steps}, predicted {plan.total_steps}")
    if plan.max_steps is not None and observed_per_epoch is not None:
        ends = [sum(plan.trained_steps[: i + 1]) for i in range(len(plan.trained_steps))]
        seen = [observed_per_epoch.get(e) for e in range(len(ends))]
        if seen != ends:
            problems.append(f"step-limited run (max_steps {plan.max_steps}): global step at each epoch's end "
                            f"observed {seen}, predicted {ends}")
    for ep in plan.epochs:
        ranks = observed.get(ep.epoch)
        if ranks is None:
            problems.append(f"epoch {ep.epoch}: no sample record from any rank")
            continue
        if sorted(ranks) != list(range(plan.world_size)):
            problems.append(f"epoch {ep.epoch}: records from ranks {sorted(ranks)}, expected 0..{plan.world_size - 1}")
        seen: set[int] = set()
        for r, ids in sorted(ranks.items()):
            overlap = seen & set(ids)
            if overlap:
                problems.append(f"epoch {ep.epoch}: rank {r} repeats {len(overlap)} samples another rank had")
            seen |= set(ids)
            if r < len(ep.rank_digests) and digest(ids) != ep.rank_digests[r]:
                problems.append(f"epoch {ep.epoch}: rank {r} got a different sample set than predicted")
        missing = plan.train_samples - len(seen)
        if missing != ep.dropped_samples:
            problems.append(
                f"epoch {ep.epoch}: {missing} train samples unseen, predicted drops {ep.dropped_samples}"
            )
    return problems
