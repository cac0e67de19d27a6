"""Serving benchmark: the exported draft under vLLM, measured against the same server without
speculation (the `vllm` backend of `draftlab evaluate`), on a GPU host or on CPU.

Every vLLM server draftlab starts (`running`) listens on 127.0.0.1 on a free port chosen at start,
requires an API key generated for it (handed to vLLM as `VLLM_API_KEY`, so it is not on the command
line for `ps` to show), is ready only once `/v1/models` answers *with that key* (a server of
another process on the port answers 401 and is never taken for ours), and is stopped with its
whole process group on every exit path; a record of it (`serve.orphans`) lets the next run stop
its engine processes after a `kill -9` of draftlab. On a host with CUDA it is `vllm serve MODEL`;
elsewhere `python -m vllm.entrypoints.openai.api_server --model MODEL` from the python
`serve.vllm_env` finds (the suite's `.venv-vllm`), with `--enforce-eager` and
`VLLM_CPU_KVCACHE_SPACE`.

Each server is started in turn, warmed up with one request, then sent the fixed prompt set one
request at a time (OpenAI `/v1/completions`, greedy, token-id prompts). Output tokens/s is completion tokens over the
wall time of those requests. Acceptance comes from vLLM's own Prometheus counters scraped from
`/metrics` before and after the prompts (their difference, so warm-up does not count):
mean acceptance length = 1 + Δaccepted / Δdrafts (vLLM's convention, bonus token included) and
per-position rate k = Δaccepted_per_pos[k] / Δdrafts; the counters are also read after each prompt,
so each prompt's acceptance length is known (the spread of the figure).

    python -m draftlab.serve.serving --target models/target --draft models/draft --data data/prepared
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from draftlab import procs
from draftlab.errors import HostError, UserError
from draftlab.params import ParamsError
from draftlab.serve import orphans, vllm_env

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


def on_cuda_host() -> bool:
    from draftlab import devices

    return devices.cuda_count() > 0


def require_vllm() -> None:
    """One line when this host has no vLLM to start (raised before anything loads)."""
    try:
        vllm_env.vllm_python()
    except vllm_env.VllmMissing as err:
        raise ParamsError(f"evaluate.backend: `vllm` needs vLLM here: {err}; or use evaluate.backend: hf") from None


def server_prefix(model: str, *, gpu: bool | None = None) -> list[str]:
    """The command that serves `model` (arguments follow): `vllm serve` on a CUDA host with the
    `vllm` script, else vLLM's api_server module with the python `vllm_env` finds, on CPU eager."""
    gpu = on_cuda_host() if gpu is None else gpu
    if gpu and shutil.which("vllm"):
        return ["vllm", "serve", str(model)]
    prefix = [*vllm_env.api_server_command(), "--model", str(model)]
    return prefix if gpu else [*prefix, "--enforce-eager"]


def readme_command(serve_command: str, *, gpu: bool | None = None) -> list[str]:
    """The `vllm serve TARGET …` line of an export's README as this host starts it: itself on a
    CUDA host, the api_server module with the same arguments elsewhere (CPU, eager)."""
    import shlex

    words = shlex.split(serve_command)
    if words[:2] != ["vllm", "serve"] or len(words) < 3:
        raise ServingError(f"not a `vllm serve MODEL …` command: {serve_command}")
    return [*server_prefix(words[2], gpu=gpu), *words[3:]]


def server_env(env: dict | None = None, *, cpu: bool = False) -> dict:
    """The server's environment: VLLM_CPU_KVCACHE_SPACE (GiB) unless the user set it; AMX allowed
    where the CPU has it (vllm_env.server_env); `cpu` (a server started eager, as every CPU command
    here is): its model in the engine's process (vllm_env.cpu_server_env)."""
    env = vllm_env.server_env(os.environ if env is None else env)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    return vllm_env.cpu_server_env(env) if cpu else env


def vllm_serve_command(target: str, draft_dir: str | Path, *, num_speculative_tokens: int,
                       gpu_memory_utilization: float, speculative: bool, gpu: bool | None = None,
                       dtype: str | None = None, revision: str | None = None,
                       trust_remote_code: bool = False) -> list[str]:
    """vLLM serving the target, with the draft as an EAGLE-3 speculator when `speculative` (the
    `--speculative-config` of the export's README). Host, port and key are added by `running`.
    `revision`: a hub target's pinned commit, for its weights, code and tokenizer alike."""
    gpu = on_cuda_host() if gpu is None else gpu
    cmd = [*server_prefix(str(target), gpu=gpu), "--served-model-name", SERVED_NAME, "--seed", "0"]
    if gpu:
        cmd += ["--gpu-memory-utilization", str(gpu_memory_utilization)]
    if dtype:
        cmd += ["--dtype", dtype]
    if trust_remote_code:
        cmd.append("--trust-remote-code")
    if revision:
        cmd += ["--revision", revision, "--code-revision", revision, "--tokenizer-revision", revision]
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


def http_text(url: str, body: dict | None = None, timeout_s: float = 10.0, api_key: str | None = None) -> str:
    data = None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    request = urllib.request.Request(url, data=data, headers=headers)
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        return response.read().decode()


def free_port() -> int:
    """A port nothing listens on now, chosen by the kernel (127.0.0.1)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
    after `grace_s`, and wait until the whole group is gone: the next server needs its memory."""
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


@dataclass(frozen=True)
class Server:
    """A vLLM server draftlab started: where it listens and the key it requires."""

    base_url: str
    port: int
    api_key: str | None
    pid: int  # its leader, whose pid is its process group id

    def get(self, path: str, timeout_s: float = 10.0) -> str:
        return http_text(f"{self.base_url}{path}", timeout_s=timeout_s, api_key=self.api_key)

    def post(self, path: str, body: dict, timeout_s: float = 600.0) -> dict:
        return json.loads(http_text(f"{self.base_url}{path}", body, timeout_s=timeout_s, api_key=self.api_key))


def _listening_sockets(port: int) -> set[str]:
    """`socket:[inode]` of every TCP socket listening on `port` (/proc/net/tcp, tcp6)."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if len(fields) > 9 and fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                found.add(f"socket:[{fields[9]}]")
    return found


def group_listens_on(pgid: int, port: int) -> bool:
    """Whether a process of group `pgid` holds the socket listening on `port`."""
    sockets = _listening_sockets(port)
    if not sockets:
        return False
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[2]) != pgid:
                continue
            fd_dir = stat.parent / "fd"
            if any(os.readlink(fd_dir / fd) in sockets for fd in os.listdir(fd_dir)):
                return True
        except (OSError, ValueError, IndexError):
            continue
    return False


def _answers_as_ours(base: str, api_key: str | None, *, pgid: int, port: int) -> bool:
    """Whether the server on `base` is the one we started: with a key, its /v1/models answers that
    key (another server refuses it with 401); without one, /health answers and the listening
    socket belongs to a process of our group."""
    try:
        http_text(f"{base}/v1/models" if api_key else f"{base}/health", timeout_s=5, api_key=api_key)
    except urllib.error.HTTPError:
        return False  # 401: another server's port; 404/5xx: not ready
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
        return False
    return bool(api_key) or group_listens_on(pgid, port)


_ADDRESS_IN_USE = "address already in use"


@contextlib.contextmanager
def running(command: list[str], *, log_path: Path, what: str, startup_timeout_s: float,
            env: dict | None = None, port: int | None = None, port_key: str = "evaluate.vllm_port",
            api_key: bool = True):
    """A vLLM server for the body of the `with`; yields its `Server`.

    `command` serves the model (`vllm_serve_command`, `server_prefix` + arguments); this adds
    `--host 127.0.0.1 --port P` (P free, chosen now, unless `port` is given) and, with `api_key`,
    a generated key in VLLM_API_KEY. Started in its own process group (dying with this process)
    and recorded for `orphans`; ready once it answers as ours; stopped as a whole group on every
    exit path. A port lost to another process between choice and bind is chosen again (3 tries)."""
    for rec in orphans.stop_orphans():
        from draftlab.console import console

        console.print(f"[yellow]serve[/]: stopped a vLLM server ({rec['what']}, process group {rec['pgid']}, "
                      f"port {rec['port']}) that a killed draftlab run left running")
    if port is not None and _port_in_use(port):
        raise HostError(f"{port_key}: port {port} is already in use; stop that server, pick another port, "
                        "or set it to null (a free port is chosen)")
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    key = secrets.token_urlsafe(24) if api_key else None
    server_env_ = server_env(env, cpu="--enforce-eager" in command)  # server_prefix and extraction's CPU form
    if key:
        server_env_["VLLM_API_KEY"] = key
    # vLLM's ZeroMQ sockets between the API server and its engine are files named by a uuid, in /tmp
    # unless VLLM_RPC_BASE_PATH says otherwise, and a stopped server leaves them there: each server
    # gets a private folder of its own (mode 0700), removed with it (by stop_orphans after a kill -9)
    rpc_dir = None
    if "VLLM_RPC_BASE_PATH" not in server_env_:
        rpc_dir = tempfile.mkdtemp(prefix="draftlab-vllm-")
        server_env_["VLLM_RPC_BASE_PATH"] = rpc_dir
    try:
        for attempt in range(3):
            chosen = port if port is not None else free_port()
            base = f"http://127.0.0.1:{chosen}"
            with open(log_path, "w") as log:
                proc = procs.spawn([*command, "--host", "127.0.0.1", "--port", str(chosen)], env=server_env_,
                                   stdout=log, stderr=subprocess.STDOUT)  # own group: stopped as a whole
            rec_path = orphans.record(proc.pid, port=chosen, what=what, log_path=log_path, rpc_dir=rpc_dir)
            try:
                deadline = time.monotonic() + startup_timeout_s
                while not _answers_as_ours(base, key, pgid=proc.pid, port=chosen):
                    if proc.poll() is not None:
                        break
                    if time.monotonic() > deadline:
                        raise ServingError(f"vLLM ({what}) did not answer on {base} within "
                                           f"{startup_timeout_s:.0f} s; log {log_path}")
                    time.sleep(0.25)  # a refused connection costs nothing; a second's poll cost half a second a start
                else:
                    yield Server(base_url=base, port=chosen, api_key=key, pid=proc.pid)
                    return
                lost_port = _ADDRESS_IN_USE in log_path.read_text(errors="replace").lower()
                if not (lost_port and port is None and attempt < 2):
                    raise ServingError(f"vLLM ({what}) exited with code {proc.returncode} before answering; "
                                       f"log {log_path}: {_log_tail(log_path)}")
            finally:
                _stop(proc)
                orphans.forget(rec_path)
    finally:
        if rpc_dir is not None:
            shutil.rmtree(rpc_dir, ignore_errors=True)


def benchmark_server(command: list[str], *, prompts: list, max_tokens: int, log_path: Path, speculative: bool,
                     stop_token_ids: list[int] = (), startup_timeout_s: float = 1800.0,
                     request_timeout_s: float = 600.0, port: int | None = None) -> dict:
    """Start one server, time the prompts on it, stop it. Returns output_tokens, wall_s,
    output_tokens_per_s, texts, token_ids (per prompt), and for speculative servers spec (the
    spec-decode delta over all prompts) and per_prompt (each prompt's own delta)."""
    what = "speculative" if speculative else "plain"
    with running(command, log_path=log_path, what=what, startup_timeout_s=startup_timeout_s, port=port) as server:
        def complete(prompt, n):
            body = {"model": SERVED_NAME, "prompt": prompt, "max_tokens": n, "temperature": 0.0,
                    "stop_token_ids": list(stop_token_ids), "return_token_ids": True}
            try:
                return server.post("/v1/completions", body, timeout_s=request_timeout_s)
            except urllib.error.HTTPError as err:
                detail = err.read().decode(errors="replace").strip().replace("\n", " ")[:300]
                raise ServingError(f"vLLM ({what}) refused a completion: HTTP {err.code} {detail}") from None

        def counters():
            return parse_spec_decode_metrics(server.get("/metrics")) if speculative else None

        complete(prompts[0], min(8, max_tokens))  # warm-up: first-request allocations, outside the timing
        texts, token_ids, per_prompt, output_tokens, wall_s = [], [], [], 0, 0.0
        first = before = counters()
        for prompt in prompts:
            started = time.perf_counter()
            reply = complete(prompt, max_tokens)
            wall_s += time.perf_counter() - started  # the scrapes between prompts are not timed
            choice = reply["choices"][0]
            texts.append(choice["text"])
            token_ids.append(list(choice.get("token_ids") or []))
            output_tokens += int(reply["usage"]["completion_tokens"])
            if speculative:
                after = counters()
                per_prompt.append(spec_decode_delta(before, after))
                before = after
        spec = spec_decode_delta(first, before) if speculative else None
    return {"output_tokens": output_tokens, "wall_s": wall_s, "output_tokens_per_s": output_tokens / max(wall_s, 1e-9),
            "texts": texts, "token_ids": token_ids, "spec": spec, "per_prompt": per_prompt}


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
        # greedy speculation is lossless up to numerics: a low figure points at a wrong draft setup
        "eval/vllm_output_match_frac": sum(a == b for a, b in zip(spec_run["texts"], plain_run["texts"], strict=True))
        / max(len(spec_run["texts"]), 1),
    }
    for k, rate in enumerate(spec["acceptance_per_position"]):
        out[f"eval/vllm_accept_rate_{k}"] = rate
    return out


def run_benchmark(*, target: str, draft_dir: Path, prompts: list, num_speculative_tokens: int, max_tokens: int,
                  log_dir: Path, gpu_memory_utilization: float = 0.85, stop_token_ids: list[int] = (),
                  dtype: str | None = None, startup_timeout_s: float = 1800.0, port: int | None = None,
                  runs_out: dict | None = None, revision: str | None = None, trust_remote_code: bool = False) -> dict:
    """Speculative then plain vLLM server on the same prompts; `eval/vllm_*` metrics. `runs_out`,
    when given, receives both runs (their texts, token ids and per-prompt counters)."""
    from draftlab.models import check_against_target

    require_vllm()
    draft_dir = Path(draft_dir)
    config = draft_dir / "config.json"
    if not config.is_file() or "speculators_model_type" not in (draft_cfg := json.loads(config.read_text())):
        raise ParamsError(f"{draft_dir}: not an exported draft (no speculators config.json); run `draftlab export`")
    if (Path(target) / "config.json").is_file():
        check_against_target(draft_cfg, json.loads((Path(target) / "config.json").read_text()), None,
                             source=str(config))
    if not prompts:
        raise ParamsError("evaluate.num_prompts: no held-out prompts to send to vLLM")
    runs = {} if runs_out is None else runs_out
    for speculative in (True, False):
        what = "speculative" if speculative else "plain"
        command = vllm_serve_command(target, draft_dir.resolve(), num_speculative_tokens=num_speculative_tokens,
                                     gpu_memory_utilization=gpu_memory_utilization, speculative=speculative,
                                     dtype=dtype, revision=revision, trust_remote_code=trust_remote_code)
        runs[what] = benchmark_server(command, prompts=prompts, max_tokens=max_tokens,
                                      log_path=Path(log_dir) / f"vllm_{what}.log", speculative=speculative,
                                      stop_token_ids=stop_token_ids, startup_timeout_s=startup_timeout_s, port=port)
    return summarize(runs["speculative"], runs["plain"], num_speculative_tokens)


def _main() -> None:
    import argparse

    from draftlab.serve.specdec import held_out_prompts

    ap = argparse.ArgumentParser(description="vLLM serving benchmark of an exported EAGLE-3 draft")
    ap.add_argument("--target", required=True, help="target folder or hub id")
    ap.add_argument("--draft", required=True, help="exported draft folder (`draftlab export`)")
    ap.add_argument("--data", required=True, help="prepared dataset (held-out prompts)")
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--train-ratio", type=float, default=0.9)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    ap.add_argument("--log-dir", default="reports/vllm")
    args = ap.parse_args()
    prompts = held_out_prompts(args.data, args.train_ratio, args.num_prompts)
    print(json.dumps(run_benchmark(target=args.target, draft_dir=Path(args.draft), prompts=prompts,
                                   num_speculative_tokens=args.k, max_tokens=args.max_tokens,
                                   gpu_memory_utilization=args.gpu_memory_utilization,
                                   log_dir=Path(args.log_dir)), indent=1))


if __name__ == "__main__":
    _main()
