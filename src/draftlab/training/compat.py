"""Run speculators' own trainer on CPU (gloo) as well as on CUDA.

speculators 0.9.0's trainer assumes an accelerator in four places, each a name
looked up at call time in one of its modules, so each is replaced there and
nowhere else (torch itself is left alone):

- ``train.cli.maybe_setup_distributed`` calls ``torch.accelerator.set_device_index``
  and picks the backend of the current accelerator -> on CPU: gloo, no device id.
- ``train.cli.Trainer`` moves the model and every batch with ``.to(local_rank)``
  (an int, i.e. ``cuda:<n>``) and autocasts on ``"cuda"`` when there is no
  accelerator -> a subclass that sets the device to ``cpu`` before ``setup_model``.
- ``train.trainer._StepTimer`` calls ``torch.accelerator.synchronize()`` on every
  logged step -> a subclass that only reads the clock.
- ``train.checkpointer.get_current_device`` answers ``"cuda:0"`` without an
  accelerator (used when resuming) -> ``"cpu"``.

:func:`run_trainer` also offers the one seam the trainer lacks: extra handlers on the
``speculators.metrics`` logger, attached right after speculators configures it (its
``dictConfig`` would drop any attached earlier). It exits non-zero when a signal
cut training short (speculators then saves ``<save_path>/interrupted`` and returns
normally, so a lone process would otherwise exit 0).

How a rank reads hidden states (the store's files checked against its manifest, fp8
dequantized) is not here: `draftlab.store.hidden_states` owns it, behind the same version check
(`draftlab.pinned`).

Five observers reach into speculators' internals, so they live here too, each behind the
version check: :func:`record_sampler_batches` (what the packing sampler hands each rank per
epoch, for the sharding check), :func:`metric_flattener` (the trainer's own ``_flatten_dict``
for its nested metric records), :func:`before_checkpoint` (a hook on
``Trainer.maybe_save_checkpoint``), :func:`around_checkpoint` (the same method, for
draftlab.training.checkpoint's atomic saves) and :func:`refuse_non_finite_checkpoint` (the
watch's guard on the same method); and :func:`eagle3_collate`, the trainer's own batch assembly,
which evaluate uses to see exactly the trainer's validation batches. The packing sampler itself is
`draftlab.plan.sampler`'s (the planner needs it without speculators' import).

Two more CPU limits are flags, not patches: FlexAttention has no CPU backward
(``--draft-attn-impl sdpa``) and the fused loss needs Triton
(``--loss-implementation eager``); :func:`run_trainer` refuses a CPU run without them.
On CUDA nothing is patched.

Run one rank:   python -m draftlab.training.rank <speculators train flags>
Run N ranks:    torchrun --nproc-per-node N -m draftlab.training.rank <flags>
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from draftlab.pinned import check_speculators_version

DEVICE_TYPES = ("cpu", "cuda")

_patched_device_type: str | None = None


def default_device_type() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def patch_speculators_for_device(device_type: str) -> None:
    """Make speculators' trainer run on ``device_type``; idempotent, a no-op on CUDA."""
    global _patched_device_type
    if device_type not in DEVICE_TYPES:
        raise ValueError(f"device_type must be one of {DEVICE_TYPES}, got {device_type!r}")
    check_speculators_version()
    if _patched_device_type is not None:
        if _patched_device_type != device_type:
            raise RuntimeError(
                f"speculators is already patched for {_patched_device_type!r}; "
                f"cannot switch this process to {device_type!r}"
            )
        return
    if device_type == "cpu":
        from speculators.train import checkpointer, cli, trainer

        cli.maybe_setup_distributed = _maybe_setup_distributed_on_host
        cli.Trainer = _host_trainer_class()
        trainer._StepTimer = _host_step_timer_class()
        checkpointer.get_current_device = lambda: "cpu"
    _patched_device_type = device_type


def _maybe_setup_distributed_on_host(sp_size: int = 1) -> None:
    """``distributed.maybe_setup_distributed`` with gloo and no device binding.

    Mirrors the stock function line for line apart from the accelerator calls, and
    fills the same module state through its own ``_init_sp_process_groups``.
    """
    import torch.distributed as dist
    from speculators.train import distributed

    if "LOCAL_RANK" not in os.environ:
        distributed.maybe_setup_distributed(sp_size)  # touches no accelerator
        return
    dist.init_process_group("gloo")
    distributed._local_rank = int(os.environ["LOCAL_RANK"])
    distributed._is_distributed = True
    distributed._rank = dist.get_rank()
    distributed._world_size = dist.get_world_size()
    distributed._init_sp_process_groups(distributed._rank, distributed._world_size, sp_size)
    distributed.logger.info(
        f"Started distributed (gloo, cpu) with local_rank={distributed._local_rank}, "
        f"dp_size={distributed._dp_size}, sp_size={distributed._sp_size}",
        extra={"override_rank0_filter": True},
    )


def _host_trainer_class():
    import torch
    from speculators.train.trainer import Trainer

    class HostTrainer(Trainer):
        """The stock Trainer with the model, the batches and autocast on the CPU."""

        def setup_model(self):
            # `local_rank` is only ever the target of `.to()` in Trainer; without an
            # accelerator `device_type` would fall back to "cuda" (autocast disabled,
            # bf16 batches meeting fp32 weights).
            self.local_rank = torch.device("cpu")
            self.device_type = "cpu"
            super().setup_model()

    return HostTrainer


def _host_step_timer_class():
    from speculators.train.trainer import _StepTimer

    class HostStepTimer(_StepTimer):
        """The stock step timer without device synchronisation (CPU ops are synchronous)."""

        def mark(self, name: str) -> None:
            if self.enabled:
                self._marks[name] = time.perf_counter()

        def now(self) -> float | None:
            return time.perf_counter() if self.enabled else None

    return HostStepTimer


def check_config_for_device(cfg, device_type: str) -> None:
    """Raise ValueError when a resolved TrainConfig cannot run on ``device_type``."""
    if device_type != "cpu":
        return
    if cfg.draft.draft_attn_impl == "simple_flex_attention":
        raise ValueError(
            "draft.draft_attn_impl: FlexAttention has no CPU backward; "
            "pass --draft-attn-impl sdpa (or eager) on CPU"
        )
    if cfg.loss.loss_implementation == "fused":
        raise ValueError(
            "loss.loss_implementation: the fused loss needs Triton on a GPU; "
            "pass --loss-implementation eager on CPU"
        )


def run_trainer(
    argv: list[str],
    *,
    device_type: str | None = None,
    metric_handlers: Sequence[logging.Handler] = (),
) -> None:
    """Patch for the device, then run ``speculators train`` with ``argv`` in this process.

    Under torchrun every rank calls this with the same argv. ``metric_handlers`` receive
    every record of the ``speculators.metrics`` logger on this rank (nested dicts; the
    step in ``record.step``, ``record.hparams`` set on the config record).
    """
    device_type = device_type or default_device_type()
    patch_speculators_for_device(device_type)
    from speculators.train import cli
    from speculators.train.config import TrainConfig

    cfg = TrainConfig.resolve(list(argv))
    check_config_for_device(cfg, device_type)
    stock_setup_metric_logger = cli.setup_metric_logger

    def setup_metric_logger(*args, **kwargs):
        stock_setup_metric_logger(*args, **kwargs)
        for handler in metric_handlers:
            logging.getLogger("speculators.metrics").addHandler(handler)

    cli.setup_metric_logger = setup_metric_logger
    interrupted = Path(cfg.trainer.save_path) / "interrupted" / "model.safetensors"
    before = _mtime_ns(interrupted)
    try:
        cli.main(cfg)
    finally:
        cli.setup_metric_logger = stock_setup_metric_logger
    if _mtime_ns(interrupted) not in (None, before):
        raise SystemExit(f"training interrupted by a signal; state saved in {interrupted.parent}")


def _mtime_ns(path: Path) -> int | None:
    # Compared with itself, not with time.time(): file times come from a coarser clock.
    return path.stat().st_mtime_ns if path.exists() else None


# ---------------------------------------------------------------- observers of the trainer's internals


def record_sampler_batches(out: Path) -> None:
    """Append, per epoch, the sample ids speculators' train packing sampler hands this rank to
    ``out`` (jsonl: epoch, rank, steps, ids): wraps ``MultipackDistributedBatchSamplerV2``'s
    ``__init__`` (the trainer builds the train loader's sampler first, the val one second) and
    ``__iter__`` (which draws its batches from ``_generate_batches(self.epoch)``)."""
    check_speculators_version()
    from speculators.train.distributed_batch_sampler import MultipackDistributedBatchSamplerV2 as Sampler

    out.parent.mkdir(parents=True, exist_ok=True)
    stock_init, stock_iter = Sampler.__init__, Sampler.__iter__
    created = []

    def __init__(self, *args, **kwargs):
        stock_init(self, *args, **kwargs)
        self._draftlab_split = "train" if not created else "val"
        created.append(self)

    def __iter__(self):
        batches = self._generate_batches(self.epoch)
        if self._draftlab_split == "train":
            ids = [int(i) for b in batches for i in b]
            from draftlab import appendlog  # a torn last line (kill, full disk) is trimmed first

            appendlog.append(out, {"epoch": self.epoch, "rank": self.rank, "steps": len(batches), "ids": ids})
        return stock_iter(self)

    Sampler.__init__, Sampler.__iter__ = __init__, __iter__


def metric_flattener() -> Callable[[dict], dict]:
    """speculators' own flattening of its nested metric records ({"train": {"loss": x}} →
    {"train/loss": x}), so draftlab's names are the ones its MLflow handler would log."""
    check_speculators_version()
    from speculators.train.logger import _flatten_dict

    return _flatten_dict


def before_checkpoint(hook: Callable[[], None]) -> None:
    """Call ``hook()`` before every ``Trainer.maybe_save_checkpoint`` (the trainer's one place
    that may write a checkpoint, at each epoch's end)."""
    check_speculators_version()
    from speculators.train.trainer import Trainer

    stock = Trainer.maybe_save_checkpoint

    def maybe_save_checkpoint(self, *args, **kwargs):
        hook()
        return stock(self, *args, **kwargs)

    Trainer.maybe_save_checkpoint = maybe_save_checkpoint


def around_checkpoint(around: Callable) -> None:
    """Run every ``Trainer.maybe_save_checkpoint`` that will write as ``around(save, trainer, epoch)``:
    ``save()`` is the stock call, which writes ``<epoch>/`` (model, optimizer, scheduler,
    training_state.json, its ``epoch<k>_*`` link) under ``trainer.checkpointer.path`` as it is
    when ``save()`` runs (draftlab.training.checkpoint points it at a scratch root). A call the
    stock method would skip (``checkpoint_freq`` ≥ 1 between saves, ``save_best``) goes straight
    to it."""
    check_speculators_version()
    from speculators.train.trainer import Trainer

    stock = Trainer.maybe_save_checkpoint

    def maybe_save_checkpoint(self, epoch, *args, **kwargs):
        c = self.config
        skipped = epoch != "interrupted" and (c.save_best or (
            c.checkpoint_freq >= 1 and isinstance(epoch, int) and epoch != 0 and (epoch + 1) % c.checkpoint_freq != 0))
        if skipped:
            return stock(self, epoch, *args, **kwargs)
        return around(lambda: stock(self, epoch, *args, **kwargs), self, epoch)

    Trainer.maybe_save_checkpoint = maybe_save_checkpoint


def refuse_non_finite_checkpoint(refuse: Callable[[], None]) -> None:
    """Before every ``Trainer.maybe_save_checkpoint``, call ``refuse()`` (which raises) when any
    weight of the model is NaN or inf on any rank, so the checkpoint folder keeps the last good
    weights (speculators writes a checkpoint over the one of the same epoch). The flag is
    all-reduced: every rank refuses together, none is left waiting in the save's collectives."""
    check_speculators_version()
    from speculators.train.trainer import Trainer

    stock = Trainer.maybe_save_checkpoint

    def maybe_save_checkpoint(self, *args, **kwargs):
        if not weights_finite(self.model):
            refuse()
        return stock(self, *args, **kwargs)

    Trainer.maybe_save_checkpoint = maybe_save_checkpoint


def weights_finite(model) -> bool:
    """Whether every parameter of ``model`` (this rank's shard under FSDP) is finite on every rank."""
    import torch
    import torch.distributed as dist

    with torch.no_grad():
        local = [p.to_local() if hasattr(p, "to_local") else p for p in model.parameters()]
        ok = all(bool(torch.isfinite(p).all()) for p in local)
        if dist.is_available() and dist.is_initialized():  # on the weights' device: NCCL has no CPU tensors
            flag = torch.tensor([1.0 if ok else 0.0], device=local[0].device if local else "cpu")
            dist.all_reduce(flag, op=dist.ReduceOp.MIN)
            ok = bool(flag.item())
    return ok


def eagle3_collate(total_seq_len: int, hidden_size: int, dtype: str):
    """The trainer's own collate for EAGLE-3 (speculators' ``CollateFn`` with the eagle3
    ``shift_batch`` preprocess): one packed row of ``total_seq_len`` tokens per batch."""
    import torch

    check_speculators_version()
    from speculators.models.eagle3.data import shift_batch
    from speculators.train.data import CollateFn

    return CollateFn(total_seq_len, hidden_size, num_target_layers=3, dtype=getattr(torch, dtype),
                     preprocess=shift_batch)
