"""serving's server lifecycle against a fake vLLM (fast, and able to misbehave as a real one
rarely does): the whole process group stopped on every exit path, a busy port refused. Real vLLM
servers are in test_vllm_serving.py."""

import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from draftlab.errors import HostError
from draftlab.serve import serving

FAKE_VLLM = textwrap.dedent('''
    """A stand-in for `vllm serve`: /health after a delay, /v1/completions, /metrics counters;
    it also starts a child, as vLLM's engine core does."""
    import json, subprocess, sys, time
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    speculative, child_pid_file = sys.argv[1] == "spec", sys.argv[2]
    port = int(sys.argv[sys.argv.index("--port") + 1])  # added by serving.running
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    open(child_pid_file, "w").write(str(child.pid))
    time.sleep(1.0)  # loading weights
    c = {"drafts": 0, "draft_tokens": 0, "accepted": 0, "pos": [0, 0, 0]}

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def reply(self, body, ctype="application/json"):
            data = body.encode()
            self.send_response(200)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            if self.path == "/health":
                return self.reply("")
            lines = ["# TYPE vllm:generation_tokens_total counter", "vllm:generation_tokens_total 1.0"]
            if speculative:
                lab = '{engine="0",model_name="draftlab-target"}'
                lines += [f"vllm:spec_decode_num_drafts_total{lab} {c['drafts']}",
                          f"vllm:spec_decode_num_draft_tokens_total{lab} {c['draft_tokens']}",
                          f"vllm:spec_decode_num_accepted_tokens_total{lab} {c['accepted']}"]
                lines += [f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{engine="0",position="{k}"}} {v}'
                          for k, v in enumerate(c["pos"])]
            self.reply("\\n".join(lines) + "\\n", "text/plain")

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            assert self.path == "/v1/completions" and body["temperature"] == 0.0
            n = body["max_tokens"]
            if not body["prompt"]:
                self.send_response(400)
                self.send_header("Content-Length", "0")
                return self.end_headers()
            if speculative:  # n tokens in n/2 rounds, each accepting 1 draft (position 0)
                c["drafts"] += n // 2; c["draft_tokens"] += 3 * (n // 2); c["accepted"] += n // 2
                c["pos"][0] += n // 2
            time.sleep(0.01 if speculative else 0.02)
            text = "out-" + "-".join(map(str, body["prompt"]))
            self.reply(json.dumps({"choices": [{"text": text}], "usage": {"completion_tokens": n}}))

    ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()
''')


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _gone(pid):
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


@pytest.mark.parametrize("speculative", [True, False], ids=["speculative", "plain"])
def test_server_lifecycle_against_a_fake_vllm(tmp_path, speculative):
    script, child_pid = tmp_path / "fake_vllm.py", tmp_path / "child.pid"
    script.write_text(FAKE_VLLM)
    port = _free_port()
    command = [sys.executable, str(script), "spec" if speculative else "plain", str(child_pid)]
    prompts = [[1, 2, 3], [4, 5]]
    run = serving.benchmark_server(command, port=port, prompts=prompts, max_tokens=16,
                                   log_path=tmp_path / "vllm.log", speculative=speculative, startup_timeout_s=60)
    assert run["output_tokens"] == 32 and run["texts"] == ["out-1-2-3", "out-4-5"]
    assert run["output_tokens_per_s"] == pytest.approx(32 / run["wall_s"])
    if speculative:  # the warm-up request (8 tokens, 4 drafts) happened before the first scrape
        assert run["spec"]["num_drafts"] == 16 and run["spec"]["mean_acceptance_length"] == pytest.approx(2.0)
        assert run["spec"]["acceptance_per_position"] == pytest.approx([1.0, 0.0, 0.0])
    else:
        assert run["spec"] is None
    # the server and its child are stopped, the port is free for the next server
    assert _gone(int(child_pid.read_text()))
    assert not serving._port_in_use(port)


def test_a_refused_request_fails_clearly_and_stops_the_server(tmp_path):
    script, child_pid = tmp_path / "fake_vllm.py", tmp_path / "child.pid"
    script.write_text(FAKE_VLLM)
    port = _free_port()
    command = [sys.executable, str(script), "spec", str(child_pid)]
    with pytest.raises(serving.ServingError, match="HTTP 400"):
        serving.benchmark_server(command, port=port, prompts=[[1, 2], []], max_tokens=8,
                                 log_path=tmp_path / "vllm.log", speculative=True, startup_timeout_s=60)
    assert _gone(int(child_pid.read_text())) and not serving._port_in_use(port)


def test_a_server_that_dies_at_startup_fails_with_its_log(tmp_path):
    command = [sys.executable, "-c", "import sys; print('ValueError: head_size 8 is not supported'); sys.exit(3)"]
    with pytest.raises(serving.ServingError, match="exited with code 3.*head_size 8 is not supported"):
        serving.benchmark_server(command, port=_free_port(), prompts=[[1]], max_tokens=4,
                                 log_path=tmp_path / "vllm.log", speculative=True, startup_timeout_s=30)


def test_a_busy_port_is_refused(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        with pytest.raises(HostError, match="already in use"):
            serving.benchmark_server(["false"], port=busy.getsockname()[1], prompts=[[1]], max_tokens=4,
                                     log_path=tmp_path / "vllm.log", speculative=False)
    assert not (tmp_path / "vllm.log").exists()


def test_stop_kills_a_server_group_that_ignores_sigterm():
    code = ("import signal, subprocess, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            "subprocess.Popen([sys.executable, '-c', 'import signal, time; "
            "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(120)']); print('up', flush=True); time.sleep(120)")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, start_new_session=True)
    assert proc.stdout.readline().strip() == b"up"
    serving._stop(proc, grace_s=0.5)
    assert proc.returncode == -9 and not serving._group_alive(proc.pid)
