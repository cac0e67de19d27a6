"""A hub target's code and weights are pinned: `target.revision` (a commit hash) is required with
trust_remote_code, used at every load (transformers' kwargs, vLLM's flags, the hub cache's
snapshot folder for loaders that take no revision) and part of the store's and run's keys."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from draftlab.params import ParamsError, parse_params

COMMIT = "0123456789abcdef0123456789abcdef01234567"
OTHER = "fedcba9876543210fedcba9876543210fedcba98"


def hub(**target):
    return parse_params({"target": {"source": "hub", "path": "org/model", **target}})


def test_trust_remote_code_without_a_revision_is_refused_before_any_load_in_one_line_saying_why(tmp_path):
    """Every path to the target (resolve, the from_pretrained kwargs, the vLLM server) refuses it;
    the params themselves load (a profile can be planned before its commit is chosen)."""
    from draftlab.models import resolve, revision_kwargs
    from draftlab.store import vllm_extract

    params = hub(trust_remote_code=True)
    for load in (lambda: resolve(params, tmp_path), lambda: revision_kwargs(params),
                 lambda: vllm_extract.server_command(params, python="python", model="m", num_layers=8,
                                                     hidden_states_path=tmp_path)):
        with pytest.raises(ParamsError) as err:
            load()
        line = str(err.value)
        assert "\n" not in line and line.startswith("target.trust_remote_code: runs the hub's code")
        assert "set target.revision to the commit hash" in line
    assert revision_kwargs(hub(trust_remote_code=True, revision=COMMIT))["revision"] == COMMIT


@pytest.mark.parametrize("target, needle", [
    ({"revision": "main"}, "'main' is not a commit hash"),
    ({"revision": COMMIT[:12]}, "is not a commit hash"),
])
def test_a_revision_must_be_a_full_commit_hash(target, needle):
    with pytest.raises(ParamsError, match=needle):
        hub(**target)


def test_only_a_hub_target_takes_a_revision():
    with pytest.raises(ParamsError, match="revision: only a hub target has one"):
        parse_params({"target": {"source": "local", "path": "m", "revision": COMMIT}})


def test_every_transformers_load_and_the_vllm_server_get_the_revision(monkeypatch):
    from draftlab.models import revision_kwargs
    from draftlab.store import vllm_extract

    params = hub(trust_remote_code=True, revision=COMMIT)
    assert revision_kwargs(params) == {"trust_remote_code": True, "revision": COMMIT}
    assert revision_kwargs(parse_params({})) == {"trust_remote_code": False}
    cmd = vllm_extract.server_command(params, python="python", model="org/model", num_layers=32,
                                      hidden_states_path=Path("/tmp/hs"))
    for flag in ("--revision", "--code-revision", "--tokenizer-revision"):
        assert cmd[cmd.index(flag) + 1] == COMMIT
    from draftlab.serve import serving, vllm_env

    monkeypatch.setenv(vllm_env.PYTHON_ENV, sys.executable)  # the command only, nothing is started
    served = serving.vllm_serve_command("org/model", "/d", num_speculative_tokens=3, gpu_memory_utilization=0.8,
                                        speculative=True, gpu=True, revision=COMMIT, trust_remote_code=True)
    assert "--trust-remote-code" in served
    for flag in ("--revision", "--code-revision", "--tokenizer-revision"):
        assert served[served.index(flag) + 1] == COMMIT, "evaluate's vLLM server loads the pinned commit too"


def test_a_cached_pinned_commit_resolves_to_its_snapshot_folder(tmp_path, monkeypatch):
    """Loaders that take no revision (the trainer's verifier, a vLLM server given a path) read the
    pinned commit's files: resolve() names its folder in the hub cache."""
    from draftlab.models import resolve

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as hc

    monkeypatch.setattr(hc, "HF_HUB_CACHE", str(tmp_path))
    snap = tmp_path / "models--org--model" / "snapshots" / COMMIT
    snap.mkdir(parents=True)
    (snap / "config.json").write_text("{}")
    assert Path(resolve(hub(revision=COMMIT), tmp_path)) == snap
    assert resolve(hub(revision=OTHER), tmp_path) == "org/model", "not cached: the id, loaded by revision"
    assert resolve(hub(), tmp_path) == "org/model"


def test_the_revision_is_part_of_the_store_key_and_the_run_key(tmp_path):
    from draftlab.store.capture import target_identity
    from draftlab.training.job import run_key

    assert target_identity(hub(revision=COMMIT), tmp_path) != target_identity(hub(revision=OTHER), tmp_path)
    assert target_identity(hub(), tmp_path) == {"hub_id": "org/model"}, "an unpinned target's key is unchanged"
    (tmp_path / "data").mkdir()
    keys = {run_key(hub(revision=r), "sha", tmp_path / "data") for r in (COMMIT, OTHER)}
    assert len(keys) == 2


def test_the_exports_readme_serves_a_pinned_hub_target_at_its_commit():
    from draftlab.serve import draft_export

    line = draft_export.serve_command("org/model", "models/draft", 3, revision=COMMIT, trust_remote_code=True)
    words = line.split()
    assert words[:3] == ["vllm", "serve", "org/model"] and "--trust-remote-code" in words
    assert all(words[words.index(f) + 1] == COMMIT for f in ("--revision", "--code-revision", "--tokenizer-revision"))
    assert "--revision" not in draft_export.serve_command("models/target", "models/draft", 3)
