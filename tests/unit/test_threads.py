"""draftlab.threads: every process draftlab starts takes its thread count from the CPUs it may
use (affinity, cgroup quota, the user's OMP_NUM_THREADS, its share), and waits passively."""

from __future__ import annotations

import os

from draftlab import threads


def test_budget_is_the_users_omp_num_threads_else_the_usable_cpus():
    assert threads.budget({"OMP_NUM_THREADS": "3"}) == 3
    assert threads.budget({}) == threads.usable_cpus() >= 1
    assert threads.budget({"OMP_NUM_THREADS": "junk"}) == threads.usable_cpus()


def test_a_child_gets_its_share_and_passive_waiting_unless_the_user_chose():
    env = threads.thread_env(2, {"OMP_NUM_THREADS": "8"})
    assert env["OMP_NUM_THREADS"] == env["MKL_NUM_THREADS"] == "4" and env["OMP_WAIT_POLICY"] == "PASSIVE"
    assert threads.thread_env(4, {"OMP_NUM_THREADS": "2"})["OMP_NUM_THREADS"] == "1"  # never 0
    assert threads.thread_env(1, {"OMP_WAIT_POLICY": "ACTIVE"}, total=3)["OMP_WAIT_POLICY"] == "ACTIVE"


def test_a_cgroup_quota_caps_the_usable_cpus(tmp_path, monkeypatch):
    quota = tmp_path / "cpu.max"
    quota.write_text("150000 100000\n")  # docker --cpus 1.5
    monkeypatch.setattr(threads, "CGROUP_V2_MAX", quota)
    assert threads.cgroup_cpus() == 1.5
    assert threads.usable_cpus() == min(len(os.sched_getaffinity(0)), 2)
    quota.write_text("max 100000\n")
    assert threads.cgroup_cpus() is None


def test_sweep_trials_get_their_slots_share_of_the_threads(tmp_path, monkeypatch):
    from draftlab.params import parse_params
    from draftlab.sweep.budget import TrialSpec
    from draftlab.sweep.trial import ProcessLauncher

    monkeypatch.setenv("OMP_NUM_THREADS", "8")  # the user's budget for this host

    def env(devices, gpu_slots):
        launcher = ProcessLauncher(study="s", metric="val/loss", target_dir=tmp_path, data_dir=tmp_path,
                                   store_dir=tmp_path, parent_run_id=None, gpu_slots=gpu_slots, total_slots=4)
        return launcher.env_for(TrialSpec(0, {}, parse_params({}), devices, "search", tmp_path / "trial-0000"))

    cpu = env(["cpu0", "cpu1"], False)  # a CPU slot is one CPU
    assert cpu["OMP_NUM_THREADS"] == "2" and cpu["OMP_WAIT_POLICY"] == "PASSIVE"
    gpu = env(["0"], True)  # one GPU of four: a quarter of the CPUs
    assert gpu["OMP_NUM_THREADS"] == "2" and gpu["CUDA_VISIBLE_DEVICES"] == "0"


def _nice(native_id: int) -> int:
    return os.getpriority(os.PRIO_PROCESS, native_id)


def test_a_thread_another_library_started_is_found_by_name_and_lowered_alone():
    import threading

    stop = threading.Event()
    other = threading.Thread(target=stop.wait, name="SystemMetricsMonitor", daemon=True)
    bystander = threading.Thread(target=stop.wait, name="bystander", daemon=True)
    other.start(), bystander.start()
    try:
        before = _nice(bystander.native_id)
        assert threads.yield_cpu_of("SystemMetricsMonitor") == 1
        assert _nice(other.native_id) == threads.BACKGROUND_NICE
        assert _nice(bystander.native_id) == before
        assert threads.yield_cpu_of("no such thread") == 0
    finally:
        stop.set()
