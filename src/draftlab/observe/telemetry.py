"""Telemetry during extract and train: what the bottleneck verdict (draftlab.observe.bottleneck) reads.

`TelemetrySampler` is a background thread (psutil; NVML on GPU hosts, imported lazily) that every
`interval_s` samples what MLflow's built-in system metrics lack and logs it under `system/…`:

    system/disk_read_mb_s, system/disk_busy_pct   the block device holding the store (not `/`)
    system/cpu_idle_pct, system/cpu_iowait_pct    (MLflow logs cpu_utilization_percentage)
    system/process_rss_mb, system/process_cpu_cores   this process and all its children
    system/shm_used_mb                            /dev/shm, where loader batches live
    system/gpu_<i>_power_limit_w                  (MLflow logs utilization, memory, power W and %)

MLflow 3.17 covers cpu_utilization_percentage, system_memory_usage_*, disk_usage_* of `/`,
network_*, gpu_<i>_{utilization_percentage, memory_usage_*, power_usage_watts,
power_usage_percentage}; those are sampled here too (for the verdict) but not logged twice.
Per-step data wait comes from the trainer (`perf/data_wait_frac`, speculators' fetch_frac);
`StepProfileRecorder` writes each rank's step profile so that stragglers can be seen.
"""


from __future__ import annotations

import json
import logging
import os
import resource
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from draftlab import appendlog
from draftlab.rundir import RunDir

# ------------------------------------------------------------------ sampling


@dataclass
class GpuSample:
    util_pct: float | None
    memory_used_mb: float | None
    power_w: float | None
    power_limit_w: float | None


@dataclass
class Sample:
    t: float  # unix time
    disk_read_mb_s: float | None
    disk_busy_pct: float | None
    cpu_busy_pct: float
    cpu_idle_pct: float
    cpu_iowait_pct: float
    process_rss_mb: float
    process_cpu_cores: float
    shm_used_mb: float | None
    gpus: list[GpuSample] = field(default_factory=list)

    def metrics(self) -> dict[str, float]:
        """The `system/…` names MLflow's own system metrics do not already log."""
        out = {"system/cpu_idle_pct": self.cpu_idle_pct, "system/cpu_iowait_pct": self.cpu_iowait_pct,
               "system/process_rss_mb": self.process_rss_mb, "system/process_cpu_cores": self.process_cpu_cores}
        if self.disk_read_mb_s is not None:
            out["system/disk_read_mb_s"] = self.disk_read_mb_s
        if self.disk_busy_pct is not None:
            out["system/disk_busy_pct"] = self.disk_busy_pct
        if self.shm_used_mb is not None:
            out["system/shm_used_mb"] = self.shm_used_mb
        for i, g in enumerate(self.gpus):
            if g.power_limit_w is not None:
                out[f"system/gpu_{i}_power_limit_w"] = g.power_limit_w
        return out


def block_device(path: Path) -> str | None:
    """Name (as in /proc/diskstats) of the block device holding `path`, or None (e.g. overlayfs)."""
    import psutil

    p = Path(path).resolve()
    while not p.exists():
        p = p.parent
    dev = os.stat(p).st_dev
    names = psutil.disk_io_counters(perdisk=True) or {}
    sys_link = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}")
    if sys_link.exists():
        name = Path(os.path.realpath(sys_link)).name
        if name in names:
            return name
    best = None  # fall back to the longest mount point above the path
    for part in psutil.disk_partitions(all=True):
        if str(p).startswith(part.mountpoint) and (best is None or len(part.mountpoint) > len(best.mountpoint)):
            best = part
    if best is not None and best.device.startswith("/dev/"):
        name = Path(os.path.realpath(best.device)).name
        return name if name in names else None
    return None


class _Nvml:
    """NVML handles, or nothing: absent library or no driver is a CPU host, not an error."""

    def __init__(self):
        import pynvml  # nvidia-ml-py; not a dependency of CPU installs

        pynvml.nvmlInit()
        self.nvml = pynvml
        self.handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
        names = [self._try(pynvml.nvmlDeviceGetName, h) for h in self.handles]
        self.names = [n.decode() if isinstance(n, bytes) else (n or "") for n in names]

    def _try(self, fn, *args):
        try:
            return fn(*args)
        except self.nvml.NVMLError:
            return None

    def sample(self) -> list[GpuSample]:
        out = []
        for h in self.handles:
            util = self._try(self.nvml.nvmlDeviceGetUtilizationRates, h)
            mem = self._try(self.nvml.nvmlDeviceGetMemoryInfo, h)
            power = self._try(self.nvml.nvmlDeviceGetPowerUsage, h)
            limit = self._try(self.nvml.nvmlDeviceGetEnforcedPowerLimit, h)
            out.append(GpuSample(util.gpu if util else None, mem.used / 1e6 if mem else None,
                                 power / 1000 if power is not None else None, limit / 1000 if limit else None))
        return out

    def close(self):
        self._try(self.nvml.nvmlShutdown)


class TelemetrySampler:
    """Samples host telemetry in a daemon thread and logs it through `tracker.log_metrics`.

        with TelemetrySampler(store_dir, tracker) as sampler:
            ...                       # extraction or the torchrun wait
        sampler.samples               # kept in memory for the verdict

    Each sample costs a handful of /proc reads (about a millisecond); at the default 2 s that is
    well under 0.1 % of one core (benchmarks/telemetry_overhead.py measures the effect on training).
    """

    def __init__(self, path: Path, tracker=None, *, interval_s: float = 2.0, pid: int | None = None,
                 nvml: bool = True, shm_path: Path = Path("/dev/shm")):
        import psutil

        self.tracker = tracker
        self.interval_s = interval_s
        self.device = block_device(path)
        self.shm_path = shm_path if shm_path.exists() else None
        self.process = psutil.Process(pid or os.getpid())
        self.samples: list[Sample] = []
        self._nvml = None
        if nvml:
            try:
                self._nvml = _Nvml()
            except Exception:  # noqa: BLE001 — ImportError or NVMLError: a host without NVIDIA GPUs
                self._nvml = None
        self.gpu_names: list[str] = list(self._nvml.names) if self._nvml else []  # kept after stop()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._prev = self._counters()

    def _counters(self):
        import psutil

        disk = psutil.disk_io_counters(perdisk=True).get(self.device) if self.device else None
        procs = {}
        for proc in [self.process, *self._children()]:
            try:
                ct = proc.cpu_times()
                procs[proc.pid] = (ct.user + ct.system, proc.memory_info().rss)
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
        # cpu_times deltas of our own: psutil.cpu_percent() keeps shared state that MLflow's monitor also uses
        return time.time(), psutil.cpu_times(), disk, procs

    def _children(self):
        import psutil

        try:
            return self.process.children(recursive=True)
        except psutil.NoSuchProcess:
            return []

    def sample_once(self) -> Sample:
        t1, cpu1, disk1, procs1 = now = self._counters()
        t0, cpu0, disk0, procs0 = self._prev
        self._prev = now
        dt = max(t1 - t0, 1e-6)
        deltas = {k: max(getattr(cpu1, k) - getattr(cpu0, k), 0.0) for k in cpu1._fields}
        total = sum(v for k, v in deltas.items() if k not in ("guest", "guest_nice")) or 1e-9
        idle, iowait = deltas.get("idle", 0.0), deltas.get("iowait", 0.0)
        read_mb_s = busy_pct = None
        if disk0 is not None and disk1 is not None:
            read_mb_s = max(disk1.read_bytes - disk0.read_bytes, 0) / dt / 1e6
            busy_pct = min(max(disk1.busy_time - disk0.busy_time, 0) / (dt * 1000) * 100, 100.0)
        cores = sum(max(c - procs0[pid][0], 0.0) for pid, (c, _) in procs1.items() if pid in procs0) / dt
        shm_mb = None
        if self.shm_path is not None:
            import shutil

            shm_mb = shutil.disk_usage(self.shm_path).used / 1e6
        return Sample(
            t=t1, disk_read_mb_s=read_mb_s, disk_busy_pct=busy_pct,
            cpu_busy_pct=100.0 * (total - idle - iowait) / total, cpu_idle_pct=100.0 * idle / total,
            cpu_iowait_pct=100.0 * iowait / total,
            process_rss_mb=sum(rss for _, rss in procs1.values()) / 1e6, process_cpu_cores=cores,
            shm_used_mb=shm_mb, gpus=self._nvml.sample() if self._nvml else [],
        )

    def _run(self) -> None:
        from draftlab.threads import yield_cpu

        yield_cpu()  # a sample waits for a CPU the ranks leave
        step = 0
        while not self._stop.wait(self.interval_s):
            try:
                s = self.sample_once()
            except Exception as err:  # noqa: BLE001 — telemetry must never stop the work it watches
                logging.getLogger(__name__).debug("telemetry sample failed: %s", err)
                continue
            self.samples.append(s)
            if self.tracker is not None:
                self.tracker.log_metrics(s.metrics(), step=step)
            step += 1

    def start(self) -> TelemetrySampler:
        self._prev = self._counters()
        self._thread = threading.Thread(target=self._run, name="draftlab-telemetry", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.interval_s + 5)
        if self._nvml is not None:
            self._nvml.close()
            self._nvml = None

    def __enter__(self) -> TelemetrySampler:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class StepProfileRecorder(logging.Handler):
    """A `speculators.metrics` handler for every rank: appends the rank's step profile
    (fetch/fwd/bwd/opt/step ms, fetch_frac, tokens/s) to `<run_dir>/profile/rank<r>.jsonl`, with
    the process's minor page faults so far (`minflt`: a step that maps memory anew shows there)."""

    KEYS = ("fetch_ms", "fwd_ms", "bwd_ms", "opt_ms", "step_ms", "fetch_frac", "tokens_per_s")

    def __init__(self, run_dir: Path, rank: int):
        super().__init__()
        self.path = RunDir(run_dir).profile_file(rank)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.rank = rank
        # its own file handle, not logging's stream: speculators' dictConfig closes every handler's
        # stream that exists when it configures logging, which is after this one is made
        self.lines = appendlog.Appender(self.path)  # a torn last line (kill, full disk) is trimmed first

    def emit(self, record):
        msg = record.msg
        profile = msg.get("profile") if isinstance(msg, dict) else None
        if not profile:
            return
        rec = {"t": time.time(), "rank": self.rank, "step": getattr(record, "step", None)}
        rec.update({k: profile[k] for k in self.KEYS if k in profile})
        rec["minflt"] = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        self.lines.append(rec)


def read_step_records(run_dir: Path) -> list[dict]:
    out = []
    for path in RunDir(run_dir).profile_files():
        for line in appendlog.complete_lines(path):
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a line torn by an older draftlab
    return out
