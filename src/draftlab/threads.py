"""How many threads a process draftlab starts may use, from the CPUs it may actually run on.

torch's default intra-op pool is one thread per core of the *machine*, and its OpenMP threads
spin while they wait. Two processes doing that on the same two cores (two pipelines side by
side, a sweep's trials, torchrun's ranks) spend most of their time spinning against each other.
So every process draftlab starts gets

    threads = budget // share        budget: OMP_NUM_THREADS if the user set it, else the usable
                                      CPUs (affinity ∩ cgroup quota); share: the processes that
                                      split it (torchrun's ranks on this node, a sweep slot's share)

and OpenMP's passive wait policy (a waiting thread sleeps instead of spinning), unless the user
set one. Set in the environment before torch loads, so children (torchrun, ranks, trials)
inherit it; `configure` also resizes the pool of a torch already loaded in this process.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

CGROUP_V2_MAX = Path("/sys/fs/cgroup/cpu.max")
CGROUP_V1_QUOTA = Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us")
CGROUP_V1_PERIOD = Path("/sys/fs/cgroup/cpu/cpu.cfs_period_us")


def cgroup_cpus() -> float | None:
    """CPUs allowed by the cgroup's CFS quota (a container's --cpus), None when unlimited."""
    try:
        quota, period = CGROUP_V2_MAX.read_text().split()[:2]
        if quota != "max":
            return int(quota) / int(period)
        return None
    except (OSError, ValueError):
        pass
    try:
        quota, period = int(CGROUP_V1_QUOTA.read_text()), int(CGROUP_V1_PERIOD.read_text())
        return quota / period if quota > 0 and period > 0 else None
    except (OSError, ValueError):
        return None


def usable_cpus() -> int:
    """CPUs this process may run on: its affinity mask, capped by the cgroup quota."""
    try:
        n = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        n = os.cpu_count() or 1
    quota = cgroup_cpus()
    if quota is not None:
        n = min(n, max(1, math.ceil(quota)))
    return max(1, n)


def budget(env: dict | None = None) -> int:
    """Threads the whole process tree may use: the user's OMP_NUM_THREADS, else the usable CPUs."""
    env = os.environ if env is None else env
    stated = env.get("OMP_NUM_THREADS", "").strip()
    if stated.isdigit() and int(stated) > 0:
        return int(stated)
    return usable_cpus()


def thread_env(share: int = 1, env: dict | None = None, *, total: int | None = None) -> dict[str, str]:
    """`env` (default os.environ) with the thread settings for a child that gets 1/`share` of
    `total` threads (default: this process's budget)."""
    env = dict(os.environ if env is None else env)
    n = max(1, (total if total is not None else budget(env)) // max(share, 1))
    env["OMP_NUM_THREADS"] = str(n)
    env["MKL_NUM_THREADS"] = str(n)
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    return env


def configure(share: int = 1) -> int:
    """Apply thread_env to this process (before torch loads, ideally) and to a loaded torch."""
    import sys

    env = thread_env(share)
    for key in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OMP_WAIT_POLICY"):
        os.environ[key] = env[key]
    n = int(env["OMP_NUM_THREADS"])
    torch = sys.modules.get("torch")
    if torch is not None and torch.get_num_threads() != n:
        torch.set_num_threads(n)
    return n


BACKGROUND_NICE = 19  # the lowest priority: the trainer's (and the launcher's own) work goes first


def yield_cpu(native_id: int | None = None) -> bool:
    """Run a draftlab observer thread (the rank's tracking writer, the launcher's telemetry and
    MLflow system-metrics samplers) at nice 19: it takes a CPU the trainer leaves idle, and on a
    host with CPUs to spare it runs as before. Linux keeps a nice value per thread, so this
    touches no other thread; the default thread (`native_id` None) is the calling one. False
    where the platform does not allow it (nothing changes): elsewhere a thread id passed to
    setpriority would name a process."""
    import sys
    import threading

    if not sys.platform.startswith("linux"):
        return False
    try:
        os.setpriority(os.PRIO_PROCESS, native_id or threading.get_native_id(), BACKGROUND_NICE)
        return True
    except (AttributeError, OSError):
        return False


def yield_cpu_of(thread_name: str) -> int:
    """yield_cpu for every live thread of this process with that name (one another library
    started); how many it lowered."""
    import threading

    return sum(yield_cpu(t.native_id) for t in threading.enumerate() if t.name == thread_name and t.native_id)
