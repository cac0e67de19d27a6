"""The `vllm` backend of `extract`: vLLM computes the hidden states, speculators'
`generate-offline-data` sends it the prepared samples and moves the files into the store.

With `extract.vllm_url` set, draftlab talks to that server. Without it, draftlab owns the server:
it starts vLLM's OpenAI server (with the interpreter `vllm_python` finds) with the hidden-state
extraction config that speculators 0.9 expects (the command its `scripts/launch_vllm.py` builds,
which is not in the wheel: an `extract_hidden_states` speculative config naming the aux layers
plus the last one, and a `--kv_transfer_config`), waits for /health, runs the generation and
stops the server's whole process group on every exit path (`serving.running`, as `evaluate`'s
vllm backend does: on 127.0.0.1, a free port unless extract.vllm_port names one; without an API
key, which speculators' generator cannot send).

Where CUDA works the connector is upstream's, through hs_connectors' `build_kv_transfer_config`
(the fp8 connector when `extract.dtype` is `float8_e4m3fn`, the file connector otherwise), on
`extract.vllm_gpus` with `extract.vllm_tensor_parallel_size`. On a host without CUDA it is
draftlab's synchronous `vllm_connector` (upstream's needs CUDA streams and pinned memory), which
writes `extract.dtype` itself, fp8 included.

The stage (`stages/extract.py`) gives this module the store's work folder and journals,
verifies and publishes what the generator leaves there, as for the hf backend.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
from pathlib import Path

from draftlab.params import Params, ParamsError

FP8 = "float8_e4m3fn"


def vllm_command(params: Params, *, data_dir: Path, out_dir: Path, endpoint: str | None = None) -> list[str]:
    """speculators' own offline generator against a vLLM server (draftlab's own server or `extract.vllm_url`)."""
    endpoint = endpoint or params.extract.vllm_url
    if not endpoint:
        raise ParamsError("extract.vllm_url: required when extract.backend is 'vllm'")
    import sys

    return [
        sys.executable, "-m", "speculators", "generate-offline-data",  # this venv's, PATH or not
        "--model", params.target.path,
        "--endpoint", endpoint,
        "--preprocessed-data", str(data_dir),
        "--output", str(out_dir),
        # its check (torch.aminmax) has no fp8 kernel on CPU: for fp8 draftlab checks each file itself
        *([] if params.extract.dtype == FP8 else ["--validate-outputs"]),
        "--fail-on-error",
    ]


def shared_dir(out_dir: Path) -> Path:
    """Where the server's connector writes; beside the store, so moving a file in is a rename."""
    return out_dir.parent / f".vllm-{out_dir.name}"


def connector(dtype: str) -> str:
    return "fp8" if dtype == FP8 else "file"


CPU_CONNECTOR = "SyncHiddenStatesConnector"
CPU_CONNECTOR_MODULE = "draftlab.store.vllm_connector"
def kv_transfer_config(dtype: str, hidden_states_path: Path, *, cuda: bool = True) -> dict:
    """Upstream's connector (hs_connectors' config) where CUDA works; draftlab's synchronous one
    (`vllm_connector`) where it cannot, writing `dtype` itself."""
    if not cuda:
        return {"kv_connector": CPU_CONNECTOR, "kv_role": "kv_producer",
                "kv_connector_module_path": CPU_CONNECTOR_MODULE,
                "kv_connector_extra_config": {"shared_storage_path": str(hidden_states_path), "dtype": dtype}}
    from hs_connectors import HiddenStatesBackend

    backend = HiddenStatesBackend.registry[connector(dtype)]
    return backend.build_kv_transfer_config(argparse.Namespace(hidden_states_path=str(hidden_states_path)))


def server_command(params: Params, *, python: str, model: str, num_layers: int, hidden_states_path: Path,
                   cuda: bool = True) -> list[str]:
    """vLLM's OpenAI server for hidden-state extraction, as speculators' launch_vllm.py builds it
    (`python -m vllm.entrypoints.openai.api_server`: the CPU build's `vllm` script fails). Prefix
    caching is off: a sample's states must not depend on which samples came before it (a rerun
    after a kill gives the same bytes)."""
    from draftlab.store import layout as store

    e = params.extract
    layer_ids = [*(e.layer_ids or store.default_layer_ids(num_layers)), num_layers]  # + the last layer
    speculative_config = {
        "method": "extract_hidden_states",
        "num_speculative_tokens": 1,
        "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": layer_ids}},
    }
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
           "--speculative_config", json.dumps(speculative_config),
           "--kv_transfer_config", json.dumps(kv_transfer_config(e.dtype, hidden_states_path, cuda=cuda)),
           "--no-enable-prefix-caching"]  # fmt: skip  (serving.running adds --host 127.0.0.1 --port)
    if cuda:  # vLLM's own dtype (the checkpoint's), as launch_vllm.py leaves it
        cmd += ["--tensor-parallel-size", str(e.vllm_tensor_parallel_size),
                "--gpu-memory-utilization", str(e.vllm_gpu_memory_utilization)]  # fmt: skip
    else:
        # target.dtype, as the hf backend computes: vLLM's CPU build would run a float32 checkpoint in bf16
        # no graph compile: seconds, not minutes, on a few cores
        cmd += ["--dtype", params.target.dtype, "--enforce-eager"]
    if params.target.trust_remote_code:
        from draftlab.models import check_pinned

        check_pinned(params)
        cmd.append("--trust-remote-code")
    if params.target.source == "hub" and params.target.revision:  # weights, code and tokenizer at one commit
        rev = params.target.revision
        cmd += ["--revision", rev, "--code-revision", rev, "--tokenizer-revision", rev]
    return cmd


def server_env(gpus: list[str]) -> dict:
    """The server's environment: its GPUs, or on CPU the KV cache size, draftlab's package root
    on PYTHONPATH (vLLM imports the synchronous connector from there) and AMX allowed where the
    CPU has it (vllm_env.server_env)."""
    if gpus:
        return dict(os.environ, CUDA_VISIBLE_DEVICES=",".join(gpus))
    import draftlab
    from draftlab.serve import vllm_env

    root = str(Path(draftlab.__file__).resolve().parent.parent)
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    return vllm_env.server_env(dict(os.environ, PYTHONPATH=path,
                                    VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")))


def guard_command(cmd: list[str]) -> list[str]:
    """`cmd` under `draftlab.guard`: vLLM's engine and workers (children of the server that do
    not watch it) die with draftlab too, kill -9 included."""
    import sys

    return [sys.executable, "-m", "draftlab.guard", "--parent", str(os.getpid()), "--", *cmd]


def preflight(params: Params) -> tuple[str, list[str]]:
    """(vLLM's python, CUDA devices of the server; [] on a CPU host), or one line naming the key to change."""
    from draftlab import devices

    e = params.extract
    from draftlab.serve.vllm_env import VllmMissing, vllm_python

    try:
        python = vllm_python()
    except VllmMissing as err:
        raise ParamsError(f"extract.backend: `vllm` asks draftlab to start a vLLM server: {err}; "
                          "or set extract.vllm_url") from None
    visible = devices.cuda_count()
    if visible == 0:
        if e.vllm_gpus:
            raise ParamsError(f"extract.vllm_gpus: {e.vllm_gpus} but this host has no CUDA GPU; "
                              "remove extract.vllm_gpus to extract on the CPU")
        return python, []
    gpus = e.vllm_gpus if e.vllm_gpus is not None else list(range(visible))
    if len(gpus) < e.vllm_tensor_parallel_size or any(g >= visible or g < 0 for g in gpus):
        raise ParamsError(f"extract.vllm_gpus: {gpus} with tensor-parallel size {e.vllm_tensor_parallel_size} "
                          f"asks for more GPUs than the {visible} visible; lower extract.vllm_tensor_parallel_size "
                          "or list visible devices")
    parent = os.environ.get("CUDA_VISIBLE_DEVICES")
    names = parent.split(",") if parent else [str(i) for i in range(visible)]
    return python, [names[g] for g in gpus[: e.vllm_tensor_parallel_size]]


def run(params: Params, *, target_dir: Path, data_dir: Path, out_dir: Path, generate=None) -> tuple[float, float]:
    """Hidden states of every prepared sample into `out_dir` through vLLM (files already there are
    kept: speculators' generator skips every readable `hs_<i>`). `generate(cmd)` runs speculators'
    generator (default: a child process that must exit 0). Returns (seconds until the server
    answered /health, 0 for a user's server; seconds of the generation)."""
    import time

    from draftlab.console import console
    from draftlab.models import resolve, revision_kwargs
    from draftlab.serve import serving

    generate = generate or _generate
    out_dir.mkdir(parents=True, exist_ok=True)
    if params.extract.vllm_url:
        started = time.perf_counter()
        generate(vllm_command(params, data_dir=data_dir, out_dir=out_dir))
        return 0.0, time.perf_counter() - started
    python, gpus = preflight(params)
    from transformers import AutoConfig

    model = resolve(params, target_dir)
    config = AutoConfig.from_pretrained(model, **revision_kwargs(params))
    config = getattr(config, "text_config", config)
    shared = shared_dir(out_dir)
    shutil.rmtree(shared, ignore_errors=True)  # what a killed run left: files no journal names, stale locks
    shared.mkdir(parents=True)
    cmd = server_command(params, python=python, model=model, num_layers=config.num_hidden_layers,
                         hidden_states_path=shared, cuda=bool(gpus))
    where = f"GPU(s) {','.join(gpus)}" if gpus else "the CPU (draftlab's synchronous connector)"
    console.print(f"[bold]extract[/]: starting vLLM on {where}: " + " ".join(cmd), soft_wrap=True)
    started = time.perf_counter()
    guarded = guard_command(cmd)
    try:
        with serving.running(guarded, port=params.extract.vllm_port, log_path=out_dir.parent / f"{out_dir.name}-vllm.log",
                             what="extraction", startup_timeout_s=params.extract.vllm_startup_timeout_s,
                             env=server_env(gpus), port_key="extract.vllm_port", api_key=False) as server:
            gen = vllm_command(params, data_dir=data_dir, out_dir=out_dir, endpoint=f"{server.base_url}/v1")
            gen[gen.index("--model") + 1] = model  # the name the server serves (tiny targets have no path)
            healthy = time.perf_counter()
            generate(gen)
            return healthy - started, time.perf_counter() - healthy
    finally:
        shutil.rmtree(shared, ignore_errors=True)


def _generate(cmd: list[str]) -> None:
    from draftlab import procs
    from draftlab.console import console

    console.print("[bold]extract[/]: " + " ".join(cmd))
    proc = procs.spawn(cmd, new_session=False)
    try:
        rc = proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if rc != 0:
        raise subprocess.CalledProcessError(rc, cmd)
