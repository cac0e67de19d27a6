"""The bottleneck verdict of a run, from its telemetry (draftlab.observe.telemetry) and step records.

`classify(window)` names what limited a window of a run: `data-bound (disk)`, `data-bound
(CPU)`, `compute-bound`, `communication-bound` or `straggler-bound`, with the figures that
decided it and a remedy. A loader that waits on something other than a disk and its decode (a
live vLLM computing each sample: the online source) is named by the hidden-state source itself
(`HiddenStateSource.describe_wait`: anything with `label`, `why` and `remedy`, passed in as
`wait`): they replace the disk/CPU ones, so a new source changes no module here.
`verdict_for_run` does it per window and for the run; `conclude` is what the train launcher
calls at the end (tag `draftlab.bottleneck`, evidence artifact). MFU comes from the draft's
FLOPs per token and the device's tabulated dense peak.
"""


from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass
from pathlib import Path

from draftlab.observe.telemetry import Sample, TelemetrySampler, read_step_records
from draftlab.rundir import RunDir

# ------------------------------------------------------------------ thresholds (each: why)
DATA_WAIT_BOUND_FRAC = 0.15  # the GPU idles this share of every step waiting for the loader
DISK_BUSY_SATURATED_PCT = 80.0  # a device busy 80 % of wall time has no headroom left for bursts
DISK_CEILING_SATURATED_FRAC = 0.80  # reads at 80 % of the measured ceiling: the device is the limit
IOWAIT_NOTABLE_PCT = 5.0  # CPUs parked in iowait: loader processes block on reads, not on decode
CPU_SATURATED_PCT = 85.0  # decode/collate cannot go faster without more cores
STRAGGLER_RATIO = 1.20  # one rank's own work 20 % above the median: the rest wait for it every step
COMM_BOUND_FRAC = 0.15  # all-reduce wait this share of the step is time no GPU computes
BWD_TO_FWD = 2.0  # backward ≈ 2 × forward FLOPs: bwd_ms beyond that is communication wait
LOW_MFU = 0.25  # below this, a compute-bound GPU still has most of its peak unused
LOW_POWER_FRAC = 0.60  # "100 % util" below 60 % of the power limit: busy, not saturated

# the labels judged here; a source's own data-bound label (`wait.label`) comes from the source
LABELS = ("data-bound (disk)", "data-bound (CPU)", "compute-bound", "communication-bound", "straggler-bound")

# ------------------------------------------------------------------ peak FLOPs
# Dense (no sparsity) bf16 tensor peak per device, matched in order against the device name.
PEAK_DENSE_BF16 = (
    ("Max-Q", None, "not tabulated: pass the peak (Max-Q clocks are lower than the Workstation Edition's)"),
    ("RTX PRO 6000 Blackwell", 503.8e12, "NVIDIA RTX Blackwell architecture whitepaper: FP16/BF16 tensor, FP32 "
                                         "accumulate, 503.8 TFLOPS dense (1,007.6 with sparsity)"),
    ("H100 PCIe", 756e12, "NVIDIA H100 datasheet: 1,513 TFLOPS bf16 with sparsity ÷ 2"),
    ("H100 NVL", 835e12, "NVIDIA H100 NVL datasheet: 1,671 TFLOPS bf16 with sparsity ÷ 2"),
    ("H200 NVL", 835e12, "NVIDIA H200 NVL datasheet: 1,671 TFLOPS bf16 with sparsity ÷ 2"),
    ("H100", 989.4e12, "NVIDIA H100 SXM datasheet: 1,979 TFLOPS bf16 with sparsity ÷ 2"),
    ("H200", 989.4e12, "NVIDIA H200 SXM datasheet: 1,979 TFLOPS bf16 with sparsity ÷ 2"),
    ("B200", 2.25e15, "NVIDIA HGX B200 datasheet: 4.5 PFLOPS bf16 with sparsity ÷ 2"),
    ("A100", 312e12, "NVIDIA A100 datasheet: 312 TFLOPS bf16 dense"),
)


def peak_flops(device_name: str, dtype: str = "bfloat16") -> tuple[float, str] | None:
    """(dense peak FLOP/s, source) for a device name as NVML/torch report it, or None."""
    if dtype not in ("bfloat16", "float16"):
        return None
    for pattern, flops, source in PEAK_DENSE_BF16:
        if pattern.lower() in device_name.lower():
            return None if flops is None else (flops, source)
    return None


def mfu(flops_per_token: float, tokens_per_s: float, peak: float, num_devices: int = 1) -> float:
    """Model FLOPs utilization: useful FLOPs per second ÷ the devices' dense peak."""
    return flops_per_token * tokens_per_s / (peak * num_devices)


def draft_flops_per_token(config: dict, *, ttt_steps: int = 3, mean_context: float = 0.0) -> float:
    """Training FLOPs per real token of an EAGLE-3 draft (speculators' Eagle3DraftModel).

    `config`: a speculators config.json (`transformer_layer_config`, `draft_vocab_size`) or a flat
    dict with hidden_size, intermediate_size, num_attention_heads, num_key_value_heads,
    [head_dim], num_hidden_layers, draft_vocab_size. Per token:

        fc (3H → H), once:              4 × 3H·H      (forward + weight gradient; its input needs none)
        per TTT step (× ttt_steps):     6 × (layers + lm_head H·Vd)   (forward + backward, 2 + 4)
                                        + 12 × layers × d_attn × keys  (QKᵀ and AV, forward + backward)
        verifier head, once, no grad:   2 × H·Vd

    The first layer's q/k/v read 2H (embedding ⊕ hidden). keys = mean_context + k at TTT step k
    (causal keys within the document, e.g. E[l²] / 2E[l] for packed documents of lengths l; the
    TTT diagonal adds one per step). mean_context = 0 omits attention scores (a lower bound).
    """
    tl = config.get("transformer_layer_config", config)
    h, inter = tl["hidden_size"], tl["intermediate_size"]
    nh, nkv = tl["num_attention_heads"], tl["num_key_value_heads"]
    hd = tl.get("head_dim") or h // nh
    layers = tl.get("num_hidden_layers", 1)
    vd = config.get("draft_vocab_size") or tl.get("draft_vocab_size") or tl["vocab_size"]
    d_attn, d_kv = nh * hd, nkv * hd
    first = 2 * h * (d_attn + 2 * d_kv) + d_attn * h + 3 * h * inter
    rest = (layers - 1) * (h * (d_attn + 2 * d_kv) + d_attn * h + 3 * h * inter)
    dense = 6 * (first + rest + h * vd)
    attn = sum(12 * layers * d_attn * (mean_context + k) for k in range(ttt_steps)) if mean_context else 0.0
    return 4 * 3 * h * h + ttt_steps * dense + attn + 2 * h * vd


def mean_causal_context(lengths) -> float:
    """Mean keys a token attends under a causal per-document mask: Σ l(l+1)/2 ÷ Σ l."""
    total = sum(lengths)
    return sum(n * (n + 1) / 2 for n in lengths) / total if total else 0.0


# ------------------------------------------------------------------ windows and the verdict


@dataclass
class TelemetryWindow:
    """What one stretch of a run looked like. None = not measured (the verdict says so)."""

    start_s: float = 0.0
    end_s: float = 0.0
    data_wait_frac: float | None = None  # fetch_ms / step_ms (speculators' fetch_frac)
    step_ms: float | None = None
    disk_read_mb_s: float | None = None
    disk_busy_pct: float | None = None
    disk_ceiling_mb_s: float | None = None
    cpu_busy_pct: float | None = None
    cpu_iowait_pct: float | None = None
    rank_busy_ms: list[float] | None = None  # per rank: its own work before syncing (fetch + fwd)
    comm_frac: float | None = None  # all-reduce wait / step
    gpu_util_pct: float | None = None
    gpu_power_frac: float | None = None
    mfu: float | None = None
    last_step: int | None = None
    # what computed the steps: "cuda", "cpu", or None (not known: a verdict then names no device)
    device: str | None = None


@dataclass
class Verdict:
    label: str
    evidence: dict
    remedy: str

    def line(self) -> str:
        figures = ", ".join(f"{k} {v}" for k, v in self.evidence.items() if k != "missing")
        return f"{self.label} — {figures}. Remedy: {self.remedy}"


def _fmt(x: float | None, unit: str = "", digits: int = 0) -> str:
    return "n/a" if x is None else f"{x:,.{digits}f}{unit}"


def comm_frac_estimate(fwd_ms: float, bwd_ms: float, step_ms: float, bwd_ms_single: float | None = None) -> float:
    """Share of the step spent waiting in gradient all-reduce: bwd on N ranks minus bwd on one
    rank when measured, else minus BWD_TO_FWD × fwd (backward does ~2× forward's FLOPs)."""
    compute = bwd_ms_single if bwd_ms_single is not None else BWD_TO_FWD * fwd_ms
    return max(bwd_ms - compute, 0.0) / step_ms if step_ms > 0 else 0.0


def classify(w: TelemetryWindow, wait=None) -> Verdict:
    """The largest loss above its threshold decides; no loss above threshold = compute-bound.
    `wait`: what the source says its loaders wait on (None: a store, judged by disk and CPU)."""
    missing = [k for k in ("data_wait_frac", "disk_read_mb_s", "cpu_busy_pct", "rank_busy_ms", "comm_frac")
               if getattr(w, k) is None]
    losses = {}
    if w.data_wait_frac is not None and w.data_wait_frac >= DATA_WAIT_BOUND_FRAC:
        losses["data"] = w.data_wait_frac
    straggle = None
    if w.rank_busy_ms and len(w.rank_busy_ms) > 1:
        med = statistics.median(w.rank_busy_ms)
        straggle = max(w.rank_busy_ms) / med if med > 0 else None
        if straggle is not None and straggle >= STRAGGLER_RATIO:
            # the others idle (max - median) per step, at least the ratio's excess as a share
            idle = (max(w.rank_busy_ms) - med) / w.step_ms if w.step_ms else 0.0
            losses["straggler"] = max(idle, 1 - 1 / straggle)
    if w.comm_frac is not None and w.comm_frac >= COMM_BOUND_FRAC:
        losses["comm"] = w.comm_frac
    gpu_ev = {"gpu_util": _fmt(w.gpu_util_pct, " %"), "power": _fmt(None if w.gpu_power_frac is None
                                                                     else 100 * w.gpu_power_frac, " % of limit"),
              "mfu": _fmt(None if w.mfu is None else 100 * w.mfu, " %", 1)}
    base = {"data_wait": _fmt(None if w.data_wait_frac is None else 100 * w.data_wait_frac, " %", 1)}
    if missing:
        base["missing"] = missing
    worst = max(losses, key=losses.get) if losses else None

    if worst == "data":
        at_ceiling = (w.disk_ceiling_mb_s and w.disk_read_mb_s is not None
                      and w.disk_read_mb_s >= DISK_CEILING_SATURATED_FRAC * w.disk_ceiling_mb_s)
        disk_busy = w.disk_busy_pct is not None and w.disk_busy_pct >= DISK_BUSY_SATURATED_PCT
        cpu_busy = w.cpu_busy_pct is not None and w.cpu_busy_pct >= CPU_SATURATED_PCT
        iowait = w.cpu_iowait_pct is not None and w.cpu_iowait_pct >= IOWAIT_NOTABLE_PCT
        ev = {**base, "disk_read": _fmt(w.disk_read_mb_s, " MB/s"), "disk_busy": _fmt(w.disk_busy_pct, " %"),
              "disk_ceiling": _fmt(w.disk_ceiling_mb_s, " MB/s"), "cpu_busy": _fmt(w.cpu_busy_pct, " %"),
              "cpu_iowait": _fmt(w.cpu_iowait_pct, " %", 1)}
        if wait is not None:
            return Verdict(wait.label, {**base, "cpu_busy": _fmt(w.cpu_busy_pct, " %"), "why": wait.why}, wait.remedy)
        if at_ceiling or disk_busy or (iowait and not cpu_busy):
            why = "at the device's limit" if (at_ceiling or disk_busy) else "below its limit, loaders blocked in iowait"
            return Verdict("data-bound (disk)", {**ev, "why": f"reads {why}"},
                           "the loader waits on the store's disk: put the store on local NVMe (or RAID-0), "
                           "raise train.num_workers × train.prefetch_factor to deepen the read queue "
                           "(mind /dev/shm), and make sure ranks shard the data instead of each reading all of it")
        why = ("decode/collate saturates the CPUs" if cpu_busy else
               "neither disk nor CPUs saturated: too few loader workers to keep up")
        per = "per rank (the loader shares them with the CPU ranks' compute)" if w.device == "cpu" else "per GPU"
        return Verdict("data-bound (CPU)", {**ev, "why": why},
                       "raise train.num_workers if cores are idle (each worker decodes and collates one batch), "
                       "else use a cheaper format/collate (safetensors ≈ 1.9 CPU-s per GB vs 3.7 for .pt; a "
                       f"one-copy collate ≈ 1) or more CPU cores {per}")
    if worst == "straggler":
        slow = max(range(len(w.rank_busy_ms)), key=lambda r: w.rank_busy_ms[r])
        return Verdict("straggler-bound", {**base, "rank_busy_ms": [round(x, 1) for x in w.rank_busy_ms],
                                           "slowest_rank": slow, "max_over_median": round(straggle, 2)},
                       f"rank {slow} is slower than the rest, who wait for it at every all-reduce: check its "
                       "packed tokens per step (token-budget packing skews sample counts), its GPU's clocks and "
                       "power limit, and whether its data comes from a slower disk")
    if worst == "comm":
        return Verdict("communication-bound", {**base, "comm": _fmt(100 * w.comm_frac, " % of step", 1),
                                               "step_ms": _fmt(w.step_ms, " ms")},
                       "gradient all-reduce dominates: more tokens per sync (larger total_seq_len), DDP instead "
                       "of FSDP when the draft fits, NVLink/faster interconnect, or fewer ranks per node")
    comm = {"comm": _fmt(None if w.comm_frac is None else 100 * w.comm_frac, " %", 1)}
    if w.device == "cpu":  # a CPU run: no GPU was used, nor measured; its compute is the CPU cores
        ev = {**base, "cpu_busy": _fmt(w.cpu_busy_pct, " %"), **comm}
        remedy = ("the CPU cores compute the steps (a CPU run): give each rank more cores (torch threads), "
                  "and run no more ranks than there are cores")
        return Verdict("compute-bound", ev, remedy)
    if w.device != "cuda" and all(x is None for x in (w.gpu_util_pct, w.gpu_power_frac, w.mfu)):
        ev = {**base, **comm}
        remedy = ("no loss to data, communication or stragglers was measured; nothing was measured of the "
                  "devices themselves (utilization, power, MFU), so how near their peak they run is not known")
        return Verdict("compute-bound", ev, remedy)
    ev = {**base, **gpu_ev, **comm}
    unsaturated = ((w.mfu is not None and w.mfu < LOW_MFU)
                   or (w.gpu_power_frac is not None and w.gpu_power_frac < LOW_POWER_FRAC))
    if unsaturated:
        remedy = ("the GPU is busy but far from its peak (utilization counts time a kernel runs, not how much of "
                  "the chip it uses): fewer, larger kernels — a larger total_seq_len, flex attention and the "
                  "fused loss, torch.compile, and a profiling log_freq > 1 (every profiled step synchronizes)")
    elif w.mfu is None and w.gpu_power_frac is None:
        remedy = ("the GPUs compute, but neither MFU nor power was measured, so how near their peak is not "
                  "known: look at perf/mfu and the GPU power in MLflow's system metrics before adding GPUs")
    else:
        remedy = "the GPUs compute near their peak: add GPUs (sharding the data) or cut FLOPs per token"
    return Verdict("compute-bound", ev, remedy)


@dataclass
class RunVerdict:
    overall: Verdict
    windows: list[tuple[float, float, str]]  # (start_s, end_s, label)
    shares: dict[str, float]  # label → share of the run's measured time

    def to_json(self) -> dict:
        return {"overall": asdict(self.overall), "windows": self.windows, "shares": self.shares}


def verdict_for_run(windows: list[TelemetryWindow], wait=None) -> RunVerdict:
    """Per-window labels; the run's label is the one that held longest, with the evidence of
    the longest window that had it. `wait`: as `classify`'s."""
    if not windows:
        empty = Verdict("compute-bound", {"missing": ["every window"]}, "no telemetry was recorded")
        return RunVerdict(empty, [], {})
    # Windows without a training step (start-up, the final checkpoint/validation) carry no
    # evidence about steps: judge the run on the windows that trained, when there are any.
    stepping = [w for w in windows if w.step_ms is not None]
    judged = [(w, classify(w, wait)) for w in (stepping or windows)]
    time_by: dict[str, float] = {}
    for w, v in judged:
        time_by[v.label] = time_by.get(v.label, 0.0) + max(w.end_s - w.start_s, 1e-9)
    total = sum(time_by.values())
    label = max(time_by, key=time_by.get)
    _, best = max(((w, v) for w, v in judged if v.label == label), key=lambda wv: wv[0].end_s - wv[0].start_s)
    shares = {k: round(v / total, 3) for k, v in sorted(time_by.items(), key=lambda kv: -kv[1])}
    return RunVerdict(best, [(w.start_s, w.end_s, v.label) for w, v in judged], shares)


def _mean(xs):
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def build_windows(samples: list[Sample], steps: list[dict], *, window_s: float = 60.0,
                  disk_ceiling_mb_s: float | None = None, flops_per_token: float | None = None,
                  peak: float | None = None, device: str | None = None) -> list[TelemetryWindow]:
    """Cut host samples and per-rank step records (StepProfileRecorder) into fixed windows;
    `device` ("cuda", "cpu") is what computed the steps (None: not known)."""
    times = [s.t for s in samples] + [r["t"] for r in steps]
    if not times:
        return []
    t0 = min(times)
    buckets: dict[int, tuple[list, list]] = {}
    for s in samples:
        buckets.setdefault(int((s.t - t0) // window_s), ([], []))[0].append(s)
    for r in steps:
        buckets.setdefault(int((r["t"] - t0) // window_s), ([], []))[1].append(r)
    out = []
    for k in sorted(buckets):
        ss, rs = buckets[k]
        w = TelemetryWindow(start_s=k * window_s, end_s=(k + 1) * window_s, disk_ceiling_mb_s=disk_ceiling_mb_s,
                            device=device,
                            disk_read_mb_s=_mean(s.disk_read_mb_s for s in ss),
                            disk_busy_pct=_mean(s.disk_busy_pct for s in ss),
                            cpu_busy_pct=_mean(s.cpu_busy_pct for s in ss),
                            cpu_iowait_pct=_mean(s.cpu_iowait_pct for s in ss),
                            gpu_util_pct=_mean(g.util_pct for s in ss for g in s.gpus),
                            gpu_power_frac=_mean(g.power_w / g.power_limit_w for s in ss for g in s.gpus
                                                 if g.power_w is not None and g.power_limit_w))
        if rs:
            by_rank: dict[int, list[dict]] = {}
            for r in rs:
                by_rank.setdefault(r.get("rank", 0), []).append(r)
            fetch = sum(r.get("fetch_ms", 0.0) for r in rs)
            step = sum(r.get("step_ms", 0.0) for r in rs)
            w.data_wait_frac = fetch / step if step else None
            w.step_ms = statistics.median(r["step_ms"] for r in rs if "step_ms" in r) if step else None
            busy = {rk: statistics.median(r.get("fetch_ms", 0.0) + r.get("fwd_ms", 0.0) for r in v)
                    for rk, v in by_rank.items()}
            w.rank_busy_ms = [busy[rk] for rk in sorted(busy)] if len(busy) > 1 else None
            slowest = by_rank[max(busy, key=busy.get)]  # its wait in bwd is communication, not waiting for others
            full = [r for r in slowest if {"fwd_ms", "bwd_ms", "step_ms"} <= r.keys()]
            if full and len(by_rank) > 1:  # one rank has nobody to wait for
                w.comm_frac = statistics.median(comm_frac_estimate(r["fwd_ms"], r["bwd_ms"], r["step_ms"])
                                                for r in full)
            if flops_per_token and peak:
                tps = [r["tokens_per_s"] for r in rs if r.get("tokens_per_s")]
                w.mfu = mfu(flops_per_token, statistics.median(tps), peak) if tps else None
            w.last_step = max((r["step"] for r in rs if r.get("step") is not None), default=None)
        out.append(w)
    return out


def conclude(sampler: TelemetrySampler | None, run_dir: Path, tracker, *, window_s: float = 60.0,
             disk_ceiling_mb_s: float | None = None, flops_per_token: float | None = None,
             device: str | None = None, wait=None) -> RunVerdict:
    """End of a run: windows → verdict; tag `draftlab.bottleneck`, log the evidence as
    `bottleneck.json` and perf/mfu, perf/gpu_power_frac per window (GPU hosts). `device`: what
    trained ("cuda", "cpu"; the verdict speaks only of what was measured on it); `wait`: what the
    hidden-state source says its loaders wait on (`HiddenStateSource.describe_wait`)."""
    from draftlab.util import write_json_atomic

    samples = sampler.samples if sampler else []
    peak = None
    if sampler and sampler.gpu_names and flops_per_token:
        found = peak_flops(sampler.gpu_names[0])
        peak = found[0] if found else None
    windows = build_windows(samples, read_step_records(run_dir), window_s=window_s,
                            disk_ceiling_mb_s=disk_ceiling_mb_s, flops_per_token=flops_per_token, peak=peak,
                            device=device)
    verdict = verdict_for_run(windows, wait)
    for w in windows:
        figures = {k: v for k, v in (("perf/mfu", w.mfu), ("perf/gpu_power_frac", w.gpu_power_frac)) if v is not None}
        if figures and w.last_step is not None:
            tracker.log_metrics(figures, step=w.last_step)
    path = RunDir(Path(run_dir)).bottleneck_path
    write_json_atomic(path, {**verdict.to_json(), "thresholds": {k: v for k, v in globals().items()
                                                                 if k.isupper() and isinstance(v, float)},
                             "windows_detail": [asdict(w) for w in windows]})
    tracker.set_tags({"draftlab.bottleneck": verdict.overall.label})
    tracker.log_artifact(path)
    return verdict
