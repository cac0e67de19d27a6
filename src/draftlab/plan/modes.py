"""Offline against online training, priced for `draftlab plan`: which mode costs less wall-clock
and disk for this target and dataset.

    offline   disk: the store (planning.store_bytes, 4.6 TiB at the reference);
              wall-clock: extraction (every token's forward once, at the target's forward
              tokens/s: 9.4 h at the reference) + training reading the store (the cost model)
    online    disk: none (one sample's states in flight per loader, deleted once read);
              wall-clock: the same training + the target's forward of every sample of every
              epoch (train and val split: speculators validates each epoch), per step
              `forward_s_per_step` = a step's real tokens ÷ the forward tokens/s. Serial, as
              speculators' loader asks with `num_workers: 0`; loader workers overlap the two,
              which can bring it down to the larger of them (`overlapped_hours`)

The forward tokens/s is the extraction throughput (`--extract-tokens-per-s`): online asks the
same vLLM server the same `max_tokens: 1` completion per sample. Online also keeps the target
loaded beside the draft for the whole training (its GPUs are not the draft's): the plan says so.
"""

from __future__ import annotations

from dataclasses import dataclass

TIB = 2**40


@dataclass(frozen=True)
class ModeCost:
    mode: str  # offline | online
    disk_bytes: int
    forward_hours: float | None  # the target's forward: extraction once, or every epoch online
    train_hours: float | None  # the draft's training steps (the cost model's row at the world size)
    total_hours: float | None  # serial: forward + training
    overlapped_hours: float | None = None  # online with loader workers: at best the larger of the two


@dataclass(frozen=True)
class ModeComparison:
    offline: ModeCost
    online: ModeCost
    forward_tokens_per_s: float | None
    forward_s_per_step: float | None  # online: the target's forward of one global step's real tokens
    cheaper_wall_clock: str | None  # offline | online | online with workers | None (a throughput is missing)
    verdict: str


def compare(*, store_bytes: int, num_tokens: int, epochs: int, train_tokens_per_epoch: int, steps_per_epoch: int,
            train_s: float | None, forward_tokens_per_s: float | None) -> ModeComparison:
    """`train_s`: the training's wall-clock at the plan's world size (None: not measured);
    `forward_tokens_per_s`: the target's forward (None: not stated)."""
    train_h = train_s / 3600 if train_s is not None else None
    if forward_tokens_per_s:
        extract_h = num_tokens / forward_tokens_per_s / 3600
        online_forward_h = epochs * num_tokens / forward_tokens_per_s / 3600
        per_step = train_tokens_per_epoch / max(steps_per_epoch, 1) / forward_tokens_per_s
    else:
        extract_h = online_forward_h = per_step = None
    offline = ModeCost("offline", store_bytes, extract_h, train_h, _sum(extract_h, train_h))
    online = ModeCost("online", 0, online_forward_h, train_h, _sum(online_forward_h, train_h),
                      max(online_forward_h, train_h) if online_forward_h is not None and train_h is not None else None)
    disk = f"online saves the {store_bytes / TIB:.2f} TiB store"
    if offline.total_hours is None or online.total_hours is None:
        missing = " and ".join(m for m, v in (("the target's forward tokens/s (--extract-tokens-per-s)",
                                               forward_tokens_per_s), ("a training throughput", train_h)) if not v)
        return ModeComparison(offline, online, forward_tokens_per_s, per_step, None,
                              f"{disk}; give {missing} to compare their wall-clock")
    if online.total_hours < offline.total_hours:
        cheaper, lead = "online", "online costs less wall-clock"
    elif online.overlapped_hours < offline.total_hours:
        cheaper, lead = "online with workers", ("online costs less wall-clock only if loader workers "
                                                "(train.num_workers > 0) hide the target's forward behind training")
    else:
        cheaper, lead = "offline", "offline costs less wall-clock"
    verdict = (f"{lead}: offline {offline.total_hours:.1f} h (extraction "
               f"{extract_h:.1f} h + training {train_h:.1f} h) and {store_bytes / TIB:.2f} TiB of disk; online "
               f"{online.total_hours:.1f} h (training + the target's forward {online_forward_h:.1f} h over {epochs} "
               f"epoch(s), {per_step:.3g} s per step; {online.overlapped_hours:.1f} h at best with loader workers "
               f"overlapping them) and no store; {disk}, and keeps the target loaded beside the draft throughout")
    return ModeComparison(offline, online, forward_tokens_per_s, per_step, cheaper, verdict)


def _sum(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a + b


def modes_table(c: ModeComparison):
    from rich.table import Table

    def h(v: float | None) -> str:
        return "—" if v is None else f"{v:,.1f} h"

    t = Table(title="offline (store) vs online (train.source: vllm)")
    for col in ("mode", "disk", "target forward", "training", "wall-clock"):
        t.add_column(col)
    for m in (c.offline, c.online):
        wall = h(m.total_hours) + ("" if m.overlapped_hours is None else f" (≥ {m.overlapped_hours:,.1f} h overlapped)")
        t.add_row(m.mode, f"{m.disk_bytes / TIB:.2f} TiB", h(m.forward_hours), h(m.train_hours), wall)
    return t
