"""Serving benchmark on GPU hosts: the exported draft under vLLM, measured against the same
server without speculation (the `vllm` backend of `draftlab evaluate`).

Each server is started in turn (`vllm serve TARGET …`, in its own process group), waited for on
`/health`, warmed up with one request, then sent the fixed prompt set one request at a time
(OpenAI `/v1/completions`, greedy, token-id prompts). Output tokens/s is completion tokens over the
wall time of those requests. Acceptance comes from vLLM's own Prometheus counters scraped from
`/metrics` before and after the prompts (their difference, so warm-up does not count):
mean acceptance length = 1 + Δaccepted / Δdrafts (vLLM's convention, bonus token included) and
per-position rate k = Δaccepted_per_pos[k] / Δdrafts. It cannot run on CPU-only hosts; command
construction, parsing and the server lifecycle are unit-tested without vLLM.

    python -m draftlab.serve.serving --target models/target --draft models/draft --data data/prepared
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

from draftlab import procs
from draftlab.errors import HostError, UserError
from draftlab.params import ParamsError

SERVED_NAME = "draftlab-target"
# vLLM's spec-decode counters (vllm/v1/spec_decode/metrics.py); prometheus_client exposes a
# Counter named X as X_total, one sample per engine (labels model_name, engine).
COUNTERS = {
    "num_drafts": "vllm:spec_decode_num_drafts_total",
    "num_draft_tokens": "vllm:spec_decode_num_draft_tokens_total",
    "num_accepted_tokens": "vllm:spec_decode_num_accepted_tokens_total",
}
PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos_total"  # label position="0".."k-1"
_SAMPLE = re.compile(r'^([A-Za-z_:][A-Za-z0-9_:]*)(?:\{((?:[^"}]|"(?:[^"\\]|\\.)*")*)\})?\s+(\S+)(?:\s+\S+)?$')
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')


class ServingError(UserError, RuntimeError):
    """A vLLM server that did not start, answer or expose what the benchmark reads."""

    exit_code = 1


def require_gpu_and_vllm() -> None:
    """One line when this host cannot run the vLLM backend."""
    import importlib.util

    import torch

    if not torch.cuda.is_available():
        raise ParamsError("evaluate.backend: `vllm` needs a CUDA GPU and this host has none; "
                          "use evaluate.backend: hf here, or run on a GPU host")
    if importlib.util.find_spec("vllm") is None:
        raise ParamsError("evaluate.backend: `vllm` needs the vllm package, which is not installed here; "
                          "use the GPU image, or evaluate.backend: hf")


def vllm_serve_command(target: str, draft_dir: str | Path, *, num_speculative_tokens: int, port: int,
                       gpu_memory_utilization: float, speculative: bool) -> list[str]:
    """`vllm serve` for the target, with the draft as an EAGLE-3 speculator when `speculative`."""
    cmd = ["vllm", "serve", str(target), "--host", "127.0.0.1", "--port", str(port),
           "--gpu-memory-utilization", str(gpu_memory_utilization), "--served-model-name", SERVED_NAME,
           "--seed", "0"]
    if speculative:
        spec = {"model": str(draft_dir), "method": "eagle3", "num_speculative_tokens": num_speculative_tokens}
        cmd += ["--speculative-config", json.dumps(spec)]
    return cmd


def _samples(prometheus_text: str):
    """(name, labels, value) of every sample line in Prometheus' text exposition format."""
    for line in prometheus_text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        match = _SAMPLE.match(line)
        if match:
            name, labels, value = match.groups()
            yield name, dict(_LABEL.findall(labels or "")), float(value)


def _derive(counts: dict) -> dict:
    drafts = counts["num_drafts"]
    out = dict(counts)
    out["mean_acceptance_length"] = 1.0 + counts["num_accepted_tokens"] / drafts if drafts else 1.0
    out["acceptance_per_position"] = [a / drafts if drafts else 0.0 for a in counts["num_accepted_tokens_per_pos"]]
    out["draft_acceptance_rate"] = (counts["num_accepted_tokens"] / counts["num_draft_tokens"]
                                    if counts["num_draft_tokens"] else 0.0)
    return out


def parse_spec_decode_metrics(prometheus_text: str) -> dict:
    """vLLM's spec-decode counters summed over engines, with the acceptance they imply.

    Keys: num_drafts, num_draft_tokens, num_accepted_tokens, num_accepted_tokens_per_pos (list by
    position; empty when vLLM does not export it), mean_acceptance_length, acceptance_per_position,
    draft_acceptance_rate. Raises ServingError when the counters are absent (no speculation)."""
    counts = {key: 0.0 for key in COUNTERS}
    per_pos: dict[int, float] = {}
    seen = set()
    for name, labels, value in _samples(prometheus_text):
        for key, metric in COUNTERS.items():
            if name == metric:
                counts[key] += value
                seen.add(key)
        if name == PER_POS and "position" in labels:
            pos = int(labels["position"])
            per_pos[pos] = per_pos.get(pos, 0.0) + value
    if seen != set(COUNTERS):
        missing = ", ".join(COUNTERS[k] for k in COUNTERS if k not in seen)
        raise ServingError(f"/metrics has no {missing}: is speculative decoding on (--speculative-config)?")
    counts["num_accepted_tokens_per_pos"] = [per_pos.get(p, 0.0) for p in range(max(per_pos, default=-1) + 1)]
    return _derive(counts)


def spec_decode_delta(before: dict, after: dict) -> dict:
    """What happened between two scrapes: counter differences and the acceptance they imply."""
    counts = {key: after[key] - before[key] for key in COUNTERS}
    b, a = before["num_accepted_tokens_per_pos"], after["num_accepted_tokens_per_pos"]
    counts["num_accepted_tokens_per_pos"] = [x - (b[i] if i < len(b) else 0.0) for i, x in enumerate(a)]
    if any(v < 0 for k, v in counts.items() if k in COUNTERS):
        raise ServingError("vLLM's spec-decode counters went down between scrapes: did the server restart?")
    return _derive(counts)


def http_text(url: str, body: dict | None = None, timeout_s: float = 10.0) -> str:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        return response.read().decode()


def _port_in_use(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def _log_tail(path: Path, lines: int = 5) -> str:
    try:
        return " | ".join(path.read_text(errors="replace").strip().splitlines()[-lines:])
    except OSError:
        return ""


_group_alive = procs.group_alive


def _stop(proc: subprocess.Popen, grace_s: float = 30.0) -> None:
    """SIGTERM to the server's process group (vLLM's engine core runs in child processes), SIGKILL
    after `grace_s`, and wait until the whole group is gone: the next server needs its GPU memory."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + grace_s
    while _group_alive(proc.pid) and time.monotonic() < deadline:
        proc.poll()  # reap the leader
        time.sleep(0.1)
    if _group_alive(proc.pid):  # a live member keeps the group id ours
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    proc.wait()
    deadline = time.monotonic() + grace_s
    while _group_alive(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.1)


@contextlib.contextmanager
def running(command: list[str], *, port: int, log_path: Path, what: str, startup_timeout_s: float,
            env: dict | None = None, port_key: str = "evaluate.vllm_port"):
    """A vLLM server for the body of the `with`: started in its own process group (dying with
    this process), waited for on /health, stopped as a whole group on every exit path. Yields
    its base URL."""
    if _port_in_use(port):
        raise HostError(f"{port_key}: port {port} is already in use; stop that server or pick another port")
    base = f"http://127.0.0.1:{port}"
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w") as log:
        proc = procs.spawn(command, env=env, stdout=log, stderr=subprocess.STDOUT)  # own group: stopped as a whole
    try:
        deadline = time.monotonic() + startup_timeout_s
        while True:
            if proc.poll() is not None:
                raise ServingError(f"vLLM ({what}) exited with code {proc.returncode} before answering /health; "
                                   f"log {log_path}: {_log_tail(log_path)}")
            try:
                http_text(f"{base}/health", timeout_s=5)
                break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                if time.monotonic() > deadline:
                    raise ServingError(f"vLLM ({what}) did not answer /health within {startup_timeout_s:.0f} s; "
                                       f"log {log_path}") from None
                time.sleep(1.0)
        yield base
    finally:
        _stop(proc)


def benchmark_server(command: list[str], *, port: int, prompts: list, max_tokens: int, log_path: Path,
                     speculative: bool, startup_timeout_s: float = 1800.0, request_timeout_s: float = 600.0) -> dict:
    """Start one server, time the prompts on it, stop it. Returns output_tokens, wall_s,
    output_tokens_per_s, texts, and spec (the spec-decode delta, speculative servers only)."""
    what = "speculative" if speculative else "plain"
    with running(command, port=port, log_path=log_path, what=what, startup_timeout_s=startup_timeout_s) as base:
        def complete(prompt, n):
            body = {"model": SERVED_NAME, "prompt": prompt, "max_tokens": n, "temperature": 0.0}
            try:
                return json.loads(http_text(f"{base}/v1/completions", body, timeout_s=request_timeout_s))
            except urllib.error.HTTPError as err:
                detail = err.read().decode(errors="replace").strip().replace("\n", " ")[:300]
                raise ServingError(f"vLLM ({what}) refused a completion: HTTP {err.code} {detail}") from None

        complete(prompts[0], min(8, max_tokens))  # warm-up: first-request allocations, outside the timing
        before = parse_spec_decode_metrics(http_text(f"{base}/metrics")) if speculative else None
        texts, output_tokens, started = [], 0, time.perf_counter()
        for prompt in prompts:
            reply = complete(prompt, max_tokens)
            texts.append(reply["choices"][0]["text"])
            output_tokens += int(reply["usage"]["completion_tokens"])
        wall_s = time.perf_counter() - started
        spec = spec_decode_delta(before, parse_spec_decode_metrics(http_text(f"{base}/metrics"))) if speculative else None
    return {"output_tokens": output_tokens, "wall_s": wall_s, "output_tokens_per_s": output_tokens / max(wall_s, 1e-9),
            "texts": texts, "spec": spec}


def summarize(spec_run: dict, plain_run: dict, num_speculative_tokens: int) -> dict:
    """The `eval/vllm_*` metrics of a speculative and a plain run of the same prompts."""
    spec = spec_run["spec"]
    out = {
        "eval/vllm_measured_acc_len": spec["mean_acceptance_length"],
        "eval/vllm_output_tokens_per_s": spec_run["output_tokens_per_s"],
        "eval/vllm_plain_output_tokens_per_s": plain_run["output_tokens_per_s"],
        "eval/vllm_speedup": spec_run["output_tokens_per_s"] / max(plain_run["output_tokens_per_s"], 1e-9),
        "eval/vllm_drafts": spec["num_drafts"],
        "eval/vllm_num_speculative_tokens": num_speculative_tokens,
        "eval/vllm_prompts": len(spec_run["texts"]),
        # greedy speculation is lossless up to GPU numerics: a low figure points at a wrong draft setup
        "eval/vllm_output_match_frac": sum(a == b for a, b in zip(spec_run["texts"], plain_run["texts"], strict=True))
        / max(len(spec_run["texts"]), 1),
    }
    for k, rate in enumerate(spec["acceptance_per_position"]):
        out[f"eval/vllm_accept_rate_{k}"] = rate
    return out


def run_benchmark(*, target: str, draft_dir: Path, prompts: list, num_speculative_tokens: int, max_tokens: int,
                  port: int, gpu_memory_utilization: float, log_dir: Path, startup_timeout_s: float = 1800.0) -> dict:
    """Speculative then plain vLLM server on the same prompts; `eval/vllm_*` metrics."""
    from draftlab.models import check_against_target

    require_gpu_and_vllm()
    draft_dir = Path(draft_dir)
    config = draft_dir / "config.json"
    if not config.is_file() or "speculators_model_type" not in (draft_cfg := json.loads(config.read_text())):
        raise ParamsError(f"{draft_dir}: not an exported draft (no speculators config.json); run `draftlab export`")
    if (Path(target) / "config.json").is_file():
        check_against_target(draft_cfg, json.loads((Path(target) / "config.json").read_text()), None,
                             source=str(config))
    if not prompts:
        raise ParamsError("evaluate.num_prompts: no held-out prompts to send to vLLM")
    runs = {}
    for speculative in (True, False):
        what = "speculative" if speculative else "plain"
        command = vllm_serve_command(target, draft_dir.resolve(), num_speculative_tokens=num_speculative_tokens,
                                     port=port, gpu_memory_utilization=gpu_memory_utilization,
                                     speculative=speculative)
        runs[what] = benchmark_server(command, port=port, prompts=prompts, max_tokens=max_tokens,
                                      log_path=Path(log_dir) / f"vllm_{what}.log", speculative=speculative,
                                      startup_timeout_s=startup_timeout_s)
    return summarize(runs["speculative"], runs["plain"], num_speculative_tokens)


def _main() -> None:
    import argparse

    from draftlab.serve.specdec import held_out_prompts

    ap = argparse.ArgumentParser(description="vLLM serving benchmark of an exported EAGLE-3 draft (GPU hosts)")
    ap.add_argument("--target", required=True, help="target folder or hub id")
    ap.add_argument("--draft", required=True, help="exported draft folder (`draftlab export`)")
    ap.add_argument("--data", required=True, help="prepared dataset (held-out prompts)")
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--train-ratio", type=float, default=0.9)
    ap.add_argument("--port", type=int, default=8011)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    ap.add_argument("--log-dir", default="reports/vllm")
    args = ap.parse_args()
    prompts = held_out_prompts(args.data, args.train_ratio, args.num_prompts)
    print(json.dumps(run_benchmark(target=args.target, draft_dir=Path(args.draft), prompts=prompts,
                                   num_speculative_tokens=args.k, max_tokens=args.max_tokens, port=args.port,
                                   gpu_memory_utilization=args.gpu_memory_utilization,
                                   log_dir=Path(args.log_dir)), indent=1))


if __name__ == "__main__":
    _main()
