"""draftlab.rundir: the run-folder files round-trip, a damaged one is one line naming it and what
to do (exit 2 from the CLI), and a store manifest without its 3 layer ids cannot be written."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from draftlab.errors import RunFileError, UserError
from draftlab.rundir import (
    AccountingCheck,
    Command,
    ExportRecord,
    Failure,
    Launch,
    Manifest,
    PrepareRecord,
    RankDone,
    RankPlan,
    RunDir,
    RunState,
    StoreDir,
    TargetInfo,
    Timing,
    TrainRecord,
    TrialDir,
    TrialInfo,
    TrialResult,
    export_record,
    prepare_record,
)

TRAIN = TrainRecord(run_id="r1", checkpoint="/runs/train/checkpoints/2", total_steps=12, world_size=2,
                    wall_clock_s=3.5, tokens_per_s=100.0, accounting="verified", bottleneck="compute-bound",
                    calibration=False, timing={"wall_s": 3.5}, harness_cpu={"total_s": 0.2, "rank0": {}})


def manifest(**kw) -> Manifest:
    fields = dict(key="k" * 64, target=TargetInfo(path=None, source="tiny", num_layers=8, hidden_size=32,
                                                   vocab_size=303),
                  layer_ids=[2, 4, 5], dtype="bfloat16", num_files=1, num_tokens=7, total_bytes=1000,
                  files=[{"index": 0, "name": "hs_0.safetensors", "bytes": 1000, "sha256": "0" * 64, "tokens": 7}])
    return Manifest(**{**fields, **kw})


RECORDS = [
    (lambda d: RunDir(d).run, RunState(key="abc", run_id="r1")),
    (lambda d: RunDir(d).launch_file(), Launch(pgid=4242)),
    (lambda d: RunDir(d).launch_file(node_rank=1), Launch(pgid=4343)),
    (lambda d: RunDir(d).plan, RankPlan(total_steps=3, step_tokens=[10, 9, 8], epoch_steps=[3], val_steps=1,
                                        optimizer="Muon", verify_reads="header")),
    (lambda d: RunDir(d).accounting_check, AccountingCheck(problems=[], observed_steps=None)),
    (lambda d: RunDir(d).failure, Failure(reason="non-finite loss", message="train/loss is nan at step 3")),
    (lambda d: RunDir(d).command, Command(cmd=["python", "-m", "torch.distributed.run"])),
    (lambda d: RunDir(d).timing, Timing({"wall_s": 9.0, "step_s": 0.25})),
    (lambda d: RunDir(d).rank_done, RankDone(harness_cpu_s={"MetricsToTracker": 0.5})),
    (lambda d: RunDir(d).train, TRAIN),
    (lambda d: StoreDir(d).manifest, manifest()),
    (prepare_record, PrepareRecord(num_samples=39, num_train=35, num_val=4, num_tokens=2000, num_loss_tokens=900,
                                   skipped_records=0, dropped_no_assistant_tokens=1, regenerated=True,
                                   regenerate_compute=None, wall_clock_s=4.2)),
    (export_record, ExportRecord(run_id="r1", checkpoint="/c", verifier_path="/t", layer_ids=[2, 4, 5],
                                 num_speculative_tokens=3, dtype="bfloat16", serve_command="vllm serve /t")),
    (lambda d: TrialDir(d).info, TrialInfo(number=3, values={"train.lr": 0.001}, devices=["0"], role="search")),
    (lambda d: TrialDir(d).result, TrialResult(ok=False, message="stopped by the sweep (SIGTERM)", wall_s=2.0)),
]


@pytest.mark.parametrize("file_of,record", RECORDS, ids=lambda x: type(x).__name__ if not callable(x) else "")
def test_every_record_reads_back_as_written_and_keeps_its_bytes(tmp_path, file_of, record):
    f = file_of(tmp_path)
    f.write(record)
    assert f.read() == record
    first = f.path.read_bytes()
    f.write(f.read())  # read and written again: the same file
    assert f.path.read_bytes() == first
    assert not list(f.path.parent.glob(".*.tmp-*")), "an atomic write leaves no scratch file"


def test_fields_a_writer_did_not_give_are_left_out_not_written_as_null(tmp_path):
    store = StoreDir(tmp_path)
    store.manifest.write(manifest())  # the vllm backend knows no compute placement
    assert "compute" not in store.manifest.path.read_text()
    assert store.manifest.read().compute is None


@pytest.mark.parametrize("text,why", [
    ("", "empty"),
    ('{"run_id": "r1", "checkpoint": "/x", "total_st', "partial or not JSON"),  # torn by a kill
    ('{"run_id": "r1"}', "malformed (checkpoint: Field required (and"),
    ('{"run_id": 5, "checkpoint": "/x", "total_steps": 1, "world_size": 1, "wall_clock_s": 1, "tokens_per_s": 1, '
     '"accounting": "verified", "bottleneck": "x"}', "malformed (run_id: Input should be a valid string)"),
    ('[1, 2]', "malformed (the top level: Input should be"),
])
def test_a_damaged_file_is_one_line_naming_it_and_what_to_do(tmp_path, text, why):
    f = RunDir(tmp_path).train
    f.path.write_text(text)
    with pytest.raises(RunFileError) as err:
        f.read()
    message = str(err.value)
    assert message.startswith(f"{f.path}: {why}") and "\n" not in message
    assert "run `draftlab train` (or `dvc repro train`)" in message
    assert isinstance(err.value, UserError) and err.value.exit_code == 2
    assert f.peek() is None  # a watcher of a running process sees "not yet", not an error


def test_a_missing_file_names_the_command_that_writes_it(tmp_path):
    with pytest.raises(RunFileError, match=r"manifest.json: not found; run `draftlab extract`"):
        StoreDir(tmp_path).manifest.read()
    assert StoreDir(tmp_path).manifest.read_or_none() is None


def test_a_store_manifest_without_its_three_layer_ids_cannot_be_written(tmp_path):
    """The vllm backend once wrote `layer_ids: null` (params left them to the server's default),
    which `train` turned into a crash: the model refuses it before any file exists."""
    for bad in (None, [2, 4], [2, 4, 5, 6]):
        with pytest.raises(ValidationError, match="layer_ids"):
            manifest(layer_ids=bad)
    assert not StoreDir(tmp_path).manifest.exists()
    with pytest.raises(TypeError):
        StoreDir(tmp_path).manifest.write({"layer_ids": None})  # a dict is not a record
    assert not StoreDir(tmp_path).manifest.exists()


def test_a_hand_edited_manifest_with_null_layer_ids_is_refused_on_read_in_one_line(tmp_path):
    store = StoreDir(tmp_path)
    store.manifest.write(manifest())
    store.manifest.path.write_text(store.manifest.path.read_text().replace("[\n    2,\n    4,\n    5\n  ]", "null"))
    with pytest.raises(RunFileError, match=r"manifest.json: malformed \(layer_ids: .*\); run `draftlab extract`"):
        store.manifest.read()


def test_lock_and_launch_files_are_per_node_with_node_zero_the_single_node_names(tmp_path):
    rd = RunDir(tmp_path)
    assert rd.lock_path().name == f".{rd.path.name}.lock" and rd.launch_file().path.name == "launch.json"
    names = {rd.lock_path(1).name, rd.launch_file(1).path.name, rd.lock_path(2).name, rd.launch_file(2).path.name}
    assert len(names) == 4 and not names & {f".{rd.path.name}.lock", "launch.json"}


def test_the_vllm_backend_records_the_layer_ids_the_server_used_and_train_reads_them(tmp_path, monkeypatch):
    """extract.layer_ids unset: the server captures the default [2, L//2, L-3], and the manifest
    says so (the one writer both backends share), so `train` gets real ids, not null."""
    import torch
    from datasets import Dataset
    from safetensors.torch import save_file

    from draftlab.stages import extract
    from draftlab.store import layout as store
    from draftlab.store import vllm_extract
    from draftlab.training import job
    from tests.conftest import tiny_params

    params = tiny_params(extract={"backend": "vllm", "vllm_url": "http://127.0.0.1:1", "layer_ids": None})
    data_dir, store_dir = tmp_path / "prepared", tmp_path / "hs"
    rows = [[1, 2, 3], [4, 5]]
    Dataset.from_dict({"input_ids": rows, "loss_mask": [[0, 1, 1], [1, 1]],
                       "seq_len": [3, 2]}).save_to_disk(str(data_dir))

    def generator(params, *, target_dir, data_dir, out_dir):  # what speculators' generator moves in
        for i, ids in enumerate(rows):
            save_file({"hidden_states": torch.zeros(len(ids), 4, 32, dtype=torch.bfloat16),
                       "token_ids": torch.tensor(ids, dtype=torch.int64)}, str(out_dir / store.file_name(i)))
        return 0.0, 1.0

    monkeypatch.setattr(vllm_extract, "run", generator)
    checked = extract.Checked(num_layers=8, hidden_size=32, vocab_size=303,
                              layer_ids=extract.resolve_layer_ids(params.extract.layer_ids, 8),
                              key_fields={}, key="unused")
    result = extract._run_vllm(params, checked, target_dir=tmp_path / "target", data_dir=data_dir, out_dir=store_dir)
    written = store.read_manifest(store_dir)
    assert result.num_files == 2 and written.num_tokens == 5
    assert written.layer_ids == [2, 4, 5] and written.target.num_layers == 8
    assert job.check_layer_ids(params, written, store_dir) == [2, 4, 5]
    assert store.verify(store_dir) == []


def test_a_vllm_file_of_other_tokens_is_refused_and_not_journaled(tmp_path, monkeypatch):
    """A server of another dataset or tokenizer: one line naming the file, no manifest."""
    import pytest
    import torch
    from datasets import Dataset
    from safetensors.torch import save_file

    from draftlab.errors import MissingInput
    from draftlab.stages import extract
    from draftlab.store import layout as store
    from draftlab.store import vllm_extract
    from tests.conftest import tiny_params

    params = tiny_params(extract={"backend": "vllm", "vllm_url": "http://127.0.0.1:1"})
    data_dir = tmp_path / "prepared"
    Dataset.from_dict({"input_ids": [[1, 2, 3]], "loss_mask": [[0, 1, 1]], "seq_len": [3]}).save_to_disk(str(data_dir))

    def generator(params, *, target_dir, data_dir, out_dir):
        save_file({"hidden_states": torch.zeros(3, 4, 32, dtype=torch.bfloat16),
                   "token_ids": torch.tensor([1, 2, 9])}, str(out_dir / store.file_name(0)))
        return 0.0, 1.0

    monkeypatch.setattr(vllm_extract, "run", generator)
    checked = extract.Checked(num_layers=8, hidden_size=32, vocab_size=303, layer_ids=[2, 4, 5], key_fields={},
                              key="k")
    with pytest.raises(MissingInput, match=r"hs_0.safetensors: not the hidden states of row 0 of the dataset"):
        extract._run_vllm(params, checked, target_dir=tmp_path, data_dir=data_dir, out_dir=tmp_path / "hs")
    assert not store.has_manifest(store.work_dir(tmp_path / "hs"))


def test_the_cli_answers_a_torn_train_record_with_one_line_and_exit_2(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from draftlab.cli import app

    monkeypatch.chdir(tmp_path)
    (tmp_path / "params.yaml").write_text("train: {gpus: 1}\n")
    train = RunDir(tmp_path / "runs" / "train").train
    train.path.parent.mkdir(parents=True)
    train.path.write_text('{"run_id": "r1", "check')
    result = CliRunner().invoke(app, ["export"])
    assert result.exit_code == 2
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and "train.json: partial or not JSON" in lines[0] and "dvc repro train" in lines[0]


def test_a_spool_torn_by_a_kill_keeps_every_whole_record_and_takes_new_ones(tmp_path):
    from draftlab.rundir import append_spool, read_spool

    spool = tmp_path / "run" / "tracking-spool.jsonl"
    append_spool(spool, {"run_id": "r", "kind": "metrics", "metrics": {"train/loss": 2.0}, "step": 0, "timestamp": 1})
    with open(spool, "a") as f:
        f.write('{"run_id": "r", "kind": "metrics", "metr')  # a kill or a full disk mid-line
    assert [r.step for r in read_spool(spool)] == [0], "the torn line is a record never made, not a bad spool"
    append_spool(spool, {"run_id": "r", "kind": "metrics", "metrics": {"train/loss": 1.0}, "step": 1, "timestamp": 2})
    assert [r.step for r in read_spool(spool)] == [0, 1] and len(spool.read_text().splitlines()) == 2


def test_a_spool_line_naming_a_file_outside_its_folder_is_refused_and_nothing_uploaded(tmp_path):
    from draftlab.rundir import append_spool, read_spool, spool_folder

    run = tmp_path / "runs" / "train"
    (run / "checkpoints").mkdir(parents=True)
    (run / "accounting.json").write_text("{}")
    secret = tmp_path / "home" / ".ssh" / "id_rsa"
    secret.parent.mkdir(parents=True)
    secret.write_text("key")
    (run / "checkpoints" / "link").symlink_to(secret)  # inside by name, outside once resolved
    spool = run / "tracking-spool.jsonl"
    append_spool(spool, {"run_id": "r", "kind": "artifact", "path": str(run / "accounting.json")})
    assert len(read_spool(spool)) == 1, "the run folder's own files are uploaded"
    for bad in (secret, run / "checkpoints" / "link"):
        append_spool(spool, {"run_id": "r", "kind": "artifact", "path": str(bad)})
        with pytest.raises(RunFileError, match=rf"tracking-spool.jsonl:2: names .*, outside {run}, the folder this "
                                               r"spool belongs to;.*\(nothing was uploaded\)"):
            read_spool(spool)
        spool.write_text(spool.read_text().splitlines()[0] + "\n")
    beside = tmp_path / "reports"
    assert spool_folder(tmp_path / ".reports.tracking-spool.jsonl") == beside and spool_folder(spool) == run
