"""The host sampler watching a real child process."""

from __future__ import annotations

import subprocess
import sys
import time


from draftlab import telemetry as tm
from draftlab.tracking import RecordingTracker

# One window per label, with the figures an operator would see.
DISK = tm.TelemetryWindow(data_wait_frac=0.45, step_ms=900, disk_read_mb_s=2900, disk_busy_pct=97,
                          disk_ceiling_mb_s=3000, cpu_busy_pct=20, cpu_iowait_pct=30, comm_frac=0.02)
DISK_LATENCY = tm.TelemetryWindow(data_wait_frac=0.4, step_ms=700, disk_read_mb_s=393, disk_busy_pct=12,
                                  cpu_busy_pct=7, cpu_iowait_pct=25)  # the reference run's disk, loaders in iowait
CPU = tm.TelemetryWindow(data_wait_frac=0.35, step_ms=800, disk_read_mb_s=400, disk_busy_pct=15,
                         cpu_busy_pct=97, cpu_iowait_pct=0.5, comm_frac=0.03)
COMPUTE_UNSATURATED = tm.TelemetryWindow(data_wait_frac=0.02, step_ms=700, disk_read_mb_s=393, disk_busy_pct=12,
                                         cpu_busy_pct=7, cpu_iowait_pct=0.3, rank_busy_ms=[200, 205, 198, 202],
                                         comm_frac=0.03, gpu_util_pct=100, gpu_power_frac=250 / 600, mfu=0.08)
COMPUTE_SATURATED = tm.TelemetryWindow(data_wait_frac=0.01, step_ms=500, cpu_busy_pct=30, comm_frac=0.05,
                                       gpu_util_pct=99, gpu_power_frac=0.95, mfu=0.45)
COMM = tm.TelemetryWindow(data_wait_frac=0.03, step_ms=1000, cpu_busy_pct=20, rank_busy_ms=[300, 305, 302, 298],
                          comm_frac=0.38, gpu_util_pct=60, gpu_power_frac=0.5)
STRAGGLER = tm.TelemetryWindow(data_wait_frac=0.03, step_ms=700, cpu_busy_pct=20, rank_busy_ms=[300, 298, 302, 430],
                               comm_frac=0.04, gpu_util_pct=80)


def test_sampler_logs_host_metrics_mlflow_lacks(tmp_path):
    tracker = RecordingTracker()
    child = subprocess.Popen([sys.executable, "-c", "import time; x = bytearray(80_000_000); time.sleep(120)"])
    try:
        time.sleep(0.5)
        with tm.TelemetrySampler(tmp_path, tracker, interval_s=0.1) as sampler:
            deadline = time.time() + 60  # a count of samples, not a duration: loaded hosts are slow
            while len(sampler.samples) < 3 and time.time() < deadline:
                time.sleep(0.05)
    finally:
        child.kill()
        child.wait()
    assert len(sampler.samples) >= 3 and len(tracker.metrics) == len(sampler.samples)
    names = set().union(*(m for _, m in tracker.metrics))
    assert {"system/cpu_idle_pct", "system/cpu_iowait_pct", "system/process_rss_mb",
            "system/process_cpu_cores"} <= names
    assert all(n.startswith("system/") for n in names)
    assert not names & {"system/cpu_utilization_percentage", "system/system_memory_usage_megabytes"}
    if sampler.device is not None:  # a block device holds tmp_path (not on overlayfs)
        assert {"system/disk_read_mb_s", "system/disk_busy_pct"} <= names
    assert [s for s, _ in tracker.metrics] == list(range(len(tracker.metrics)))
    rss = [m["system/process_rss_mb"] for _, m in tracker.metrics]
    assert max(rss) > 80  # the child's 80 MB count: RSS is the whole process tree
    s = sampler.samples[-1]
    assert 0 <= s.cpu_busy_pct <= 100 and abs(s.cpu_busy_pct + s.cpu_idle_pct + s.cpu_iowait_pct - 100) < 1e-6
