"""The registry and lineage (draftlab.registry) against a real MLflow sqlite store: an export is a
version of the target's registered model with its figures, `models:/<name>@<alias>` downloads
the very folder, a sweep's alias moves only when beaten, two runs on the same data show the same
dataset digest, and an outage's spool imported twice registers nothing twice.

The draft folder here is a stand-in with the files export writes (config.json, weights,
export.json); tests/integration/test_registry_ui.py registers real trained drafts."""

import filecmp
import json
from pathlib import Path

import pytest

from draftlab.registry import replay
from draftlab.rundir import (ExportRecord, Manifest, PrepareRecord, RunDir, StoreDir, TargetInfo, TrainRecord,
                             export_record, prepare_record)
from tests.conftest import tiny_params


@pytest.fixture
def layout(tmp_path):
    """(draft_dir, train_dir, store_dir, data_dir, reports_dir) as the stages leave them; the
    records' run id is set by `for_run`."""
    draft, train, store, data, reports = (tmp_path / n for n in ("draft", "train", "store", "prepared", "reports"))
    for d in (draft, train, store, data, reports):
        d.mkdir()
    (draft / "config.json").write_text(json.dumps({"draft_vocab_size": 64, "speculators_model_type": "eagle3"}))
    (draft / "model.safetensors").write_bytes(bytes(range(256)) * 16)
    StoreDir(store).manifest.write(Manifest(key="k", target=TargetInfo(source="tiny", hidden_size=32, num_layers=8),
                                            layer_ids=[2, 4, 5], dtype="bfloat16", num_files=3, num_tokens=300,
                                            total_bytes=4096, files=[]))
    (data / "data-00000-of-00001.arrow").write_bytes(b"arrow rows")
    prepare_record(data).write(PrepareRecord(num_samples=39, num_train=35, num_val=4, num_tokens=3000,
                                             num_loss_tokens=1500, skipped_records=0, dropped_no_assistant_tokens=0,
                                             regenerated=True, wall_clock_s=1.0))
    return draft, train, store, data, reports


def for_run(layout, run_id: str, *, evaluated: dict | None = None) -> None:
    draft, train, _, _, reports = layout
    RunDir(train).train.write(TrainRecord(run_id=run_id, checkpoint="/ckpt", total_steps=40, world_size=2,
                                          wall_clock_s=7200.0, torchrun_wall_s=3600.0, tokens_per_s=10.0,
                                          accounting="verified", bottleneck="unknown"))
    export_record(draft).write(ExportRecord(run_id=run_id, checkpoint="/ckpt", verifier_path="org/target",
                                            layer_ids=[2, 4, 5], num_speculative_tokens=3, dtype="bfloat16",
                                            serve_command="vllm serve org/target"))
    if evaluated is not None:
        (reports / "metrics.json").write_text(json.dumps({**evaluated, "run_id": run_id}))


@pytest.fixture
def mlflow_store(store_uri, monkeypatch):
    import mlflow

    monkeypatch.setenv("MLFLOW_TRACKING_URI", store_uri)
    mlflow.set_tracking_uri(store_uri)
    client = mlflow.MlflowClient(store_uri)
    client.experiment = client.create_experiment("draftlab")
    return client


EVALUATED = {"eval/simulated_acc_len": 1.4234, "eval/measured_acc_len": 1.38, "eval/full_acc_0": 0.3,
             "eval/full_acc_1": 0.1, "eval/full_acc_2": 0.02, "eval/accept_rate_0": 0.4, "eval/accept_rate_1": 0.12,
             "eval/accept_rate_2": 0.07, "eval/vllm_measured_acc_len": 1.36, "eval/vllm_accept_rate_0": 0.39}


def _register(params, layout, run_id, reports=True):
    from draftlab.registry.drafts import register_export
    from draftlab.tracking import MlflowTracker

    draft, train, store, _, reports_dir = layout
    tracker = MlflowTracker(run_id, spool=draft.parent / "spool.jsonl")
    line = register_export(params, tracker, draft_dir=draft, train_dir=train, store_dir=store,
                           reports_dir=reports_dir if reports else None)
    return line, tracker


def test_an_export_is_a_version_with_its_figures_and_its_alias_downloads_the_very_folder(layout, mlflow_store, tmp_path):
    import mlflow

    params = tiny_params()
    run_id = mlflow_store.create_run(mlflow_store.experiment).info.run_id
    for_run(layout, run_id, evaluated=EVALUATED)
    line, _ = _register(params, layout, run_id)
    assert line.startswith("registered as tiny-eagle3 version 1 (models:/tiny-eagle3/1)")

    (version,) = mlflow_store.search_model_versions("name='tiny-eagle3'")
    assert version.run_id == run_id
    tags = version.tags
    assert (tags["acceptance.simulated"], tags["acceptance.measured"], tags["acceptance.vllm"]) == \
        ("1.423", "1.380", "1.360")
    assert json.loads(tags["acceptance.per_position"]) == [0.4, 0.12, 0.07]
    assert json.loads(tags["acceptance.simulated_per_position"]) == [0.3, 0.1, 0.02]
    assert json.loads(tags["acceptance.vllm_per_position"]) == [0.39]
    assert (tags["draft.vocab_size"], json.loads(tags["draft.layer_ids"]), tags["store.dtype"]) == \
        ("64", [2, 4, 5], "bfloat16")
    assert (tags["train.tokens"], tags["train.hours"], tags["train.world_size"]) == ("36000", "2.0000", "2")
    assert "simulated 1.423, measured 1.380, vLLM 1.360" in version.description
    (model,) = mlflow_store.search_logged_models([mlflow_store.experiment])
    assert model.source_run_id == run_id and model.model_type == "eagle3-draft"

    mlflow_store.set_registered_model_alias("tiny-eagle3", "prod", "1")
    got = Path(mlflow.artifacts.download_artifacts("models:/tiny-eagle3@prod", dst_path=str(tmp_path / "dl")))
    draft = layout[0]
    assert sorted(p.name for p in got.iterdir()) == sorted(p.name for p in draft.iterdir())
    cmp = filecmp.dircmp(draft, got)
    assert not (cmp.diff_files or cmp.left_only or cmp.right_only)
    assert all(filecmp.cmp(draft / f, got / f, shallow=False) for f in cmp.common_files)

    # the same folder again (an export rerun): the same version, its figures refreshed
    for_run(layout, run_id, evaluated={**EVALUATED, "eval/measured_acc_len": 1.5})
    assert _register(params, layout, run_id)[0].startswith("registered as tiny-eagle3 version 1 ")
    (again,) = mlflow_store.search_model_versions("name='tiny-eagle3'")
    assert again.tags["acceptance.measured"] == "1.500"
    assert len(mlflow_store.search_logged_models([mlflow_store.experiment])) == 1
    # a model logged whose version never came (killed between the two): the model is reused
    mlflow_store.delete_model_version("tiny-eagle3", "1")
    assert _register(params, layout, run_id)[0].startswith("registered as tiny-eagle3 version 2 ")
    assert len(mlflow_store.search_logged_models([mlflow_store.experiment])) == 1
    # another draft: a new version
    (draft / "model.safetensors").write_bytes(b"other weights")
    assert _register(params, layout, run_id)[0].startswith("registered as tiny-eagle3 version 3 ")


def test_a_report_of_another_run_is_not_this_drafts_figures(layout, mlflow_store):
    run_id = mlflow_store.create_run(mlflow_store.experiment).info.run_id
    for_run(layout, run_id)
    (layout[4] / "metrics.json").write_text(json.dumps({**EVALUATED, "run_id": "another"}))
    params = tiny_params(export={"registered_model": "team.draft-1"})
    line, _ = _register(params, layout, run_id)
    (version,) = mlflow_store.search_model_versions("name='team.draft-1'")
    assert not any(k.startswith("acceptance.") for k in version.tags)
    assert "not evaluated" in version.description and "not evaluated" in line


def test_the_default_name_is_the_targets():
    from draftlab.registry.drafts import default_model_name

    assert default_model_name(tiny_params()) == "tiny-eagle3"
    assert default_model_name(tiny_params(target={"source": "hub", "path": "moonshotai/Kimi-K2.5"})) == "Kimi-K2.5-eagle3"


def test_an_alias_moves_only_to_a_better_objective(layout, mlflow_store):
    from draftlab.registry.drafts import alias_best

    params = tiny_params()
    runs = []
    for weights in (b"a", b"b", b"c"):
        run_id = mlflow_store.create_run(mlflow_store.experiment).info.run_id
        for_run(layout, run_id)
        (layout[0] / "model.safetensors").write_bytes(weights)
        _register(params, layout, run_id)
        runs.append(run_id)

    def best(run_id, value, metric="val/loss"):
        return alias_best(mlflow_store, name="tiny-eagle3", alias="best-s", run_id=run_id, metric=metric,
                          direction="minimize", value=value)[:2]

    def holder():
        return str(mlflow_store.get_model_version_by_alias("tiny-eagle3", "best-s").version)

    assert best(runs[0], 2.0) == ("1", True) and holder() == "1"
    assert best(runs[1], 2.5) == ("2", False) and holder() == "1", "a worse sweep leaves it"
    assert best(runs[1], 2.0) == ("2", False) and holder() == "1", "a tie leaves it"
    assert best(runs[2], 1.5) == ("3", True) and holder() == "3", "a better one takes it"
    assert best(runs[2], 1.5) == ("3", False) and holder() == "3", "naming it again changes nothing"
    assert best(runs[0], 9.0, metric="eval/measured_acc_len") == ("1", True), "won on another metric: replaced"


def test_two_runs_on_the_same_data_show_the_same_digests(layout, mlflow_store):
    from draftlab.registry import lineage
    from draftlab.store import layout as store_layout
    from draftlab.store.capture import dataset_fingerprint
    from draftlab.tracking import MlflowTracker

    _, _, store, data, _ = layout
    seen = []
    for _ in range(2):
        run_id = mlflow_store.create_run(mlflow_store.experiment).info.run_id
        tracker = MlflowTracker(run_id)
        datasets = [lineage.prepared_dataset(data, split="train", train_ratio=0.9, context="training"),
                    lineage.store_dataset(store, context="training")]
        lineage.log_inputs(tracker, datasets)
        lineage.log_inputs(tracker, datasets)  # a resumed training logs them again
        lineage.log_inputs(tracker, [lineage.prepared_dataset(data, split="val", train_ratio=0.9, context="evaluation")])
        inputs = mlflow_store.get_run(run_id).inputs.dataset_inputs
        seen.append({(i.dataset.name, i.dataset.digest, i.tags[0].value) for i in inputs})
        assert len(inputs) == 3, "one input per dataset, however often it is logged"
    assert seen[0] == seen[1]
    digests = {name: digest for name, digest, _ in seen[0]}
    assert digests["hidden-states"] == store_layout.manifest_hash(store)[:32]
    assert digests["prepared.train"] == digests["prepared.val"] == dataset_fingerprint(data)[:32]
    assert {(name, context) for name, _, context in seen[0]} == {
        ("prepared.train", "training"), ("hidden-states", "training"), ("prepared.val", "evaluation")}


def test_an_outage_spools_registration_alias_and_inputs_and_importing_twice_registers_once(
        layout, mlflow_store, store_uri, monkeypatch, tmp_path):
    from draftlab.registry import lineage
    from draftlab.registry.drafts import name_best
    from draftlab.tracking import MlflowTracker, replay_spool

    run_id = mlflow_store.create_run(mlflow_store.experiment).info.run_id
    sweep_run = mlflow_store.create_run(mlflow_store.experiment).info.run_id
    for_run(layout, run_id, evaluated=EVALUATED)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "2")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:9")  # nothing listens on port 9
    line, tracker = _register(tiny_params(), layout, run_id)
    assert line is None and tracker.offline
    lineage.log_inputs(tracker, [lineage.store_dataset(layout[2], context="training")])
    sweep = MlflowTracker(sweep_run, spool=tmp_path / "sweep-spool.jsonl")
    name_best(sweep, tiny_params(), study="s", metric="val/loss", direction="minimize", value=1.0, run_id=run_id)
    kinds = [json.loads(rec)["kind"] for rec in (layout[0].parent / "spool.jsonl").read_text().splitlines()]
    assert kinds == ["register", "inputs"]

    monkeypatch.setenv("MLFLOW_TRACKING_URI", store_uri)
    for _ in range(2):  # an import twice
        assert replay_spool(layout[0].parent / "spool.jsonl", replay_registry=replay) == 2
        assert replay_spool(tmp_path / "sweep-spool.jsonl", replay_registry=replay) == 1
    (version,) = mlflow_store.search_model_versions("name='tiny-eagle3'")
    assert version.tags["acceptance.simulated"] == "1.423"
    assert str(mlflow_store.get_model_version_by_alias("tiny-eagle3", "best-s").version) == str(version.version)
    assert len(mlflow_store.search_logged_models([mlflow_store.experiment])) == 1
    assert len(mlflow_store.get_run(run_id).inputs.dataset_inputs) == 1


def test_a_spooled_registration_of_a_folder_exported_over_since_is_not_registered(layout, mlflow_store, store_uri,
                                                                                   monkeypatch, capsys):
    from draftlab.tracking import replay_spool

    run_id = mlflow_store.create_run(mlflow_store.experiment).info.run_id
    for_run(layout, run_id)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:9")
    _register(tiny_params(), layout, run_id)
    (layout[0] / "model.safetensors").write_bytes(b"a later export")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store_uri)
    replay_spool(layout[0].parent / "spool.jsonl", replay_registry=replay)
    assert not mlflow_store.search_model_versions("name='tiny-eagle3'")
    assert "changed since run" in " ".join(capsys.readouterr().err.split())


def test_a_sweeps_end_names_its_best_and_says_how_to_load_it(layout, mlflow_store, capsys, tmp_path):
    from draftlab.registry.drafts import name_best
    from draftlab.tracking import MlflowTracker

    run_id = mlflow_store.create_run(mlflow_store.experiment).info.run_id
    sweep = MlflowTracker(mlflow_store.create_run(mlflow_store.experiment).info.run_id, spool=tmp_path / "s.jsonl")
    name_best(sweep, tiny_params(), study="lr search", metric="val/loss", direction="minimize", value=1.0,
              run_id=run_id)
    assert "no alias set" in " ".join(capsys.readouterr().err.split()), "a best trial without a version: said"
    assert not (tmp_path / "s.jsonl").exists(), "and not mistaken for an outage"

    for_run(layout, run_id)
    _register(tiny_params(), layout, run_id)
    name_best(sweep, tiny_params(), study="lr search", metric="val/loss", direction="minimize", value=1.0,
              run_id=run_id)
    said = " ".join(capsys.readouterr().err.split())
    assert "best-lr-search → tiny-eagle3 version 1" in said
    assert "mlflow artifacts download --artifact-uri 'models:/tiny-eagle3@best-lr-search'" in said
    assert str(mlflow_store.get_model_version_by_alias("tiny-eagle3", "best-lr-search").version) == "1"


def test_the_registry_package_imports_what_its_docstring_allows():
    """draftlab/registry/__init__: the shared core and `store.layout`; never a stage."""
    import ast

    import draftlab.registry

    allowed = {"draftlab.params", "draftlab.rundir", "draftlab.tracking", "draftlab.errors", "draftlab.util",
               "draftlab.console", "draftlab.store", "draftlab.store.layout", "draftlab.store.capture",
               "draftlab.registry", "draftlab.registry.drafts", "draftlab.registry.lineage"}
    found = set()
    for path in Path(draftlab.registry.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "draftlab":
                found.update(f"draftlab.{a.name}" for a in node.names)
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("draftlab"):
                found.add(node.module)
            elif isinstance(node, ast.Import):
                found.update(a.name for a in node.names if a.name.startswith("draftlab"))
    assert found <= allowed, f"imports beyond its contract: {sorted(found - allowed)}"
