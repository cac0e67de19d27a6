"""Multi-node training's rules that need no process: which params are valid, who hosts the
rendezvous, what a resume keys on, where each node keeps its files, and `--node-rank`."""

from __future__ import annotations

import pytest

from tests.conftest import tiny_params


def two_nodes(node_rank: int = 0, endpoint: str = "gpu-a:29500"):
    return tiny_params(train={"gpus": 8, "nnodes": 2, "node_rank": node_rank, "rdzv_endpoint": endpoint})


@pytest.mark.parametrize("train, message", [
    ({"nnodes": 2}, "train: .*nnodes 2 needs rdzv_endpoint"),
    ({"nnodes": 2, "node_rank": 2, "rdzv_endpoint": "h:1"}, "train: .*node_rank 2 is not below nnodes 2"),
    ({"node_rank": 1}, "node_rank 1 is not below nnodes 1"),
])
def test_node_params_are_refused_with_the_key(train, message):
    from draftlab.params import ParamsError

    with pytest.raises(ParamsError, match=message):
        tiny_params(train=train)


def test_node_0_hosts_the_rendezvous_and_the_others_connect():
    from draftlab.training import launch

    def conf(cmd):
        return cmd[cmd.index("--rdzv-conf") + 1]

    assert conf(launch.torchrun_cmd(two_nodes(0), [])) == "is_host=true"
    assert conf(launch.torchrun_cmd(two_nodes(1), [])) == "is_host=false"


def test_a_node_rank_or_rendezvous_address_does_not_change_what_a_folder_resumes(tmp_path, monkeypatch):
    from draftlab.store import capture
    from draftlab.training import job as train

    monkeypatch.setattr(capture, "dataset_fingerprint", lambda path: "the dataset")
    data_dir = tmp_path
    key = train.run_key(two_nodes(0), "sha", data_dir)
    assert train.run_key(two_nodes(1, "gpu-b:29600"), "sha", data_dir) == key
    assert train.run_key(tiny_params(train={"gpus": 8, "nnodes": 1}), "sha", data_dir) != key, \
        "the world size does"


def test_each_node_has_its_own_lock_launch_and_pid_folders(tmp_path):
    from draftlab.rundir import RunDir

    rd = RunDir(tmp_path)
    name = tmp_path.name
    assert (rd.lock_path(0).name, rd.launch_file(0).path.name, rd.node_dir(0)) == (f".{name}.lock", "launch.json", tmp_path)
    assert (rd.lock_path(1).name, rd.launch_file(1).path.name, rd.node_dir(1)) == \
        (f".{name}.lock-node1", "launch-node1.json", tmp_path / "node1")
    assert rd.lock_path(0).parent == rd.lock_path(1).parent == tmp_path.parent, "beside the folder: never moved with it"


def test_node_1_can_hold_its_lock_while_node_0_takes_its_own(tmp_path):
    from draftlab.training.launch import exclusive

    with exclusive(tmp_path, 1), exclusive(tmp_path, 0):
        with pytest.raises(Exception, match="another `draftlab train`"):
            with exclusive(tmp_path, 1):
                pass


def test_node_rank_flag_overrides_params(tmp_path, monkeypatch):
    import yaml
    from typer.testing import CliRunner

    from draftlab import cli
    from draftlab.stages import train

    seen = {}
    monkeypatch.setattr(train, "run", lambda p, **kw: seen.update(train=p.train))
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(two_nodes(0).model_dump()))
    result = CliRunner().invoke(cli.app, ["train", "--params", str(path), "--node-rank", "1",
                                          "--rdzv-endpoint", "gpu-a:29600"])
    assert result.exit_code == 0, result.output
    assert (seen["train"].node_rank, seen["train"].rdzv_endpoint) == (1, "gpu-a:29600")
    bad = CliRunner().invoke(cli.app, ["train", "--params", str(path), "--node-rank", "2"])
    assert bad.exit_code == 2 and "node_rank 2 is not below nnodes 2" in bad.output
