"""serving: the vLLM benchmark's command lines (GPU `vllm serve`, CPU api_server), its reading of
vLLM's Prometheus counters, the before/after arithmetic, and its refusal to run without vLLM. Real
servers are started in tests/integration/test_vllm_serving.py."""

import json
import subprocess

import pytest

from draftlab.params import ParamsError
from draftlab.serve import serving


def _flag(argv, name):
    return argv[argv.index(name) + 1]


def test_serve_command_speculative_and_plain_on_a_gpu_host(monkeypatch):
    monkeypatch.setattr(serving.shutil, "which", lambda name: f"/usr/bin/{name}")
    argv = serving.vllm_serve_command("org/target", "/models/draft", num_speculative_tokens=3,
                                      gpu_memory_utilization=0.85, speculative=True, gpu=True)
    assert argv[:3] == ["vllm", "serve", "org/target"]
    assert _flag(argv, "--gpu-memory-utilization") == "0.85"
    assert "--port" not in argv and "--host" not in argv  # `running` adds them, with a free port
    served = _flag(argv, "--served-model-name")
    # one argv element, no shell quoting: exactly the JSON vLLM parses
    assert json.loads(_flag(argv, "--speculative-config")) == {
        "model": "/models/draft", "method": "eagle3", "num_speculative_tokens": 3}
    plain = serving.vllm_serve_command("org/target", "/models/draft", num_speculative_tokens=3,
                                       gpu_memory_utilization=0.85, speculative=False, gpu=True)
    assert "--speculative-config" not in plain and _flag(plain, "--served-model-name") == served
    assert [a for a in argv if a not in plain] == ["--speculative-config", _flag(argv, "--speculative-config")]


def test_serve_command_on_cpu_is_the_api_server_module_eager(monkeypatch, tmp_path):
    monkeypatch.setenv("DRAFTLAB_VLLM_PYTHON", "/bin/sh")  # any executable: only its path is used
    argv = serving.vllm_serve_command("models/target", "/d", num_speculative_tokens=2,
                                      gpu_memory_utilization=0.85, speculative=True, gpu=False, dtype="float32")
    assert argv[:5] == ["/bin/sh", "-m", "vllm.entrypoints.openai.api_server", "--model", "models/target"]
    assert "--enforce-eager" in argv and _flag(argv, "--dtype") == "float32"
    assert "--gpu-memory-utilization" not in argv
    assert serving.server_env({})["VLLM_CPU_KVCACHE_SPACE"] == "1"
    assert serving.server_env({"VLLM_CPU_KVCACHE_SPACE": "4"})["VLLM_CPU_KVCACHE_SPACE"] == "4"


def _metrics(drafts, draft_tokens, accepted, per_pos, *, engines=("0",), model='draftlab-target'):
    """/metrics as vLLM's prometheus_client exposes it: HELP/TYPE lines, _created samples, one
    sample per engine, other metric families around."""
    def family(name, help_, values, extra=""):
        lines = [f"# HELP {name}_total {help_}", f"# TYPE {name}_total counter"]
        for e in engines:
            lines.append(f'{name}_total{{engine="{e}",model_name="{model}"{extra}}} {values / len(engines)}')
        lines += [f"# HELP {name}_created {help_}", f"# TYPE {name}_created gauge"]
        lines += [f'{name}_created{{engine="{e}",model_name="{model}"{extra}}} 1.7616e+09' for e in engines]
        return lines

    lines = ["# HELP python_gc_objects_collected_total Objects collected during gc",
             "# TYPE python_gc_objects_collected_total counter",
             'python_gc_objects_collected_total{generation="0"} 12345.0',
             "# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.",
             "# TYPE vllm:time_to_first_token_seconds histogram",
             f'vllm:time_to_first_token_seconds_bucket{{engine="0",le="+Inf",model_name="{model}"}} 17.0',
             f'vllm:generation_tokens_total{{engine="0",model_name="{model}"}} 999.0']
    lines += family("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.", drafts)
    lines += family("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.", draft_tokens)
    lines += family("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.", accepted)
    lines += ["# HELP vllm:spec_decode_num_accepted_tokens_per_pos_total Accepted tokens per draft position.",
              "# TYPE vllm:spec_decode_num_accepted_tokens_per_pos_total counter"]
    for pos, value in enumerate(per_pos):
        for e in engines:
            lines.append(f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{engine="{e}",'
                         f'model_name="{model}",position="{pos}"}} {value / len(engines)}')
    return "\n".join(lines) + "\n"


def test_parse_reads_vllm_counters_summed_over_engines():
    # a model name with a comma, a brace and an escaped quote must not confuse the label parser
    text = _metrics(40, 120, 70, [35, 22, 13], engines=("0", "1"), model='my,odd}\\"model')
    m = serving.parse_spec_decode_metrics(text)
    assert (m["num_drafts"], m["num_draft_tokens"], m["num_accepted_tokens"]) == (40, 120, 70)
    assert m["num_accepted_tokens_per_pos"] == [35, 22, 13]
    assert m["mean_acceptance_length"] == pytest.approx(1 + 70 / 40)  # vLLM's convention, bonus included
    assert m["acceptance_per_position"] == pytest.approx([35 / 40, 22 / 40, 13 / 40])
    assert m["draft_acceptance_rate"] == pytest.approx(70 / 120)


def test_parse_without_per_position_counters_and_without_speculation():
    text = "\n".join(line for line in _metrics(10, 30, 12, [6, 4, 2]).splitlines() if "per_pos" not in line)
    m = serving.parse_spec_decode_metrics(text)
    assert m["num_accepted_tokens_per_pos"] == [] and m["mean_acceptance_length"] == pytest.approx(2.2)
    plain = "\n".join(line for line in text.splitlines() if "spec_decode" not in line)
    with pytest.raises(serving.ServingError, match="spec_decode_num_drafts_total"):
        serving.parse_spec_decode_metrics(plain)


def test_delta_excludes_what_happened_before_the_first_scrape():
    before = serving.parse_spec_decode_metrics(_metrics(4, 12, 9, [4, 3, 2]))  # warm-up: long accepts
    after = serving.parse_spec_decode_metrics(_metrics(24, 72, 29, [14, 9, 6]))
    d = serving.spec_decode_delta(before, after)
    assert (d["num_drafts"], d["num_draft_tokens"], d["num_accepted_tokens"]) == (20, 60, 20)
    assert d["num_accepted_tokens_per_pos"] == [10, 6, 4]
    assert d["mean_acceptance_length"] == pytest.approx(2.0)  # not (1 + 29/24) of the cumulative counters
    assert d["acceptance_per_position"] == pytest.approx([0.5, 0.3, 0.2])
    with pytest.raises(serving.ServingError, match="restart"):
        serving.spec_decode_delta(after, before)


def test_summary_metric_names_and_speedup():
    spec = {"output_tokens_per_s": 300.0, "texts": ["a", "b"],
            "spec": serving._derive({"num_drafts": 20, "num_draft_tokens": 60, "num_accepted_tokens": 20,
                                     "num_accepted_tokens_per_pos": [10, 6, 4]})}
    plain = {"output_tokens_per_s": 150.0, "texts": ["a", "c"], "spec": None}
    m = serving.summarize(spec, plain, 3)
    assert m["eval/vllm_measured_acc_len"] == pytest.approx(2.0)
    assert [m[f"eval/vllm_accept_rate_{k}"] for k in range(3)] == pytest.approx([0.5, 0.3, 0.2])
    assert (m["eval/vllm_output_tokens_per_s"], m["eval/vllm_plain_output_tokens_per_s"]) == (300.0, 150.0)
    assert m["eval/vllm_speedup"] == pytest.approx(2.0) and m["eval/vllm_output_match_frac"] == 0.5


def test_refuses_without_vllm_before_starting_anything(tmp_path, monkeypatch):
    import importlib.util

    from draftlab.serve import vllm_env

    def no_server(*args, **kwargs):
        raise AssertionError("a server was started")

    monkeypatch.setattr(subprocess, "Popen", no_server)
    monkeypatch.delenv(vllm_env.PYTHON_ENV, raising=False)
    monkeypatch.setattr(vllm_env, "VENV", tmp_path / "absent")
    monkeypatch.setattr(vllm_env, "cpu_lacks_avx2", lambda: False)
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real_find_spec(name, *a))
    kwargs = dict(target="org/target", draft_dir=tmp_path, prompts=[[1, 2]], num_speculative_tokens=3,
                  max_tokens=8, gpu_memory_utilization=0.85, log_dir=tmp_path)
    with pytest.raises(ParamsError, match="install-vllm.sh") as err:
        serving.run_benchmark(**kwargs)
    assert "\n" not in str(err.value) and "evaluate.backend" in str(err.value)


def test_a_free_port_is_chosen_and_answers_nothing():
    port = serving.free_port()
    assert 0 < port < 65536 and not serving._port_in_use(port)


def test_a_listening_socket_is_told_ours_or_not_by_its_process_group():
    import os
    import socket

    with socket.socket() as ours:
        ours.bind(("127.0.0.1", 0))
        ours.listen()
        port = ours.getsockname()[1]
        assert serving.group_listens_on(os.getpgid(0), port)
        assert not serving.group_listens_on(os.getpgid(0) + 1_000_000, port)
    assert not serving.group_listens_on(os.getpgid(0), port)  # closed: nothing listens
