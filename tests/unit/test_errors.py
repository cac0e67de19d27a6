"""One user-error type: whatever kind of user error a command meets, the CLI prints one line and
exits with that error's code (2 for bad input or a busy host, 1 for work that ran and failed)."""

from __future__ import annotations

import json
import os

import pytest
from typer.testing import CliRunner

from draftlab.cli import app
from draftlab.errors import HostError, MissingInput, RunFileError, UserError
from draftlab.params import ParamsError
from draftlab.serve.serving import ServingError
from draftlab.stages.prepare import RecordError
from draftlab.store.extract_ranks import ExtractFailed
from draftlab.sweep.space import SpaceError
from draftlab.training.job import TrainingFailed
from draftlab.training.launch import exclusive


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "params.yaml").write_text("train: {gpus: 1}\n")
    return tmp_path


@pytest.mark.parametrize("error,code", [
    (ParamsError, 2), (SpaceError, 2), (RecordError, 2), (RunFileError, 2), (HostError, 2), (MissingInput, 2),
    (ServingError, 1), (ExtractFailed, 1), (TrainingFailed, 1),
])  # fmt: skip
def test_every_user_error_is_one_line_and_its_exit_code(workdir, monkeypatch, error, code):
    def raises(train_dir):
        raise error("runs/train/train.json: what is wrong; what to do")

    monkeypatch.setattr("draftlab.tracking.run_id_of", raises)
    result = CliRunner().invoke(app, ["export"])
    assert result.exit_code == code
    assert result.output.strip().splitlines() == ["error: runs/train/train.json: what is wrong; what to do"]


def test_a_bug_is_not_dressed_as_a_user_error(workdir, monkeypatch):
    def raises(train_dir):
        raise KeyError("a programming error")

    monkeypatch.setattr("draftlab.tracking.run_id_of", raises)
    result = CliRunner().invoke(app, ["export"])
    assert result.exit_code == 1 and isinstance(result.exception, KeyError), "a bug keeps its traceback"


def test_a_second_launcher_on_one_run_folder_is_told_the_folder_is_busy(tmp_path):
    with exclusive(tmp_path):
        with pytest.raises(HostError, match=rf"another `draftlab train` \(pid {os.getpid()} on .+\) is writing this folder") as err:
            with exclusive(tmp_path):
                pass
    assert isinstance(err.value, UserError) and not isinstance(err.value, ParamsError), "no params key is wrong"
    with exclusive(tmp_path):  # released: the next one gets it
        pass


@pytest.mark.parametrize("line,why", [
    ('{"run_id": "r", "kind": "metrics", "metrics": {"train/loss": 1.0}, "st', "2: not JSON"),
    ('{"run_id": "r", "kind": "metrics", "metrics": {"train/loss": "high"}, "step": 1, "timestamp": 5}',
     "2: malformed (metrics.metrics.train/loss: Input should be a valid number"),
    ('{"run_id": "r", "kind": "weights"}', "2: malformed (the top level: Input tag 'weights' found using 'kind'"),
    ('["a", "list"]', "2: malformed"),
])  # fmt: skip
def test_tracking_import_of_a_bad_spool_is_one_line_and_uploads_nothing(workdir, monkeypatch, line, why):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{workdir / 'never-created.db'}")
    spool = workdir / "tracking-spool.jsonl"
    good = {"run_id": "r", "kind": "params", "params": {"train.lr": "0.001"}}
    spool.write_text(json.dumps(good) + "\n" + line + "\n")
    result = CliRunner().invoke(app, ["tracking-import", str(spool)])
    assert result.exit_code == 2
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {spool}:{why}") and "nothing was uploaded" in lines[0]
    assert spool.exists() and not (workdir / "never-created.db").exists(), "the spool is kept and nothing sent"
