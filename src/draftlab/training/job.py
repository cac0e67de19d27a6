"""A training job's pieces that the launcher (stages/train.py) and a joining node (training/nodes.py)
both need: the run key, the exact step accounting, the checks before launch, the vocabulary maps,
the trainer's argv and the ranks' command and environment (`rank_command`, built once for both).
Nothing here starts a process or an MLflow run.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from draftlab.errors import UserError
from draftlab.params import CPU_TRAIN_FLAGS, Params, ParamsError, reserved_flag
from draftlab.plan import accounting as acc
from draftlab.rundir import Manifest, RunDir
from draftlab.store import layout as store
from draftlab.store.hidden_states import HiddenStateSource, source_for


class TrainingFailed(UserError, RuntimeError):
    """Training ran but did not finish correctly; the message says what differed."""

    exit_code = 1


class TrainingDiverged(TrainingFailed):
    """A NaN or inf loss stopped the run (train.watch); the last good checkpoint is kept."""

    exit_code = 3


class TrainingStopped(TrainingFailed):
    """The convergence watch stopped the run on a trend in train.watch.stop_on (stalled, diverging)."""

    exit_code = 5


def failed_error(failure) -> type[TrainingFailed]:
    """The error a failed training raises, by the rank's failure record (rundir.Failure or None)."""
    reason = failure.reason if failure is not None else None
    return {"diverged": TrainingDiverged, "stalled": TrainingStopped, "diverging": TrainingStopped}.get(
        reason, TrainingFailed)


@dataclass(frozen=True)
class TrainResult:
    run_id: str
    out_dir: Path
    checkpoint: Path
    total_steps: int
    wall_clock_s: float


def resolve_device(params: Params) -> str:
    if params.train.device != "auto":
        return params.train.device
    import importlib.metadata as md

    if md.version("torch").endswith("+cpu"):
        return "cpu"  # a CPU build of torch: no need to import it (about a second) to know
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def run_key(params: Params, manifest_sha: str, data_dir: Path) -> str:
    """What a run folder's checkpoints depend on: resuming across a change would be wrong."""
    from draftlab.plan.cache import dataset_key

    # verify_reads and the watch change what is checked, not what is trained, and the rendezvous's address and
    # this node's rank where it runs: a run folder stays resumable across them
    # (and an online source's server address: where, not what)
    fields = {"train": params.train.model_dump(exclude={"verify_reads", "node_rank", "rdzv_endpoint", "watch",
                                                        "vllm_url"}),
              "data": params.data.model_dump(),
              "store": manifest_sha, "dataset": dataset_key(data_dir)}
    if params.target.revision:  # the verifier the trainer loads (only when pinned: other keys stay as they were)
        fields["target_revision"] = params.target.revision
    return store.store_key(fields)


def train_split(data_dir: Path, train_ratio: float) -> tuple[list[int], int]:
    """Lengths of the train split (speculators' row-order split) and its loss-masked tokens
    (read once per dataset: draftlab.plan.cache)."""
    from draftlab.plan import cache

    split = cache.split(data_dir, train_ratio)
    return split["train_lengths"], split["loss_tokens"]


def plan(params: Params, data_dir: Path) -> tuple[acc.Accounting, list[int]]:
    """Exact accounting and the real tokens of every global step, computed once per dataset and
    sampler settings (draftlab.plan.cache)."""
    from dataclasses import asdict

    from draftlab.plan import cache

    t = params.train
    key = cache.plan_key(data_dir, params.data.train_ratio, {
        "total_seq_len": t.total_seq_len, "world_size": t.world_size(), "seed": t.seed, "epochs": t.epochs,
        "max_steps": t.max_steps})
    if (hit := cache.read("plan", key)) is not None:
        epochs = [acc.EpochPlan(**e) for e in hit["accounting"].pop("epochs")]
        return acc.Accounting(**hit["accounting"], epochs=epochs), hit["step_tokens"]
    a, step_tokens = _plan(params, data_dir)
    cache.write("plan", key, {"accounting": asdict(a), "step_tokens": step_tokens})
    return a, step_tokens


def _plan(params: Params, data_dir: Path) -> tuple[acc.Accounting, list[int]]:
    lengths, loss_tokens = train_split(data_dir, params.data.train_ratio)
    t = params.train
    # the sampler runs once per (epoch, rank): at 37 k samples each run takes about a second
    batches = [[acc.rank_batches(lengths, total_seq_len=t.total_seq_len, world_size=t.world_size(),
                                 rank=r, seed=t.seed, epoch=epoch) for r in range(t.world_size())]
               for epoch in range(t.epochs)]
    a = acc.plan_epochs(lengths, loss_tokens=loss_tokens, total_seq_len=t.total_seq_len, world_size=t.world_size(),
                        epochs=t.epochs, seed=t.seed, batches=batches).limited(t.max_steps)
    clipped = [min(n, t.total_seq_len) for n in lengths]
    step_tokens: list[int] = []
    for epoch in range(t.epochs):
        per_rank = batches[epoch]
        trained = a.trained_steps[epoch] if a.max_steps is not None else len(per_rank[0])
        for s in range(trained):
            step_tokens.append(sum(clipped[i] for r in per_rank for i in r[s]))
    return a, step_tokens


def check_seq_len(params: Params, data_dir: Path) -> None:
    """A packing row shorter than a sample truncates it (speculators only warns): refused, with
    how many train samples it would cut, before any folder is set aside or run started."""
    lengths, _ = train_split(data_dir, params.data.train_ratio)
    longest, n = max(lengths, default=0), params.train.total_seq_len
    if n < longest:
        cut = sum(1 for x in lengths if x > n)
        raise ParamsError(
            f"train.total_seq_len: {n} would truncate {cut} of {len(lengths)} train samples (the longest has "
            f"{longest} tokens); set it to at least {longest}, or lower prepare.max_seq_len"
        )


def accounting_table(a: acc.Accounting, params: Params, eta_s: float | None = None):
    from rich.table import Table

    t = Table(title="step accounting (global optimizer steps)", show_header=False)
    t.add_row("world size (data-parallel ranks)", f"{a.world_size} = {params.train.gpus} per node × {params.train.nnodes} node(s)")
    t.add_row("train samples / tokens", f"{a.train_samples:,} / {a.train_tokens:,} ({a.train_loss_tokens:,} loss-masked)")
    t.add_row("packing", f"batch_size 1 per rank = one row of ≤ {a.total_seq_len:,} tokens")
    t.add_row("tokens per step (capacity)", f"{a.tokens_per_step:,} = {a.world_size} × {a.total_seq_len:,}")
    t.add_row("steps per epoch", ", ".join(str(e.steps) for e in a.epochs))
    t.add_row("total steps", f"{a.total_steps:,}" + ("" if a.max_steps is None else
              f" (calibration: --max-steps {a.max_steps}; per epoch {', '.join(map(str, a.trained_steps))})"))
    t.add_row("dropped samples per epoch", ", ".join(str(d) for d in a.dropped_samples))
    t.add_row("lr", f"{params.train.resolved_lr():.3g} (base {params.train.lr:g} at {params.train.lr_base_gpus} rank(s), rule {params.train.lr_scaling})")
    if eta_s is not None:
        t.add_row("ETA", f"{eta_s / 3600:.2f} h")
    return t


def _vocab_key(params: Params, target_dir: Path, data_dir: Path | None) -> str | None:
    """The vocabulary maps' cache key (draftlab.plan.cache): the token counts, the target's
    config.json and the draft's vocabulary size; None for a target that is not a local folder."""
    from draftlab.models import resolve
    from draftlab.plan import cache
    from draftlab.util import sha256_file

    config = Path(resolve(params, target_dir)) / "config.json"
    if not config.is_file():
        return None
    fields = {"config": sha256_file(config), "draft_vocab_size": params.train.draft_vocab_size}
    if data_dir is not None:
        fields["token_freq"] = sha256_file(Path(data_dir) / "token_freq.pt")
    return cache.key_of("vocab", fields)


def _vocab_sizes(params: Params, target_dir: Path) -> tuple[int, int]:
    """(min(train.draft_vocab_size, the target's vocabulary), the target's vocabulary), read once
    per target config."""
    from draftlab.plan import cache

    key = _vocab_key(params, target_dir, None)
    if key is not None and (hit := cache.read("vocab", key)) is not None:
        return hit["size"], hit["vocab"]
    from transformers import AutoConfig

    from draftlab.models import resolve, revision_kwargs

    vocab = AutoConfig.from_pretrained(resolve(params, target_dir), **revision_kwargs(params)).vocab_size
    size = min(params.train.draft_vocab_size, vocab)
    if key is not None:
        cache.write("vocab", key, {"size": size, "vocab": vocab})
    return size, vocab


def vocab_paths(params: Params, target_dir: Path, out_dir: Path) -> tuple[Path, Path]:
    """Where vocab_mappings writes d2t/t2d (another node reads them from the shared folder)."""
    size, _ = _vocab_sizes(params, target_dir)
    return out_dir / f"d2t-{size}.npy", out_dir / f"t2d-{size}.npy"


def vocab_mappings(params: Params, target_dir: Path, data_dir: Path, out_dir: Path) -> tuple[Path, Path]:
    """d2t/t2d written into the run folder (speculators would cache them in the dataset folder,
    which is another stage's output); built once per token counts and target (draftlab.plan.cache)."""
    import shutil

    from draftlab.plan import cache
    from draftlab.util import write_bytes_atomic

    d2t_path, t2d_path = vocab_paths(params, target_dir, out_dir)
    key = _vocab_key(params, target_dir, data_dir)
    cached = [cache.cache_dir() / "vocab" / f"{key}-{p.name}" for p in (d2t_path, t2d_path)] if key else []
    if cached and all(c.is_file() for c in cached):
        for c, p in zip(cached, (d2t_path, t2d_path)):
            shutil.copyfile(c, p)
        return d2t_path, t2d_path
    import numpy as np
    import torch

    from draftlab.pinned import speculators_module

    build_vocab_mappings_from_distribution = speculators_module(
        "train.vocab_mapping").build_vocab_mappings_from_distribution

    size, vocab = _vocab_sizes(params, target_dir)
    freq = torch.load(data_dir / "token_freq.pt", weights_only=True)
    d2t, t2d = build_vocab_mappings_from_distribution(freq, size, vocab)
    np.save(d2t_path, d2t.cpu().numpy())
    np.save(t2d_path, t2d.cpu().numpy())
    for c, p in zip(cached, (d2t_path, t2d_path)):
        try:
            c.parent.mkdir(parents=True, exist_ok=True)
            write_bytes_atomic(c, p.read_bytes())
        except OSError:  # a cache that cannot be written: the next run builds them again
            pass
    return d2t_path, t2d_path



def speculators_argv(params: Params, *, verifier: str, data_dir: Path, source: HiddenStateSource, out_dir: Path,
                     layer_ids: list[int], total_steps: int, d2t: Path, t2d: Path, device: str) -> list[str]:
    """The trainer's flags; where its hidden states come from is the source's to say."""
    t = params.train
    argv = [
        "--verifier-name-or-path", verifier,
        "--data-path", str(data_dir),
        *source.trainer_args(),
        "--save-path", str(out_dir / "checkpoints"),
        "--log-dir", str(out_dir / "logs"),
        "--epochs", str(t.epochs),
        "--lr", repr(t.resolved_lr()),
        "--optimizer", t.optimizer,
        "--scheduler-type", t.scheduler,
        "--scheduler-warmup-steps", str(t.warmup_steps),
        "--scheduler-total-steps", str(total_steps),
        "--total-seq-len", str(t.total_seq_len),
        "--num-workers", str(t.num_workers),
        "--prefetch-factor", str(t.prefetch_factor),
        "--ttt-steps", str(t.ttt_steps),
        "--draft-vocab-size", str(t.draft_vocab_size),
        "--num-layers", str(t.draft_layers),
        "--seed", str(t.seed),
        "--checkpoint-freq", repr(t.checkpoint_freq),
        "--train-data-ratio", repr(params.data.train_ratio),
        "--hidden-states-dtype", t.hidden_states_dtype,
        "--target-layer-ids", *map(str, layer_ids),
        "--d2t-path", str(d2t),
        "--t2d-path", str(t2d),
    ]  # fmt: skip
    if device == "cpu":
        check_cpu_flags(params)
        argv += ["--draft-attn-impl", "sdpa", "--loss-implementation", "eager"]
    if t.max_steps is not None:
        argv += ["--max-steps", str(t.max_steps)]
    if t.sharding == "fsdp":
        argv.append("--fsdp-shard")
    return argv + list(t.extra_args)


def check_cpu_flags(params: Params) -> None:
    """On a CPU run draftlab sets the attention and loss kernels itself: extra_args may not."""
    if hit := reserved_flag(params.train.extra_args, CPU_TRAIN_FLAGS):
        raise ParamsError(f"train.extra_args: {hit[0]} sets {hit[1]}, which a CPU run sets itself (sdpa "
                          "attention, eager loss: the GPU kernels have no CPU backward); remove it")


def rank_command(params: Params, *, target_dir: Path, data_dir: Path, source: HiddenStateSource, out_dir: Path,
                 layer_ids: list[int], total_steps: int, device: str,
                 run_id: str | None = None) -> tuple[list[str], dict[str, str]]:
    """The torchrun command and environment of this node's ranks, the same for node 0's launcher
    and a joining node (training.nodes): speculators' flags, the run folder, this node's rank, the
    tracking store; `run_id` (node 0's) as MLFLOW_RUN_ID, else none (a rank that writes reads it
    from node 0's run.json). The vocabulary maps are node 0's (`vocab_mappings`, before this)."""
    from draftlab import threads, tracking
    from draftlab.models import resolve
    from draftlab.training import launch

    t = params.train
    d2t, t2d = vocab_paths(params, target_dir, out_dir)
    argv = speculators_argv(params, verifier=resolve(params, target_dir), data_dir=data_dir, source=source,
                            out_dir=out_dir, layer_ids=layer_ids, total_steps=total_steps, d2t=d2t, t2d=t2d,
                            device=device)
    # the ranks on this node split this process's threads (torchrun would give each 1, or torch
    # each one per core of the machine); everything else a rank needs is in the run folder's
    # plan.json (rundir.RankPlan)
    env = dict(threads.thread_env(t.gpus), DRAFTLAB_RUN_DIR=str(out_dir), DRAFTLAB_NODE_RANK=str(t.node_rank),
               DRAFTLAB_PARENT_CMD="draftlab.training.torchrun", MLFLOW_TRACKING_URI=tracking.tracking_uri(),
               **tracking.RANK_HTTP_ENV)
    if run_id is not None:
        env["MLFLOW_RUN_ID"] = run_id
    else:
        env.pop("MLFLOW_RUN_ID", None)
    return launch.torchrun_cmd(params, argv), env


def check_layer_ids(params: Params, manifest: Manifest, store_dir: Path | None = None) -> list[int]:
    """The aux layers come from the store (train.extra_args cannot name others: params refuses
    `--target-layer-ids` there)."""
    return manifest.layer_ids


def observed_samples(out_dir: Path) -> dict[int, dict[int, list[int]]]:
    """What the ranks' samplers handed out, per (epoch, rank). After a mid-epoch resume the
    sampler hands out only the remaining batches, so records of one epoch are merged."""
    from draftlab import appendlog

    seen: dict[int, dict[int, list[int]]] = {}
    for path in sorted(RunDir(out_dir).samples_dir.glob("rank*.jsonl")):
        for line in appendlog.complete_lines(path):  # a partial last line is a record never made
            rec = json.loads(line)
            ids = seen.setdefault(rec["epoch"], {}).setdefault(rec["rank"], [])
            ids.extend(i for i in rec["ids"] if i not in set(ids))
    return seen


def last_global_step(checkpoints: Path) -> int | None:
    """Where a resume starts: the newest complete checkpoint's global step (a torn one never counts)."""
    from draftlab.training import checkpoint

    return checkpoint.last_global_step(checkpoints)


def preflight(params: Params, data_dir: Path, store_dir: Path | None, console, *, target_dir: Path,
              out_dir: Path) -> tuple[list[int], HiddenStateSource, str]:
    """Every check before anything is written or launched: (layer ids, hidden-state source, device)."""
    source = source_for(params, store_dir=store_dir, target_dir=target_dir, out_dir=out_dir)
    source.check()
    if params.train.source == "store":
        manifest = store.read_manifest(store_dir)
        store_dtype = manifest.dtype
        if store_dtype == store.FP8:
            from draftlab.store.capture import check_dtype

            check_dtype(store_dtype)
        quick = store.verify(store_dir, full=False, record=True)
        if quick:
            raise ParamsError(f"{quick[0]} ({len(quick)} bad file(s), `draftlab verify` lists them); {store.REPAIR}")
    check_seq_len(params, data_dir)
    device = resolve_device(params)
    if device == "cpu":
        check_cpu_flags(params)
    if device == "cpu" and params.train.sharding == "fsdp" and params.train.gpus == 1:
        console.print("[yellow]train[/]: FSDP over one rank shards nothing")
    return source.layer_ids, source, device
