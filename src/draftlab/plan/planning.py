"""The cost model behind `draftlab plan`: bytes on disk, packed steps, wall-clock and GPU-hours,
each figure with where it came from, and the warnings that catch plans which waste compute.

    store      tokens × (4 × H × dtype + 8 [+ 4 fp8 scale]) + files × header  (draftlab.store.layout)
    steps      speculators' own packing sampler (draftlab.plan.steps), exact from per-sample
               lengths; from counts alone, a range over stated length distributions
    wall-clock draftlab.plan.costmodel (the one the sweep and the ETA use): start-up + steps × s/step
               + boundaries × s/epoch, from a calibration or finished run in MLflow, or a
               stated tokens/s; another GPU count from the nearest one, s/step held
    GPU-hours  wall-clock × n

`plan_for` is `draftlab plan`: it gathers the inputs (draftlab.plan.inputs) and makes the plan.
Nothing here imports torch at module level; `plan_table` needs rich (imported inside).
"""

from __future__ import annotations

import shutil
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import NamedTuple, Sequence

from draftlab.plan import costmodel, modes
from draftlab.plan.steps import CENTRAL_SIGMA, LENGTH_SIGMAS, StepEstimate, plan_from_counts, plan_from_lengths
from draftlab.store import layout as store
from draftlab.store.hidden_states import read_dtype

DEFAULT_GPU_COUNTS = (1, 2, 4, 8)
SAFETENSORS_HEADER_BYTES = 168  # measured: 8-byte length + JSON header of hs_<i> ([T, 4, H] + [T])
CONTAINER_DEFAULT_SHM_BYTES = 64 * 2**20  # docker's default --shm-size (64m)
NOT_SHARDED_RATIO = 1.5  # observed steps/epoch this far above the sharded prediction = ranks repeat data
# What one packed row of speculators' CollateFn holds per token besides hidden states:
# input_ids, position_ids, document_ids (int64) and loss_mask (int64 from a torch-format dataset).
COLLATE_INDEX_BYTES_PER_TOKEN = 4 * 8


class PlanWarning(NamedTuple):
    code: str  # not-sharded | lr-not-scaled | disk-too-small | shm-too-small | samples-truncated
    message: str

    def __str__(self) -> str:
        return f"{self.code}: {self.message}"


@dataclass(frozen=True)
class Throughput:
    """Real (unpadded) tokens per second over all ranks at `gpus` GPUs, as a user states it."""

    gpus: int
    tokens_per_s: float
    source: str = "stated"


def tokens_per_s_from_steps(steps_per_s: float, world_size: int, tokens_per_rank_step: float) -> float:
    """E.g. the reference run: 1.4 steps/s × 4 ranks × 2,353 tokens per rank-step ≈ 13.2 k tokens/s."""
    return steps_per_s * world_size * tokens_per_rank_step


# ---------------------------------------------------------------- bytes


def store_bytes(num_tokens: int, num_samples: int, hidden_size: int, dtype: str = "bfloat16",
                header_bytes: int = SAFETENSORS_HEADER_BYTES) -> int:
    """Hidden-state store on disk: payload per token (store.bytes_per_token) + one header per file."""
    return num_tokens * store.bytes_per_token(hidden_size, dtype) + num_samples * header_bytes


def batch_bytes(total_seq_len: int, hidden_size: int, dtype: str = "bfloat16") -> int:
    """One packed row as speculators' CollateFn builds it: hidden_states [L, 3H] + verifier_last
    [L, H] in `dtype`, plus the int64 index tensors (~470 MB at L = 8,192, H = 7,168, bf16)."""
    return total_seq_len * (4 * hidden_size * store.DTYPE_BYTES[read_dtype(dtype)]
                            + COLLATE_INDEX_BYTES_PER_TOKEN)


def loader_inflight_bytes(total_seq_len: int, hidden_size: int, dtype: str, num_workers: int,
                          prefetch_factor: int) -> int:
    """Shared memory one rank's DataLoader keeps in flight: workers × prefetch × batch bytes
    (0 with num_workers = 0: batches are built in the rank and never cross processes)."""
    return num_workers * prefetch_factor * batch_bytes(total_seq_len, hidden_size, dtype) if num_workers else 0


def disk_free_bytes(path: Path) -> int:
    """Free bytes on the filesystem that will hold `path` (its nearest existing ancestor)."""
    p = Path(path).resolve()
    while not p.exists():
        p = p.parent
    return shutil.disk_usage(p).free


def shm_free_bytes(path: Path = Path("/dev/shm")) -> int | None:
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


# ---------------------------------------------------------------- the plan


@dataclass(frozen=True)
class Scenario:
    """What is trained, independent of the host: the dataset, the draft's input and packing."""

    num_samples: int  # rows of the prepared dataset (train + val)
    num_tokens: int
    hidden_size: int
    dtype: str = "bfloat16"
    train_ratio: float = 0.9
    total_seq_len: int = 8192
    epochs: int = 1
    world_size: int = 1
    seed: int = 0
    lr_scaling: str = "none"
    lr_base_gpus: int = 1
    num_workers: int = 12
    prefetch_factor: int = 4
    max_sample_len: int | None = None  # longest sample, if known (counts only)

    @classmethod
    def from_params(cls, params, *, num_samples: int, num_tokens: int, hidden_size: int, **overrides) -> Scenario:
        t = params.train
        fields = dict(num_samples=num_samples, num_tokens=num_tokens, hidden_size=hidden_size,
                      dtype=params.extract.dtype, train_ratio=params.data.train_ratio,
                      total_seq_len=t.total_seq_len, epochs=t.epochs, world_size=t.world_size(), seed=t.seed,
                      lr_scaling=t.lr_scaling, lr_base_gpus=t.lr_base_gpus, num_workers=t.num_workers,
                      prefetch_factor=t.prefetch_factor)
        return cls(**{**fields, **overrides})

    @property
    def train_samples(self) -> int:
        return int(self.num_samples * self.train_ratio)  # speculators' split: row order, floor

    @property
    def train_tokens(self) -> int:
        return round(self.num_tokens * self.train_samples / self.num_samples)


@dataclass(frozen=True)
class GpuRow:
    gpus: int
    steps_per_epoch: tuple[int, int]
    total_steps: tuple[int, int]
    tokens_per_s: float | None  # real tokens per second while stepping
    throughput_source: str  # which calibration / run / statement, at which GPU count, and its age
    wall_clock_s: float | None  # costmodel: start-up + central steps × s/step + boundaries × s/epoch
    gpu_hours: float | None
    startup_s: float | None = None
    step_s: float | None = None
    epoch_s: float | None = None


@dataclass(frozen=True)
class Plan:
    scenario: Scenario
    store_bytes: int
    store_basis: str
    extraction_hours: float | None
    extraction_source: str
    steps: StepEstimate  # at the scenario's world size
    rows: list[GpuRow]
    loader_inflight_bytes: int
    shm_free_bytes: int | None
    disk_free_bytes: int | None
    warnings: list[PlanWarning]
    modes: modes.ModeComparison | None = None  # offline (store) vs online (train.source: vllm)

    def to_json(self) -> dict:
        out = asdict(self)
        out["warnings"] = [w._asdict() for w in self.warnings]
        out["train_samples"] = self.scenario.train_samples
        out["train_tokens"] = self.scenario.train_tokens
        return out


def make_plan(scenario: Scenario, *, lengths: Sequence[int] | None = None,
              gpu_counts: Sequence[int] = DEFAULT_GPU_COUNTS, points: dict[int, costmodel.Point] | None = None,
              stated: Throughput | None = None, extract_tokens_per_s: Throughput | None = None,
              shm_bytes: int | None = None, disk_free: int | None = None, sharded: bool = True,
              observed_steps_per_epoch: int | None = None, now: float | None = None) -> Plan:
    """The whole plan. `lengths`: every row's length in dataset order (exact steps), else counts.
    `points`: measured cost-model points (costmodel.points_from_mlflow); `stated`: a tokens/s
    the user states (it replaces a measured point at its GPU count).
    `sharded=False` states that ranks do not shard data (every rank reads everything).
    `extract_tokens_per_s`: a Throughput whose gpus is ignored."""
    s = scenario
    if lengths is not None:
        train = list(lengths)[: s.train_samples]
        n_bytes = store_bytes(int(sum(lengths)), len(lengths), s.hidden_size, s.dtype)
        basis = f"{len(lengths):,} files from the dataset's per-sample lengths"

        def steps_for(w: int, exact: bool) -> StepEstimate:
            return plan_from_lengths(train, total_seq_len=s.total_seq_len, world_size=w, epochs=s.epochs,
                                     seed=s.seed, exact=exact)
    else:
        n_bytes = store_bytes(s.num_tokens, s.num_samples, s.hidden_size, s.dtype)
        basis = f"stated counts: {s.num_samples:,} samples, {s.num_tokens:,} tokens"

        def steps_for(w: int, exact: bool) -> StepEstimate:
            sigmas = LENGTH_SIGMAS if exact else (CENTRAL_SIGMA,)  # other GPU counts: central shape only
            return plan_from_counts(s.train_samples, s.train_tokens, total_seq_len=s.total_seq_len, world_size=w,
                                    epochs=s.epochs, seed=s.seed, max_sample_len=s.max_sample_len, sigmas=sigmas)

    main = steps_for(s.world_size, True)
    estimates = {n: main if n == s.world_size else steps_for(n, False) for n in sorted(set(gpu_counts))}
    points = dict(points or {})
    if stated is not None:
        est = estimates.get(stated.gpus) or steps_for(stated.gpus, False)
        per_step = main.trained_tokens_per_epoch * s.epochs / max(est.central_total_steps, 1)
        points[stated.gpus] = costmodel.stated_point(stated.gpus, stated.tokens_per_s, per_step)
    rows = []
    for n, est in estimates.items():
        found = costmodel.nearest(points, n)
        if found is None:
            rows.append(GpuRow(n, est.steps_per_epoch, est.total_steps, None,
                               "no measurement: run a calibration (train.max_steps), train once, or --tokens-per-s",
                               None, None))
            continue
        p, how = found
        steps = est.central_total_steps
        wall = p.train_s(steps, s.epochs)
        age = "" if p.source.startswith("stated") else f"; {p.age(now)}"
        tps = main.trained_tokens_per_epoch * s.epochs / (steps * p.step_s) if steps and p.step_s else None
        rows.append(GpuRow(n, est.steps_per_epoch, est.total_steps, tps, how + age, wall, wall * n / 3600,
                           p.fixed_s, p.step_s, p.epoch_s))
    extraction_h = s.num_tokens / extract_tokens_per_s.tokens_per_s / 3600 if extract_tokens_per_s else None
    inflight = loader_inflight_bytes(s.total_seq_len, s.hidden_size, s.dtype, s.num_workers, s.prefetch_factor)
    plan = Plan(s, n_bytes, basis, extraction_h,
                extract_tokens_per_s.source if extract_tokens_per_s else "no extraction throughput given",
                main, rows, inflight, shm_bytes, disk_free, [])
    at_world = next((r for r in rows if r.gpus == s.world_size), None)
    plan = replace(plan, modes=modes.compare(
        store_bytes=n_bytes, num_tokens=s.num_tokens, epochs=s.epochs,
        train_tokens_per_epoch=main.trained_tokens_per_epoch,
        steps_per_epoch=max(main.central_total_steps // max(s.epochs, 1), 1),
        train_s=at_world.wall_clock_s if at_world is not None else None,
        forward_tokens_per_s=extract_tokens_per_s.tokens_per_s if extract_tokens_per_s else None))
    plan.warnings.extend(check_plan(plan, sharded=sharded, observed_steps_per_epoch=observed_steps_per_epoch))
    return plan


def check_plan(plan: Plan, *, sharded: bool = True, observed_steps_per_epoch: int | None = None) -> list[PlanWarning]:
    """Plans that waste compute or cannot run, one warning each."""
    s, out = plan.scenario, []
    w = s.world_size
    if w > 1:
        predicted = plan.steps.steps_per_epoch[1]
        if not sharded:
            out.append(PlanWarning("not-sharded", f"every one of the {w} ranks reads the whole train split: "
                                   f"{w}× the compute for the same epochs; let the packing sampler shard it"))
        elif observed_steps_per_epoch and observed_steps_per_epoch > NOT_SHARDED_RATIO * predicted:
            out.append(PlanWarning("not-sharded", f"{observed_steps_per_epoch:,} steps per epoch observed vs "
                                   f"≤ {predicted:,} predicted for {w} ranks sharding {s.train_samples:,} samples "
                                   f"({observed_steps_per_epoch / predicted:.1f}×): ranks are repeating data"))
    if w != s.lr_base_gpus and s.lr_scaling == "none":
        out.append(PlanWarning("lr-not-scaled", f"the effective batch is {w} × {s.total_seq_len:,} tokens, "
                               f"{w / s.lr_base_gpus:g}× the batch lr was tuned at ({s.lr_base_gpus} rank(s)), and "
                               "lr is unchanged; set train.lr_scaling to sqrt or linear"))
    if plan.disk_free_bytes is not None and plan.store_bytes > plan.disk_free_bytes:
        out.append(PlanWarning("disk-too-small", f"the store needs {plan.store_bytes / 2**40:.2f} TiB, the disk has "
                               f"{plan.disk_free_bytes / 2**40:.2f} TiB free; move it or add space"))
    if plan.shm_free_bytes is not None and plan.loader_inflight_bytes > plan.shm_free_bytes:
        per_batch = batch_bytes(s.total_seq_len, s.hidden_size, s.dtype)
        fits = max(plan.shm_free_bytes // per_batch, 0)
        out.append(PlanWarning("shm-too-small", f"{s.num_workers} workers × prefetch {s.prefetch_factor} × "
                               f"{per_batch / 1e6:,.0f} MB per batch = {plan.loader_inflight_bytes / 1e9:.1f} GB of "
                               f"shared memory in flight per rank, /dev/shm has {plan.shm_free_bytes / 1e6:,.0f} MB "
                               f"free (room for {fits} batch(es)); run docker with --shm-size or lower "
                               "train.num_workers × train.prefetch_factor"))
    if plan.steps.truncated_samples > 0:
        out.append(PlanWarning("samples-truncated", f"{plan.steps.truncated_samples:,} train samples are longer than "
                               f"total_seq_len {s.total_seq_len:,}; the collate cuts them"))
    return out


def plan_for(params, *, target_dir: Path, data_dir: Path, store_dir: Path, gpu_counts: Sequence[int],
             samples: int | None = None, tokens: int | None = None, hidden_size: int | None = None,
             tokens_per_s: float | None = None, at_gpus: int = 1, extract_tokens_per_s: float | None = None,
             shm_bytes: int | None = None) -> tuple[Plan, str]:
    """`draftlab plan`: the plan for these params on this host, and where its wall-clock
    measurements came from. Stated counts (`samples`, `tokens`) stand in for a dataset not
    prepared yet; stated throughputs for measurements not made yet."""
    from draftlab.plan import inputs as plan_inputs

    stated = plan_inputs.stated_counts(samples, tokens)
    lengths = None if stated else plan_inputs.dataset_lengths(data_dir)
    num_samples, num_tokens = stated or (len(lengths), int(sum(lengths)))
    h, _ = plan_inputs.hidden_size(params, target_dir, store_dir, hidden_size)
    scenario = Scenario.from_params(params, num_samples=num_samples, num_tokens=num_tokens, hidden_size=h)
    points, note = plan_inputs.measured_points(params, store_dir, target_dir)
    existing = store.read_manifest(store_dir).total_bytes if store.has_manifest(store_dir) else 0  # a re-extract frees it
    plan = make_plan(
        scenario, lengths=lengths, gpu_counts=gpu_counts, points=points,
        stated=Throughput(at_gpus, tokens_per_s) if tokens_per_s else None,
        extract_tokens_per_s=Throughput(1, extract_tokens_per_s, "stated") if extract_tokens_per_s else None,
        # online (train.source: vllm) writes no store: no disk to check it against
        disk_free=None if params.train.source == "vllm" else
        disk_free_bytes(store_dir if store_dir.exists() else Path(".")) + existing,
        shm_bytes=shm_bytes if shm_bytes is not None else shm_free_bytes(),
    )
    return plan, note


# ---------------------------------------------------------------- the reference run


@dataclass(frozen=True)
class ReferenceRun:
    unsharded_steps: int
    unsharded_hours: float
    tokens_per_s: float
    sharded_hours: float
    waste_factor: float


def reference_run_hours(*, train_samples: int, epochs: int, steps_per_s: float, world_size: int,
                        tokens_per_rank_step: float) -> ReferenceRun:
    """The Kimi-K2.5 reference run: one sample per rank-step, every rank stepping through the
    whole train split (35,446 × 5 = 177,230 steps at 1.4 steps/s ≈ 35 h), against the same
    throughput spent on disjoint shards (5 epochs of the split once ≈ 8.8 h)."""
    steps = train_samples * epochs
    tps = tokens_per_s_from_steps(steps_per_s, world_size, tokens_per_rank_step)
    sharded_s = epochs * train_samples * tokens_per_rank_step / tps
    return ReferenceRun(steps, steps / steps_per_s / 3600, tps, sharded_s / 3600, (steps / steps_per_s) / sharded_s)


# ---------------------------------------------------------------- presentation


def _hours(seconds: float | None) -> str:
    if seconds is None:
        return "—"
    return f"{seconds / 3600:,.1f} h" if seconds >= 3600 else f"{seconds:,.0f} s"


def _range(r: tuple[int, int]) -> str:
    lo, hi = sorted(r)
    return f"{lo:,}" if lo == hi else f"{lo:,}–{hi:,}"


def plan_table(plan: Plan):
    """Rich renderables: the figures with their sources, the per-GPU-count table, warnings."""
    from rich.console import Group
    from rich.table import Table

    s, st = plan.scenario, plan.steps
    facts = Table(title="plan", show_header=False)
    facts.add_row("dataset", f"{s.num_samples:,} samples, {s.num_tokens:,} tokens; train split {s.train_samples:,} "
                  f"({s.train_ratio:g}), {s.train_tokens:,} tokens")
    facts.add_row("hidden-state store", f"{plan.store_bytes:.3e} bytes = {plan.store_bytes / 2**40:.2f} TiB "
                  f"(H = {s.hidden_size:,}, {s.dtype}; {plan.store_basis})")
    facts.add_row("extraction", f"{_hours(plan.extraction_hours * 3600 if plan.extraction_hours else None)} "
                  f"({plan.extraction_source})")
    facts.add_row(f"steps per epoch at {s.world_size} rank(s)", f"{_range(st.steps_per_epoch)} (any packing: "
                  f"{_range(st.bounds_per_epoch)})")
    facts.add_row("total steps",
                  f"{_range(st.total_steps)} over {s.epochs} epoch(s); central {st.central_total_steps:,}")
    facts.add_row("steps basis", st.basis)
    facts.add_row("loader shared memory per rank", f"{plan.loader_inflight_bytes / 1e9:.2f} GB "
                  f"({s.num_workers} workers × prefetch {s.prefetch_factor})")
    rows = Table(title=f"wall-clock for {s.epochs} epoch(s) of {st.trained_tokens_per_epoch:,} trained tokens")
    for col in ("GPUs", "steps/epoch", "total steps", "tokens/s", "start-up + s/step + s/epoch", "wall-clock",
                "GPU-hours", "from"):
        rows.add_column(col)
    for r in plan.rows:
        model = "—" if r.step_s is None else f"{r.startup_s:,.0f} s + {r.step_s:.3g} s + {r.epoch_s:,.1f} s"
        rows.add_row(str(r.gpus), _range(r.steps_per_epoch), _range(r.total_steps),
                     "—" if r.tokens_per_s is None else f"{r.tokens_per_s:,.0f}", model, _hours(r.wall_clock_s),
                     "—" if r.gpu_hours is None else f"{r.gpu_hours:,.1f}", r.throughput_source)
    parts = [facts, rows] + [f"[yellow]warning[/] {w.code}: {w.message}" for w in plan.warnings]
    if plan.modes is not None:
        parts += [modes.modes_table(plan.modes), f"[bold]mode[/]: {plan.modes.verdict}"]
    return Group(*parts)
