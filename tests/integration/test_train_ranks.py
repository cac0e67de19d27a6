"""`draftlab train` beyond 2 ranks: 4 gloo ranks (DRAFTLAB_TEST_WORLD_SIZE=8 for the reference's 8;
`benchmarks/reference_shape.py ranks` runs that), killed with kill -9 after the first checkpoint and
resumed. The accounting, the per-rank sample sets and the MLflow run must hold at that world size."""

import json
import os
import signal
import subprocess
import time


from draftlab.rundir import RunDir

WORLD_SIZE = int(os.environ.get("DRAFTLAB_TEST_WORLD_SIZE", "4"))


def test_world_size_ranks_shard_as_speculators_sampler_and_kill_9_resume_logs_each_step_once(built, tmp_path,
                                                                                          mlflow_store):
    from draftlab.params import parse_params
    from draftlab.plan import accounting as acc
    from draftlab.training.job import observed_samples, train_split
    from tests.conftest import train_command, train_ranks_of

    store = mlflow_store
    raw = built[0].model_dump()
    raw["train"].update({"gpus": WORLD_SIZE, "epochs": 3, "total_seq_len": 96, "draft_vocab_size": 64, "lr": 3e-3})
    params = parse_params(raw)
    data_dir = built[2]
    out = tmp_path / "run"
    cmd = train_command(built, params, tmp_path / "params.yaml", out)

    tmp = tmp_path / "tmp"  # the runs' TMPDIR: torch's elastic agent makes a folder there per launch
    tmp.mkdir()
    env = dict(os.environ, TMPDIR=str(tmp))
    launcher = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    deadline = time.monotonic() + 1200  # a generous bound for a loaded 2-core host, not a speed check
    while not (out / "checkpoints" / "0" / "training_state.json").exists():
        assert launcher.poll() is None, "training ended before it could be killed"
        assert time.monotonic() < deadline, "no checkpoint within 1200 s"
        time.sleep(0.05)
    assert len(train_ranks_of(out)) >= WORLD_SIZE, "every rank runs"  # (and torchrun, whose argv names the module)
    os.kill(launcher.pid, signal.SIGKILL)
    launcher.wait()
    deadline = time.monotonic() + 30
    while train_ranks_of(out):
        assert time.monotonic() < deadline, "ranks outlived their killed launcher"
        time.sleep(0.1)
    run_id = RunDir(out).run.read().run_id

    rerun = subprocess.run(cmd, capture_output=True, text=True, env=env)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    # neither the rerun's nor the killed launcher's: the rerun removed that one
    left = sorted(p.name for p in tmp.iterdir() if p.name.startswith(("torchelastic_", "draftlab-torchrun-")))
    assert left == [], f"the launchers' log folders were left in TMPDIR: {left}"

    accounting = RunDir(out).accounting.read()
    assert accounting.world_size == WORLD_SIZE
    assert RunDir(out).accounting_check.read().problems == []
    runs = store.search_runs([store.get_experiment_by_name("draftlab").experiment_id])
    assert [r.info.run_id for r in runs] == [run_id], "one MLflow run across the kill"
    run = runs[0]
    assert run.info.status == "FINISHED" and int(run.data.params["world_size"]) == WORLD_SIZE
    assert int(run.data.tags["draftlab.resumed_from_step"]) > 0
    steps = [m.step for m in store.get_metric_history(run_id, "train/loss")]
    assert sorted(steps) == list(range(accounting.total_steps)), "each global step logged exactly once"

    # what each rank's sampler handed out, against speculators' own sampler built for that rank
    lengths, _ = train_split(data_dir, params.data.train_ratio)
    seen = observed_samples(out)
    for epoch in range(3):
        expected = [{i for b in acc.rank_batches(lengths, total_seq_len=96, world_size=WORLD_SIZE, rank=r, seed=0,
                                                  epoch=epoch) for i in b} for r in range(WORLD_SIZE)]
        got = [set(seen[epoch][r]) for r in range(WORLD_SIZE)]
        assert got == expected, f"epoch {epoch}: a rank's samples differ from speculators' sampler"
        assert sum(map(len, got)) == len(set().union(*got)), f"epoch {epoch}: ranks share samples"
        assert len(set().union(*got)) == accounting.epochs[epoch].samples_used
    assert json.loads((out / "accounting-check.json").read_text())["observed_steps"] == accounting.total_steps
