"""The `vllm` backend of `extract`: vLLM computes the hidden states, speculators'
`generate-offline-data` sends it the prepared samples and moves the files into the store.

With `extract.vllm_url` set, draftlab talks to that server. Without it, draftlab owns the server:
it starts `vllm serve` with the hidden-state extraction config that speculators 0.9 expects (the
command its `scripts/launch_vllm.py` builds, which is not in the wheel: an `extract_hidden_states`
speculative config naming the aux layers plus the last one, and the `--kv_transfer_config` of
hs_connectors' `build_kv_transfer_config` — the fp8 connector when `extract.dtype` is
`float8_e4m3fn`, the file connector otherwise), on `extract.vllm_gpus` with
`extract.vllm_tensor_parallel_size`, waits for /health, runs the generation and stops the server's
whole process group on every exit path (`serving.running`, as `evaluate`'s vllm backend does: on
127.0.0.1, a free port unless extract.vllm_port names one; without an API key, which speculators'
generator cannot send).
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
    """speculators' own offline generator against a vLLM server (GPU hosts)."""
    endpoint = endpoint or params.extract.vllm_url
    if not endpoint:
        raise ParamsError("extract.vllm_url: required when extract.backend is 'vllm'")
    return [
        "speculators", "generate-offline-data",
        "--model", params.target.path,
        "--endpoint", endpoint,
        "--preprocessed-data", str(data_dir),
        "--output", str(out_dir),
        "--validate-outputs",
        "--fail-on-error",
    ]


def shared_dir(out_dir: Path) -> Path:
    """Where the server's connector writes; beside the store, so moving a file in is a rename."""
    return out_dir.parent / f".vllm-{out_dir.name}"


def connector(dtype: str) -> str:
    return "fp8" if dtype == FP8 else "file"


def kv_transfer_config(dtype: str, hidden_states_path: Path) -> dict:
    from hs_connectors import HiddenStatesBackend

    backend = HiddenStatesBackend.registry[connector(dtype)]
    return backend.build_kv_transfer_config(argparse.Namespace(hidden_states_path=str(hidden_states_path)))


def server_command(params: Params, *, vllm: str, model: str, num_layers: int, hidden_states_path: Path) -> list[str]:
    """`vllm serve` for hidden-state extraction, as speculators' launch_vllm.py builds it."""
    from draftlab.store import layout as store

    e = params.extract
    layer_ids = [*(e.layer_ids or store.default_layer_ids(num_layers)), num_layers]  # + the last layer
    speculative_config = {
        "method": "extract_hidden_states",
        "num_speculative_tokens": 1,
        "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": layer_ids}},
    }
    cmd = [vllm, "serve", model,
           "--speculative_config", json.dumps(speculative_config),
           "--kv_transfer_config", json.dumps(kv_transfer_config(e.dtype, hidden_states_path)),
           "--tensor-parallel-size", str(e.vllm_tensor_parallel_size),
           "--gpu-memory-utilization", str(e.vllm_gpu_memory_utilization)]  # fmt: skip
    if params.target.trust_remote_code:
        from draftlab.models import check_pinned

        check_pinned(params)
        cmd.append("--trust-remote-code")
    if params.target.source == "hub" and params.target.revision:  # weights, code and tokenizer at one commit
        rev = params.target.revision
        cmd += ["--revision", rev, "--code-revision", rev, "--tokenizer-revision", rev]
    return cmd


def preflight(params: Params) -> tuple[str, list[str]]:
    """(vllm executable, CUDA devices of the server), or one line naming the key to change."""
    from draftlab import devices

    e = params.extract
    visible = devices.cuda_count()
    if visible == 0:
        raise ParamsError("extract.backend: `vllm` needs a CUDA GPU to start a server and this host has none; "
                          "use extract.backend: hf, or set extract.vllm_url to a running server")
    vllm = shutil.which("vllm")
    if vllm is None:
        raise ParamsError("extract.backend: `vllm` asks draftlab to start a vLLM server but no `vllm` executable "
                          "is on PATH; install vLLM (the GPU image has it) or set extract.vllm_url")
    gpus = e.vllm_gpus if e.vllm_gpus is not None else list(range(visible))
    if len(gpus) < e.vllm_tensor_parallel_size or any(g >= visible or g < 0 for g in gpus):
        raise ParamsError(f"extract.vllm_gpus: {gpus} with tensor-parallel size {e.vllm_tensor_parallel_size} "
                          f"asks for more GPUs than the {visible} visible; lower extract.vllm_tensor_parallel_size "
                          "or list visible devices")
    parent = os.environ.get("CUDA_VISIBLE_DEVICES")
    names = parent.split(",") if parent else [str(i) for i in range(visible)]
    return vllm, [names[g] for g in gpus[: e.vllm_tensor_parallel_size]]


def run(params: Params, *, target_dir: Path, data_dir: Path, out_dir: Path, generate=None) -> None:
    """Hidden states of every prepared sample into `out_dir` through vLLM. `generate(cmd)` runs
    speculators' generator (default: a child process that must exit 0)."""
    from draftlab.console import console
    from draftlab.models import resolve, revision_kwargs
    from draftlab.serve import serving

    generate = generate or _generate
    out_dir.mkdir(parents=True, exist_ok=True)
    if params.extract.vllm_url:
        generate(vllm_command(params, data_dir=data_dir, out_dir=out_dir))
        return
    vllm, gpus = preflight(params)
    from transformers import AutoConfig

    model = resolve(params, target_dir)
    config = AutoConfig.from_pretrained(model, **revision_kwargs(params))
    config = getattr(config, "text_config", config)
    shared = shared_dir(out_dir)
    shared.mkdir(parents=True, exist_ok=True)
    cmd = server_command(params, vllm=vllm, model=model, num_layers=config.num_hidden_layers, hidden_states_path=shared)
    console.print(f"[bold]extract[/]: starting vLLM on GPU(s) {','.join(gpus)}: " + " ".join(cmd))
    env = dict(os.environ, CUDA_VISIBLE_DEVICES=",".join(gpus))
    # no API key: speculators' generate-offline-data sends none (its OpenAI client's "EMPTY")
    with serving.running(cmd, port=params.extract.vllm_port, log_path=out_dir.parent / f"{out_dir.name}-vllm.log",
                         what="extraction", startup_timeout_s=params.extract.vllm_startup_timeout_s, env=env,
                         port_key="extract.vllm_port", api_key=False) as server:
        gen = vllm_command(params, data_dir=data_dir, out_dir=out_dir, endpoint=f"{server.base_url}/v1")
        gen[gen.index("--model") + 1] = model  # the name the server serves (tiny targets have no path)
        generate(gen)


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
