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

:func:`verify_hidden_state_reads` wraps the one place speculators reads a stored sample
(``train.data.ArrowDataset.transfer.get_cached``): each ``hs_<i>.safetensors`` is checked
against its manifest entry (size, header, sha256 of the bytes read) before it is decoded, and
the first bad file stops the rank with its name and the repair command
(:class:`HiddenStateFileError`), instead of a ``SafetensorError`` traceback or silent training
on altered data.

Six observers and seams reach into speculators' internals, so they live here too, each behind the
version check: :func:`record_sampler_batches` (what the packing sampler hands each rank per
epoch, for the sharding check), :func:`metric_flattener` (the trainer's own ``_flatten_dict``
for its nested metric records), :func:`before_checkpoint` (a hook on
``Trainer.maybe_save_checkpoint``), :func:`around_checkpoint` (the same method, for
draftlab.training.checkpoint's atomic saves), :func:`refuse_non_finite_checkpoint` (the watch's guard
on the same method) and :func:`sampler_class` (the packing sampler, loaded from
its file alone when speculators is not imported, so ``draftlab plan`` skips the package's
10–25 s import).

Two more CPU limits are flags, not patches: FlexAttention has no CPU backward
(``--draft-attn-impl sdpa``) and the fused loss needs Triton
(``--loss-implementation eager``); :func:`run_trainer` refuses a CPU run without them.
On CUDA nothing is patched.

Run one rank:   python -m draftlab.training.rank <speculators train flags>
Run N ranks:    torchrun --nproc-per-node N -m draftlab.training.rank <flags>
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import json
import logging
import os
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path

SPECULATORS_VERSION = "0.9.0"
DEVICE_TYPES = ("cpu", "cuda")

_patched_device_type: str | None = None


def check_speculators_version() -> None:
    """Raise if the installed speculators is not the version these patches were written for."""
    installed = importlib.metadata.version("speculators")
    if installed != SPECULATORS_VERSION:
        raise RuntimeError(
            f"draftlab.training.compat was written for speculators {SPECULATORS_VERSION}, but "
            f"{installed} is installed: re-read its trainer for accelerator assumptions, "
            "update the patches and tests/unit/test_compat.py, then SPECULATORS_VERSION."
        )


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


@functools.cache
def _standalone(submodule: str):
    spec = importlib.util.find_spec("speculators")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("speculators is not installed")
    path = Path(list(spec.submodule_search_locations)[0], *submodule.split(".")).with_suffix(".py")
    mod_spec = importlib.util.spec_from_file_location(f"draftlab._speculators_{submodule.replace('.', '_')}", path)
    module = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(module)
    return module


def speculators_module(submodule: str):
    """`speculators.<submodule>` (e.g. "train.distributed_batch_sampler"): the imported module when
    speculators is loaded, else the same file executed on its own. Importing the package runs its
    `__init__` (every model, transformers: 9 s of a `draftlab train` launcher's start-up on a
    loaded 2-core VM); the launcher and `plan` need only the packing sampler and the vocab
    mapping, whose files import nothing of speculators (tests/unit/test_compat.py pins that)."""
    check_speculators_version()
    return sys.modules.get(f"speculators.{submodule}") or _standalone(submodule)


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


def _standalone_sampler_module():
    return _standalone("train.distributed_batch_sampler")  # imports only torch, numpy and the stdlib


def sampler_class():
    """speculators' MultipackDistributedBatchSamplerV2: the imported one if speculators is
    loaded, else the same file executed alone (skipping the package's 10–25 s import)."""
    check_speculators_version()
    loaded = sys.modules.get("speculators.train.distributed_batch_sampler")
    return (loaded or _standalone_sampler_module()).MultipackDistributedBatchSamplerV2


def epoch_batches(lengths: Sequence[int], *, total_seq_len: int, world_size: int, seed: int, epoch: int = 0) -> int:
    """Global optimizer steps of one epoch = rank 0's batches from the packing sampler (every
    rank has as many)."""
    with warnings.catch_warnings():  # its "samples longer than batch_max_length" note: the plan warns itself
        warnings.simplefilter("ignore", UserWarning)
        sampler = sampler_class()(batch_max_length=total_seq_len, lengths=lengths, num_replicas=world_size,
                                  rank=0, seed=seed)
    sampler.set_epoch(epoch)
    return len(sampler)


class HiddenStateFileError(RuntimeError):
    """A stored hidden-state file disagrees with the store's manifest; the message names it."""


class VerifiedTransfer:
    """Wraps a hidden-states transfer: every file read is checked against the manifest first.

    For speculators' ``FileTransfer`` and hs_connectors' ``FP8Transfer`` the checked bytes are
    decoded in place (``read_file``: the hash and the tensors read one memory map of the file)
    and fp8 is dequantized by ``dequantize_fp8`` (bit-identical to ``FP8Transfer``'s, about a
    third of its CPU on one thread); another transfer is verified, then reads the file itself, and
    so does ``FileTransfer`` for a file already verified. A file whose size and mtime
    were already verified by this process is not re-hashed (epochs reread every file)."""

    def __init__(self, inner, store_dir: Path, records: dict[int, dict], *, full: bool = True):
        self.inner, self.store_dir, self.records, self.full = inner, Path(store_dir), records, full
        self.verified: dict[int, tuple[int, int]] = {}

    def __getattr__(self, name):  # setup(), delete(), get_generated() … stay the stock ones
        if name == "inner" or name.startswith("__"):  # unpickling in a loader worker looks up
            raise AttributeError(name)  # __setstate__ before `inner` exists
        return getattr(self.inner, name)

    def get_cached(self, file_idx: int):
        import hashlib

        from hs_connectors.transfer import FileTransfer, FP8Transfer

        from draftlab.store import layout as store

        path = self.store_dir / store.file_name(file_idx)
        rec = self.records.get(file_idx)
        if rec is None:
            raise HiddenStateFileError(f"{path}: not in {store.manifest_path(self.store_dir)}; {store.REPAIR}")
        try:
            st = path.stat()
        except FileNotFoundError:
            raise HiddenStateFileError(f"{path}: missing; {store.REPAIR}") from None
        known = self.verified.get(file_idx) == (st.st_size, st.st_mtime_ns)
        decodes = type(self.inner) in (FileTransfer, FP8Transfer)
        if known and type(self.inner) is not FP8Transfer:  # verified before: the stock (lazy) read
            return self.inner.get_cached(file_idx)
        buf = read_file(path)
        blob = memoryview(buf.numpy())
        problem = None
        if len(blob) != rec["bytes"]:
            problem = f"truncated or rewritten ({len(blob)} bytes, manifest says {rec['bytes']})"
        else:
            n = int.from_bytes(blob[:8], "little")
            problem = store.header_problem(path, rec, head=bytes(blob[: 8 + min(n, len(blob))]))
        if problem is None and self.full and not known and hashlib.sha256(blob).hexdigest() != rec["sha256"]:
            problem = "corrupt (sha256 differs from the manifest)"
        if problem:
            store.record_bad(self.store_dir, {path.name: problem})  # extract re-hashes it, whatever its mtime
            raise HiddenStateFileError(f"{path}: {problem}; {store.REPAIR}")
        self.verified[file_idx] = (st.st_size, st.st_mtime_ns)
        if not decodes:
            return self.inner.get_cached(file_idx)
        tensors = decode_safetensors(buf)
        if type(self.inner) is FP8Transfer and SCALES_KEY in tensors:
            import torch

            scales = tensors.pop(SCALES_KEY)
            want = getattr(self.inner, "dequantize_dtype", torch.bfloat16)
            tensors["hidden_states"] = dequantize_fp8(tensors["hidden_states"], scales, want)
        return tensors


SCALES_KEY = "hidden_states_scales"  # hs_connectors.fp8_utils.SCALES_KEY (tests pin it)
_SAFETENSORS_DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "F64": "float64",
                       "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8",
                       "BOOL": "bool", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}


def read_file(path: Path):
    """The whole file as a uint8 tensor over a private memory map of it: hashing and decoding
    read the page cache in place, and the collate's copy into the batch is the only copy (as
    with speculators' own lazy `safetensors` read). Copy-on-write, so the tensors are writable
    without ever writing the file."""
    import mmap

    import torch

    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            return torch.empty(0, dtype=torch.uint8)
        mapped = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY)
    return torch.frombuffer(mapped, dtype=torch.uint8)  # keeps the map alive as long as a view


def decode_safetensors(buf) -> dict:
    """A safetensors file's tensors as views of `buf` (uint8, the whole file)."""
    import json

    import torch

    n = int.from_bytes(buf[:8].numpy().tobytes(), "little")
    header = json.loads(buf[8 : 8 + n].numpy().tobytes())
    base, out = 8 + n, {}
    for name, t in header.items():
        if name == "__metadata__":
            continue
        dtype = getattr(torch, _SAFETENSORS_DTYPES[t["dtype"]])
        a, b = t["data_offsets"]
        raw = buf[base + a : base + b]
        size = torch.empty((), dtype=dtype).element_size()
        if (base + a) % size:  # view(dtype) needs an aligned offset; safetensors' writer aligns
            raw = raw.clone()
        out[name] = raw.view(dtype).view(t["shape"])
    return out


# elements per lookup chunk: small enough that a chunk's int32 indices stay in cache, large
# enough that each op's parallel region (torch's intra-op threads) is worth starting
_FP8_LUT_CHUNK = 1 << 22


def dequantize_fp8(fp8_TLH, scales_T11, dtype=None):
    """``hs_connectors.fp8_utils.dequantize_fp8_tensor`` (``fp8.to(dtype) * scale.to(dtype)``),
    bit for bit, for bf16: the 256 fp8 values' bf16 bits by table lookup, in token chunks, then
    one in-place multiply. torch 2.13's CPU fp8 → bf16 cast is scalar; this runs in the loader's
    workers on every file of every epoch. Other dtypes: the stock expression."""
    import torch

    dtype = dtype or torch.bfloat16
    if dtype != torch.bfloat16 or fp8_TLH.dtype != torch.float8_e4m3fn or fp8_TLH.dim() == 0:
        return fp8_TLH.to(dtype) * scales_T11.to(dtype)
    global _FP8_LUT
    if _FP8_LUT is None:
        _FP8_LUT = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).to(torch.bfloat16).view(torch.int16)
    rows = fp8_TLH.shape[0]
    per = fp8_TLH[0].numel() if rows else 0
    chunk = max(1, _FP8_LUT_CHUNK // max(per, 1))  # tokens per chunk
    src = fp8_TLH.contiguous().view(torch.uint8).view(rows, per)
    out = torch.empty((rows, per), dtype=torch.int16)
    idx = torch.empty(min(rows, chunk) * per, dtype=torch.int32)
    for a in range(0, rows, chunk):
        b = min(a + chunk, rows)
        i = idx[: (b - a) * per]
        i.copy_(src[a:b].reshape(-1))
        torch.index_select(_FP8_LUT, 0, i, out=out[a:b].view(-1))
    return out.view(torch.bfloat16).view(fp8_TLH.shape).mul_(scales_T11.to(torch.bfloat16))


_FP8_LUT = None


def verify_hidden_state_reads(store_dir: Path, *, full: bool = True) -> None:
    """Make every ``ArrowDataset`` built from now on read through :class:`VerifiedTransfer`."""
    from speculators.train import data

    check_speculators_version()
    from draftlab.store import layout as store

    records = {f.index: f.model_dump() for f in store.read_manifest(store_dir).files}
    stock_init = data.ArrowDataset.__init__
    if getattr(stock_init, "_draftlab_verified", False):
        return

    def __init__(self, *args, **kwargs):
        stock_init(self, *args, **kwargs)
        self.transfer = VerifiedTransfer(self.transfer, store_dir, records, full=full)

    __init__._draftlab_verified = True
    data.ArrowDataset.__init__ = __init__


def clean_message(err: BaseException) -> str:
    """The one-line message of an error a DataLoader worker re-raised in the rank (torch puts
    the worker's traceback text in front of it)."""
    text = str(err).strip().splitlines()
    last = text[-1] if text else type(err).__name__
    marker = f"{type(err).__name__}: "
    return last.split(marker, 1)[1] if marker in last else last
