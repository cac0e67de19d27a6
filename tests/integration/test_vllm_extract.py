"""The vLLM extraction server draftlab owns, against a fake vLLM python (DRAFTLAB_VLLM_PYTHON):
the command speculators' launch_vllm.py builds, /health before the generation, the whole server
process group stopped on every exit path, and one line when this host cannot start one. The real
vLLM (CPU build) is test_vllm_extract_cpu.py's."""

import json
import os
import socket
import sys
import textwrap
import time
from pathlib import Path

import pytest

from draftlab import devices
from draftlab.params import ParamsError
from draftlab.serve.serving import ServingError
from draftlab.store import vllm_extract

# argv → argv.json; a child like vLLM's engine core; /health after a moment
FAKE_VLLM = textwrap.dedent('''
    import json, subprocess, sys, time
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    from pathlib import Path
    here = Path(sys.argv[0]).parent
    (here / "argv.json").write_text(json.dumps(sys.argv[1:]))
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    (here / "pids.json").write_text(json.dumps([__import__("os").getpid(), child.pid]))
    if "--die" in (here / "mode").read_text():
        sys.exit(3)
    time.sleep(0.5)
    class H(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404)
            self.send_header("Content-Length", "0")
            self.end_headers()
    ThreadingHTTPServer(("127.0.0.1", int(sys.argv[sys.argv.index("--port") + 1])), H).serve_forever()
''')


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


@pytest.fixture
def fake_vllm(tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    exe = bin_dir / "python"
    exe.write_text(f"#!{sys.executable}\n" + FAKE_VLLM)
    exe.chmod(0o755)
    (bin_dir / "mode").write_text("serve")
    monkeypatch.setenv("DRAFTLAB_VLLM_PYTHON", str(exe))
    monkeypatch.setattr(devices, "cuda_count", lambda: 2)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    return bin_dir


def _params(**extract):
    from tests.conftest import tiny_params

    return tiny_params(extract={"backend": "vllm", "vllm_port": _free_port(), **extract})


def _target(tmp_path) -> Path:
    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 8,
                                                    "hidden_size": 32, "vocab_size": 64}))
    return target


def test_the_server_command_is_launch_vllms(tmp_path):
    cmd = vllm_extract.server_command(_params(vllm_tensor_parallel_size=2), python="py", model="m", num_layers=32,
                                      hidden_states_path=tmp_path / "shared")
    assert cmd[:5] == ["py", "-m", "vllm.entrypoints.openai.api_server", "--model", "m"]
    spec = json.loads(cmd[cmd.index("--speculative_config") + 1])
    assert spec == {"method": "extract_hidden_states", "num_speculative_tokens": 1,
                    "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": [2, 16, 29, 32]}}}
    kv = json.loads(cmd[cmd.index("--kv_transfer_config") + 1])
    assert kv == {"kv_connector": "ExampleHiddenStatesConnector", "kv_role": "kv_producer",
                  "kv_connector_extra_config": {"shared_storage_path": str(tmp_path / "shared")}}
    assert cmd[cmd.index("--tensor-parallel-size") + 1] == "2"
    assert "--no-enable-prefix-caching" in cmd  # a sample's states never depend on the ones before it
    assert "--dtype" not in cmd, "on a GPU vLLM keeps the checkpoint's dtype, as launch_vllm.py does"


def test_without_cuda_the_server_loads_draftlabs_synchronous_connector(tmp_path):
    cmd = vllm_extract.server_command(_params(dtype="float8_e4m3fn"), python="py", model="m", num_layers=8,
                                      hidden_states_path=tmp_path, cuda=False)
    kv = json.loads(cmd[cmd.index("--kv_transfer_config") + 1])
    assert kv["kv_connector_module_path"] == "draftlab.store.vllm_connector"
    assert kv["kv_connector_extra_config"] == {"shared_storage_path": str(tmp_path), "dtype": "float8_e4m3fn"}
    assert "--enforce-eager" in cmd and "--tensor-parallel-size" not in cmd
    assert cmd[cmd.index("--dtype") + 1] == "float32", "computed as the hf backend computes (target.dtype)"
    env = vllm_extract.server_env([])
    import draftlab

    from draftlab.serve import vllm_env

    # the connector's package root, after vllm_boot (AMX allowed in every server process)
    assert env["PYTHONPATH"].split(os.pathsep)[:2] == [str(vllm_env.BOOT), str(Path(draftlab.__file__).parent.parent)]

def test_fp8_stores_use_hs_connectors_fp8_connector(tmp_path):
    kv = vllm_extract.kv_transfer_config("float8_e4m3fn", tmp_path)
    assert kv["kv_connector"] == "FP8HiddenStatesConnector"
    assert kv["kv_connector_module_path"] == "hs_connectors.fp8_hidden_states_connector"
    assert vllm_extract.connector("bfloat16") == "file"


def test_lifecycle_health_then_generation_then_the_whole_group_stops(fake_vllm, tmp_path):
    from draftlab.serve.serving import http_text

    seen = {}

    def generate(cmd):
        seen["cmd"] = cmd
        endpoint = cmd[cmd.index("--endpoint") + 1]
        http_text(endpoint.removesuffix("/v1") + "/health")  # the server answers during the generation
        seen["pids"] = json.loads((fake_vllm / "pids.json").read_text())

    params = _params(vllm_gpus=[1])
    vllm_extract.run(params, target_dir=_target(tmp_path), data_dir=tmp_path / "data", out_dir=tmp_path / "store",
                     generate=generate)
    assert seen["cmd"][1:4] == ["-m", "speculators", "generate-offline-data"]
    assert seen["cmd"][seen["cmd"].index("--model") + 1] == str(tmp_path / "target")
    argv = json.loads((fake_vllm / "argv.json").read_text())
    assert argv[:4] == ["-m", "vllm.entrypoints.openai.api_server", "--model", str(tmp_path / "target")]
    assert "--kv_transfer_config" in argv
    time.sleep(0.2)
    assert not any(_alive(p) for p in seen["pids"]), "the server and its engine child are stopped"


def test_a_failed_generation_still_stops_the_server(fake_vllm, tmp_path):
    def generate(cmd):
        raise RuntimeError("generation failed")

    with pytest.raises(RuntimeError, match="generation failed"):
        vllm_extract.run(_params(), target_dir=_target(tmp_path), data_dir=tmp_path / "data",
                         out_dir=tmp_path / "store", generate=generate)
    assert not any(_alive(p) for p in json.loads((fake_vllm / "pids.json").read_text()))


def test_a_server_that_dies_before_health_is_reported_with_its_log(fake_vllm, tmp_path):
    (fake_vllm / "mode").write_text("--die")
    with pytest.raises(ServingError, match="exited with code 3 before answering"):
        vllm_extract.run(_params(), target_dir=_target(tmp_path), data_dir=tmp_path / "data",
                         out_dir=tmp_path / "store", generate=lambda cmd: pytest.fail("no generation without a server"))
    time.sleep(0.2)
    assert not any(_alive(p) for p in json.loads((fake_vllm / "pids.json").read_text()))


def test_bad_asks_are_one_line(fake_vllm, tmp_path, monkeypatch):
    with pytest.raises(ParamsError, match=r"^extract.vllm_gpus: \[0, 1, 2\] .* more GPUs than the 2 visible"):
        vllm_extract.preflight(_params(vllm_gpus=[0, 1, 2]))
    with pytest.raises(ParamsError, match=r"^extract.vllm_gpus: .*tensor-parallel size 4"):
        vllm_extract.preflight(_params(vllm_tensor_parallel_size=4))
    monkeypatch.setattr(devices, "cuda_count", lambda: 0)
    with pytest.raises(ParamsError, match=r"^extract.vllm_gpus: \[1\] but this host has no CUDA GPU"):
        vllm_extract.preflight(_params(vllm_gpus=[1]))
    assert vllm_extract.preflight(_params())[1] == [], "no GPU: the server runs on the CPU"
    monkeypatch.delenv("DRAFTLAB_VLLM_PYTHON")
    from draftlab.serve import vllm_env

    monkeypatch.setattr(vllm_env, "VENV", tmp_path / ".venv-vllm")
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    with pytest.raises(ParamsError, match="^extract.backend: `vllm` asks draftlab to start a vLLM server: .*not installed here"):
        vllm_extract.preflight(_params())
