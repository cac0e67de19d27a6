"""params.yaml loading: every bad input is one line naming the dotted key."""

from pathlib import Path

import pytest
import yaml

from draftlab.params import ParamsError, flatten, load_params, parse_params

REPO = Path(__file__).resolve().parents[2]


def write(tmp_path, raw):
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def test_repo_params_load_and_match_defaults():
    params = load_params(REPO / "params.yaml")
    assert params == parse_params({}), "params.yaml should spell out the defaults of the tiny profile"


def test_unknown_key_suggests_the_closest():
    with pytest.raises(ParamsError, match=r"unknown key 'extract.layer_id'; did you mean 'extract.layer_ids'"):
        parse_params({"extract": {"layer_id": [1, 2, 3]}})


def test_unknown_section_is_refused():
    with pytest.raises(ParamsError, match="unknown key 'trian'"):
        parse_params({"trian": {}})


def test_wrong_type_names_the_key():
    with pytest.raises(ParamsError, match=r"prepare.num_samples: .*integer.*'many'"):
        parse_params({"prepare": {"num_samples": "many"}})


@pytest.mark.parametrize("key", ["num_samples", "max_seq_len", "batch_size"])
def test_non_positive_counts_are_refused(key):
    with pytest.raises(ParamsError, match=rf"prepare.{key}: .*greater than 0"):
        parse_params({"prepare": {key: 0}})


def test_too_few_layers_for_default_aux_ids():
    with pytest.raises(ParamsError, match=r"target.tiny.num_layers"):
        parse_params({"target": {"tiny": {"num_layers": 6}}})


def test_four_aux_layers_are_refused():
    with pytest.raises(ParamsError, match=r"extract.layer_ids: .*exactly 3"):
        parse_params({"extract": {"layer_ids": [1, 2, 3, 4]}})


def test_missing_local_target_path(tmp_path):
    path = write(tmp_path, {"target": {"source": "local", "path": "no/such/model"}})
    with pytest.raises(ParamsError, match=r"target.path: 'no/such/model' does not exist"):
        load_params(path)


def test_real_target_needs_a_path():
    with pytest.raises(ParamsError, match=r"target: .*needs target.path"):
        parse_params({"target": {"source": "hub"}})


def test_hub_target_is_not_checked_on_disk(tmp_path):
    path = write(tmp_path, {"target": {"source": "hub", "path": "moonshotai/Kimi-K2.5"}})
    assert load_params(path).target.path == "moonshotai/Kimi-K2.5"


def test_invalid_yaml_gives_file_and_line(tmp_path):
    path = tmp_path / "params.yaml"
    path.write_text("prepare:\n  num_samples: [1,\n")
    with pytest.raises(ParamsError, match=r"params.yaml:\d+: not valid YAML"):
        load_params(path)


def test_flatten_gives_dotted_keys():
    flat = flatten(parse_params({}))
    assert flat["extract.dtype"] == "bfloat16"
    assert flat["target.tiny.num_layers"] == 8


def test_dvc_stages_list_exactly_the_params_they_read():
    """Each dvc.yaml stage depends on its own section and the shared keys it reads, nothing else."""
    stages = yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]
    assert stages["target"]["params"] == ["target"]
    assert "prepare" in stages["prepare"]["params"] and "extract" not in stages["prepare"]["params"]
    assert "extract" in stages["extract"]["params"] and "prepare" not in stages["extract"]["params"]
    assert "target.tiny" not in stages["extract"]["params"]  # the built model is a dep instead


@pytest.mark.parametrize("text", ["", "# only a comment\n", "{}\n"])
def test_an_empty_params_file_is_refused_not_taken_as_defaults(tmp_path, text):
    path = tmp_path / "params.yaml"
    path.write_text(text)
    with pytest.raises(ParamsError, match=r"params.yaml: empty params file"):
        load_params(path)


def test_a_duplicated_key_is_refused_with_its_line(tmp_path):
    path = tmp_path / "params.yaml"
    path.write_text("train:\n  epochs: 3\n  lr: 0.1\n  epochs: 5\n")
    with pytest.raises(ParamsError, match=r"params.yaml:4: duplicated key 'train.epochs'"):
        load_params(path)
    path.write_text("train:\n  epochs: 3\nextract: {}\ntrain:\n  lr: 0.1\n")
    with pytest.raises(ParamsError, match=r"params.yaml:4: duplicated key 'train'"):
        load_params(path)


@pytest.mark.parametrize("text", ["yes", "on", "'true'", '"1"', "Yes", "y"])
def test_a_string_is_not_a_boolean(tmp_path, text):
    """YAML 1.1's `yes`/`on` (DVC reads YAML 1.2: strings) and quoted strings are refused, in one
    line naming the key, instead of becoming true."""
    path = tmp_path / "params.yaml"
    path.write_text(f"target:\n  source: hub\n  path: org/model\n  trust_remote_code: {text}\n")
    with pytest.raises(ParamsError) as err:
        load_params(path)
    line = str(err.value)
    assert line.startswith(f"{path}: target.trust_remote_code: ") and "is a string, not a boolean" in line
    assert "\n" not in line


@pytest.mark.parametrize("text, value", [("true", True), ("false", False), ("True", True), ("FALSE", False)])
def test_true_and_false_are_booleans(tmp_path, text, value):
    path = tmp_path / "params.yaml"
    path.write_text(f"prepare:\n  regenerate: {text}\n")
    assert load_params(path).prepare.regenerate is value


def test_yes_and_no_are_strings_where_a_string_is_asked(tmp_path):
    """The same loader reads `no` as the string DVC reads, not as false."""
    from draftlab.strict_yaml import UniqueKeyLoader

    assert yaml.load("a: no\nb: on\nc: true\nd: 1", Loader=UniqueKeyLoader) == {"a": "no", "b": "on", "c": True, "d": 1}


def test_relative_paths_are_relative_to_the_params_file_wherever_it_is_loaded_from(tmp_path, monkeypatch):
    """One rule: a relative target.path or prepare.path names a file beside the params file;
    load_params returns it absolute, so a copy of the params written elsewhere (a sweep trial's
    params.yaml) names the same files."""
    from draftlab.params import Params

    (tmp_path / "models" / "t").mkdir(parents=True)
    (tmp_path / "chats.jsonl").write_text("")
    path = write(tmp_path, {"target": {"source": "local", "path": "models/t"},
                            "prepare": {"source": "jsonl", "path": "chats.jsonl"}})
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    params = load_params(path)
    assert params.target.path == str(tmp_path / "models" / "t")
    assert params.prepare.path == str(tmp_path / "chats.jsonl")
    trial = elsewhere / "trial-0000" / "params.yaml"  # what a sweep writes, then its trial re-loads
    trial.parent.mkdir()
    trial.write_text(yaml.safe_dump(params.model_dump()))
    assert load_params(trial) == params
    assert load_params(write(tmp_path, Params().model_dump())).target.path is None, "a tiny target has none"


def test_online_training_params_are_checked_with_one_line_naming_the_key():
    from draftlab.params import ParamsError, parse_params

    def raw(**train):
        return {"train": train}

    assert parse_params(raw(source="vllm")).train.vllm_url is None, "null: draftlab starts its own server"
    assert parse_params(raw(source="vllm", vllm_url="http://10.0.0.5:8000/v1")).train.vllm_url.endswith("/v1")
    for bad, says in ((raw(vllm_url="http://h:1/v1"), "set source: vllm"),
                      (raw(source="vllm", vllm_url="localhost:8000"), "not an http(s) URL"),
                      (raw(source="vllm", nnodes=2, rdzv_endpoint="h:29400"), "trains on one node"),
                      (raw(source="disk"), "train.source")):
        with pytest.raises(ParamsError) as err:
            parse_params(bad)
        assert says in str(err.value) and "\n" not in str(err.value).strip()
    with pytest.raises(ParamsError, match="--vllm-endpoint"):
        parse_params(raw(extra_args=["--vllm-endpoint", "http://h:1/v1"]))


def test_the_online_pipeline_needs_no_store_and_reads_only_keys_params_yaml_has():
    """online/dvc.yaml (`dvc repro online/dvc.yaml`): its stages never depend on the store or the
    extract stage, each names its source, and every params key it lists is in params.yaml (DVC
    refuses a stage whose key is missing there)."""
    stages = yaml.safe_load((REPO / "online" / "dvc.yaml").read_text())["stages"]
    assert set(stages) == {"train", "evaluate", "export"}, "one name per stage, as offline"
    defaults = yaml.safe_load((REPO / "params.yaml").read_text())

    def in_params_yaml(key: str) -> bool:
        node = defaults
        for part in key.split("."):
            if not isinstance(node, dict) or part not in node:
                return False
            node = node[part]
        return True
    for name, stage in stages.items():
        deps = [d if isinstance(d, str) else next(iter(d)) for d in stage.get("deps", [])]
        assert not any("hidden_states" in d or "store-check" in d for d in deps), f"{name}: {deps}"
        assert "--source vllm" in stage["cmd"] and "--store" not in stage["cmd"]
        for key in stage["params"]:
            assert in_params_yaml(key), f"online/dvc.yaml {name}: {key} is not in params.yaml"
    root_outs = {next(iter(o)) if isinstance(o, dict) else o
                 for s in yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"].values() for o in s.get("outs", [])}
    online_outs = {next(iter(o)) if isinstance(o, dict) else o for s in stages.values() for o in s.get("outs", [])}
    assert not root_outs & online_outs, "DVC refuses two stages with one output"
