"""The hidden-state seam (draftlab.store.hidden_states): the source a launcher names in the
trainer's flags is the one a rank rebuilds from them, so the store's path reaches the ranks once."""

from __future__ import annotations

from pathlib import Path

import pytest

from draftlab.rundir import RankPlan
from draftlab.store import layout as store
from draftlab.store.hidden_states import HiddenStateSource, StoreSource, source_from_trainer_args
from draftlab.training.job import speculators_argv
from tests.conftest import tiny_params


def test_a_rank_rebuilds_the_launchers_source_from_the_trainer_flags(tmp_path):
    source = StoreSource(tmp_path / "hs", dtype=store.FP8)
    argv = speculators_argv(tiny_params(), verifier="v", data_dir=tmp_path, source=source, out_dir=tmp_path,
                            layer_ids=[2, 4, 5], total_steps=3, d2t=tmp_path / "d2t", t2d=tmp_path / "t2d",
                            device="cpu")
    rebuilt = source_from_trainer_args(argv)
    assert isinstance(rebuilt, HiddenStateSource)
    assert rebuilt.trainer_args() == source.trainer_args() == ["--hidden-states-path", str(tmp_path / "hs"),
                                                               "--hidden-states-backend", "fp8",
                                                               "--on-missing", "raise"]
    assert rebuilt.mlflow_params() == {"hidden_states.source": "store", "store.dtype": store.FP8,
                                       "hidden_states_backend": "fp8"}


def test_the_store_path_is_in_the_trainer_flags_alone():
    assert "store_dir" not in RankPlan.model_fields
    assert source_from_trainer_args(["--epochs", "1"]) is None, "no store named: nothing to check reads against"


def test_a_store_source_reads_its_dtype_from_the_manifest_when_not_told(tmp_path):
    from draftlab.rundir import Manifest, StoreDir, TargetInfo

    StoreDir(tmp_path).manifest.write(Manifest(
        key="k", target=TargetInfo(source="tiny", num_layers=8, hidden_size=32), layer_ids=[2, 4, 5],
        num_files=0, num_tokens=0, total_bytes=0, files=[], dtype="bfloat16"))
    assert StoreSource(Path(tmp_path)).mlflow_params() == {"hidden_states.source": "store", "store.dtype": "bfloat16",
                                                           "hidden_states_backend": "file"}


def _online(tmp_path, endpoint="http://127.0.0.1:8123/v1"):
    from draftlab.store.hidden_states import VllmSource

    return VllmSource(model=str(tmp_path / "target"), layer_ids=[2, 4, 5], exchange_dir=tmp_path / ".vllm-train",
                      endpoint=endpoint, params=tiny_params(), num_layers=8)


def test_an_online_source_tells_the_trainer_to_generate_every_sample_from_its_server(tmp_path):
    source = _online(tmp_path)
    argv = speculators_argv(tiny_params(), verifier=str(tmp_path / "target"), data_dir=tmp_path, source=source,
                            out_dir=tmp_path, layer_ids=source.layer_ids, total_steps=3, d2t=tmp_path / "d2t",
                            t2d=tmp_path / "t2d", device="cpu")
    flags = dict(zip(argv[::1], argv[1:]))
    assert flags["--on-missing"] == "generate" and flags["--vllm-endpoint"] == "http://127.0.0.1:8123/v1"
    assert flags["--hidden-states-path"] == str(tmp_path / ".vllm-train"), "an empty folder: no sample is cached"
    assert argv.count("--on-missing") == 1, "the source alone says what a missing sample does"
    rebuilt = source_from_trainer_args(argv)
    assert rebuilt.name == "vllm" and rebuilt.trainer_args() == source.trainer_args()
    rebuilt.install_in_rank("sha256")  # no manifest to check against: nothing raises
    assert source.mlflow_params()["hidden_states.source"] == "vllm"


def test_an_online_sources_identity_is_what_it_computes_not_where_the_server_listens(tmp_path):
    a, b = _online(tmp_path), _online(tmp_path, endpoint="http://127.0.0.1:9999/v1")
    assert a.identity() == b.identity(), "a resume on a new port continues the same run"
    from draftlab.store.hidden_states import VllmSource

    other = VllmSource(model=a.model, layer_ids=[1, 4, 5], exchange_dir=a.exchange_dir, endpoint=a.endpoint)
    assert other.identity() != a.identity(), "other layers are other hidden states"


def test_params_choose_the_source_and_an_online_one_needs_no_store(tmp_path):
    from transformers import LlamaConfig

    from draftlab.params import ParamsError, parse_params
    from draftlab.store.hidden_states import VllmSource, source_for

    tiny_target = tmp_path / "target"
    LlamaConfig(num_hidden_layers=8, hidden_size=32, num_attention_heads=1, vocab_size=64).save_pretrained(tiny_target)
    with pytest.raises(ParamsError, match="train.source"):
        source_for(tiny_params(), store_dir=None, target_dir=tiny_target, out_dir=tmp_path)

    raw = tiny_params().model_dump()
    raw["train"].update(source="vllm", vllm_url="http://127.0.0.1:8000/v1")
    source = source_for(parse_params(raw), store_dir=None, target_dir=tiny_target, out_dir=tmp_path / "runs" / "train")
    assert isinstance(source, VllmSource) and source.endpoint == "http://127.0.0.1:8000/v1"
    assert source.layer_ids == store.default_layer_ids(source.num_layers)
    assert source.exchange_dir == tmp_path / "runs" / ".vllm-train"


def test_a_users_server_is_checked_before_any_rank_starts(tmp_path):
    """train.vllm_url: a server that does not answer, or serves another model, is one line (exit 2)
    before training; one serving the target passes. A real HTTP server on a free port."""
    import http.server
    import json
    import socket
    import threading

    from draftlab.errors import HostError
    from draftlab.params import ParamsError
    from draftlab.store.hidden_states import check_server

    class Models(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = json.dumps({"data": [{"id": "/models/target"}]}).encode() if self.path == "/v1/models" else b""
            self.send_response(200 if body else 404)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Models)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_port}/v1"
        check_server(url, "/models/target")
        with pytest.raises(ParamsError, match=r"serves \['/models/target'\], not the target 'other'"):
            check_server(url, "other")
    finally:
        server.shutdown()
        server.server_close()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    with pytest.raises(HostError, match=rf"train.vllm_url: http://127.0.0.1:{closed}/v1/models does not answer"):
        check_server(f"http://127.0.0.1:{closed}/v1", "/models/target", timeout_s=2)
