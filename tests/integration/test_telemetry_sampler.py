"""The host sampler watching a real child process."""

from __future__ import annotations

import subprocess
import sys
import time

from draftlab.observe import telemetry as tm
from tests.conftest import RecordingTracker


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
