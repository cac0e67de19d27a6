"""The start-up's phases (training.startup) and the launcher's plan cache (plan.cache)."""

from __future__ import annotations

import time


def _dataset(path, lengths):
    from datasets import Dataset

    Dataset.from_dict({"input_ids": [[1] * n for n in lengths], "loss_mask": [[1] * n for n in lengths],
                       "seq_len": lengths}).save_to_disk(str(path))


def test_a_second_plan_of_the_same_data_is_read_back_and_a_changed_dataset_is_planned_again(tmp_path, monkeypatch):
    """A sweep's trials and a rerun read the accounting back; new data never gets the old plan."""
    from draftlab.plan import cache
    from draftlab.training import job
    from tests.conftest import tiny_params

    monkeypatch.setenv("DRAFTLAB_CACHE_DIR", str(tmp_path / "cache"))
    params = tiny_params(train={"total_seq_len": 64, "epochs": 2})
    data = tmp_path / "prepared"
    _dataset(data, [10, 20, 30, 40, 50, 60, 25, 35, 45, 15, 5, 12])
    first = job.plan(params, data)
    assert list((tmp_path / "cache" / "plan").glob("*.json")), "the plan was not kept"
    again = job.plan(params, data)
    assert again == first
    assert again[0].total_steps == sum(e.steps for e in first[0].epochs)

    import shutil

    shutil.rmtree(data)
    _dataset(data, [60] * 12)  # one sample a row: a different step count
    changed = job.plan(params, data)
    assert changed[0].total_steps != first[0].total_steps
    assert changed[0].total_steps == 2 * int(12 * params.data.train_ratio)
    assert cache.split(data, params.data.train_ratio)["train_lengths"] == [60] * int(12 * params.data.train_ratio)


def test_the_phases_add_up_to_the_time_to_the_first_step():
    """train.json's `startup`: consecutive spans from the launcher's start to the end of step 0."""
    from draftlab.training import startup

    clock = startup.Clock(process_start=100.0, called_at=100.5)
    clock.phases = {startup.LAUNCHER_PROCESS: 0.5, "preflight": 1.0, "mlflow_run": 2.0, "command": 0.5}
    clock.spawned_at = 104.0
    marks = {"process_start": 105.0, "main_at": 105.5, "speculators_at": 113.5, "trainer_at": 113.7}
    phases = startup.breakdown(clock, marks, {"t": 114.5, "step_ms": 300.0})
    assert phases["torchrun"] == 1.0 and phases["rank_speculators"] == 8.0 and phases["first_step"] == 0.3
    assert phases["total_s"] == 14.5
    assert abs(sum(v for k, v in phases.items() if k != "total_s") - phases["total_s"]) < 1e-6
    assert startup.line(phases).startswith("14.5 s to step 0: rank_speculators 8.0, mlflow_run 2.0")
    assert startup.breakdown(clock, None, {"t": 114.5, "step_ms": 300.0}) is None  # a rank that left no marks


def test_a_new_runs_mlflow_work_after_torchrun_is_beside_the_sum_and_said_apart(monkeypatch):
    """A new run's MLflow run is made while the ranks start: its phases are `beside/…`, out of
    the sum that is the time to the first step, and the line names them apart."""
    from draftlab.training import startup

    now = iter([101.0, 101.5, 104.0, 105.0])
    monkeypatch.setattr(startup.time, "time", lambda: next(now))
    clock = startup.Clock(process_start=100.0, called_at=100.5)
    clock.mark("preflight")  # 101.0
    clock.spawned()  # 101.5: the command
    clock.mark("mlflow_run")  # 104.0, beside the ranks
    clock.mark("run_params")  # 105.0
    assert clock.phases == {"launcher_process": 0.5, "preflight": 0.5, "command": 0.5,
                            "beside/mlflow_run": 2.5, "beside/run_params": 1.0}
    marks = {"process_start": 102.0, "main_at": 102.5, "speculators_at": 107.5, "trainer_at": 107.6}
    phases = startup.breakdown(clock, marks, {"t": 108.0, "step_ms": 200.0})
    assert phases["total_s"] == 8.0 and abs(startup.in_sum(phases) - 8.0) < 1e-6
    assert startup.line(phases).endswith("; beside the ranks' start: mlflow_run 2.5, run_params 1.0")


def test_the_first_step_of_a_resumed_folder_is_this_launch_s():
    from draftlab.training import startup

    records = [{"rank": 0, "step": 5, "t": 50.0, "step_ms": 10}, {"rank": 0, "step": 6, "t": 51.0, "step_ms": 10},
               {"rank": 0, "step": 7, "t": 90.0, "step_ms": 12}, {"rank": 1, "step": 7, "t": 89.0, "step_ms": 12}]
    assert startup.first_step_record(records, after=80.0)["step"] == 7
    assert startup.first_step_record(records)["step"] == 5


def test_a_process_start_lies_between_its_spawn_and_its_first_line():
    """The origin of `launcher_process` and `rank_imports` is the process's real start: not before
    its parent spawned it (psutil's create_time() is up to a second early: boot time in whole
    seconds) and not after the process ran."""
    import subprocess
    import sys

    spawned = time.time()
    out = subprocess.run([sys.executable, "-c", "import time; from draftlab.training.startup import process_start; "
                          "print(process_start(), time.time())"], capture_output=True, text=True, check=True)
    started, ran = map(float, out.stdout.split())
    tick = 0.011  # the kernel records a start to 1/CLK_TCK (10 ms)
    assert spawned - tick <= started <= ran
