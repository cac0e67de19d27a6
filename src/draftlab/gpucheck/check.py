"""What `scripts/gpu-check.sh` runs: one command that proves a GPU host in at most 6 minutes.

    scripts/gpu-check.sh [--out reports/gpu-check.json] [--wheels DIR]

Steps, each in a child process under its own timeout, the whole run under one budget:
  image      first, inside draftlab's GPU image only (DRAFTLAB_IMAGE=gpu): torch, vllm,
             flash_attn, speculators and transformers import, torch has sm_120 kernels
  host       versions found (Python, torch, CUDA, transformers, speculators, vllm, triton), GPUs
  pipeline   the tiny default pipeline end to end on the GPU: target → prepare → extract → train
             (nccl, 1 rank, speculators' GPU defaults: flex attention + fused Triton loss, or eager
             with the reason tagged in the MLflow run when a kernel cannot compile) → evaluate →
             export; MFU and GPU power fraction from the training run
  extract    the same samples extracted on GPU (bf16 autocast) and on CPU (fp32): max |Δ|
  ddp, fsdp  `draftlab train` on 2 ranks (needs 2 GPUs, else skipped with that reason)
  vllm       `vllm serve` of the exported draft, acceptance from its Prometheus counters (needs vllm)
The JSON (`--out`) is rewritten after every step, so a run cut short still reports. Only the
standard library is imported here: a host missing a package gets that as a step's reason. Exit
code 0: nothing failed; 1: a step failed; 4: no CUDA device (nothing was proved).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

BUDGET_S = 330.0  # the 6-minute promise, less start-up and margin
RESULT = "gpu-check-result "
IMAGE_STEP_S = 120.0
STEPS = [("pipeline", 170.0), ("extract", 60.0), ("ddp", 60.0), ("fsdp", 60.0), ("vllm", 150.0)]
PACKAGES = ("torch", "transformers", "speculators", "vllm", "triton", "mlflow", "datasets", "draftlab")


def _version(package: str) -> str | None:
    import importlib.metadata as md

    try:
        return md.version(package)
    except md.PackageNotFoundError:
        return None


def host() -> dict:
    info = {"python": sys.version.split()[0], "executable": sys.executable,
            "versions": {p: _version(p) for p in PACKAGES}, "cuda": False, "gpus": []}
    try:
        import torch

        info["cuda"] = torch.cuda.is_available()
        info["torch_cuda"] = torch.version.cuda
        info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    except ImportError as err:
        info["error"] = f"torch not importable: {err}"
    return info


class Report:
    def __init__(self, path: Path):
        self.path = Path(path)
        self.data = {"started": time.strftime("%Y-%m-%dT%H:%M:%S"), "host": {}, "steps": []}

    def add(self, name: str, status: str, seconds: float = 0.0, reason: str = "", **figures) -> None:
        self.data["steps"].append({"name": name, "status": status, "seconds": round(seconds, 1),
                                   "reason": reason, "figures": figures})
        self.write()

    def write(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        tmp.write_text(json.dumps(self.data, indent=1) + "\n")
        os.replace(tmp, self.path)

    def table(self) -> str:
        rows = [f"{'step':<10} {'status':<6} {'s':>6}  figures / reason"]
        for s in self.data["steps"]:
            figs = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in s["figures"].items())
            rows.append(f"{s['name']:<10} {s['status']:<6} {s['seconds']:>6.1f}  "
                        + "; ".join(x for x in (figs, s["reason"]) if x))
        return "\n".join(rows)


def run_steps(report: Report, steps: list[tuple[str, list[str], float]], *, budget_s: float, log_dir: Path,
              env: dict | None = None) -> None:
    """Each step's command in a child under min(its timeout, what is left of the budget). A step
    reports by printing one `RESULT` JSON line {status, reason, figures}."""
    deadline = time.monotonic() + budget_s
    log_dir.mkdir(parents=True, exist_ok=True)
    for name, argv, timeout_s in steps:
        left = deadline - time.monotonic()
        if left < 5:
            report.add(name, "skip", reason="no time left in the 6-minute budget")
            continue
        limit = min(timeout_s, left)
        started = time.monotonic()
        log = log_dir / f"{name}.log"
        with open(log, "w") as out:
            proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
            try:
                proc.wait(timeout=limit)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)
                proc.wait()
                report.add(name, "fail", time.monotonic() - started, f"timed out after {limit:.0f} s; log {log}")
                continue
        lines = [line for line in log.read_text(errors="replace").splitlines() if line.startswith(RESULT)]
        if lines:
            res = json.loads(lines[-1][len(RESULT):])
            report.add(name, res["status"], time.monotonic() - started, res.get("reason", ""), **res.get("figures", {}))
        else:
            tail = " | ".join(log.read_text(errors="replace").strip().splitlines()[-3:])
            report.add(name, "fail", time.monotonic() - started, f"exited with {proc.returncode}: {tail}")


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m draftlab.gpucheck.check")
    ap.add_argument("--out", default="reports/gpu-check.json")
    ap.add_argument("--work", default=None, help="scratch folder (default: beside --out)")
    ap.add_argument("--budget-s", type=float, default=BUDGET_S)
    ap.add_argument("--step", default=None, help=argparse.SUPPRESS)  # a child: run one step
    a = ap.parse_args(argv)
    out = Path(a.out)
    work = Path(a.work) if a.work else out.parent / "gpu-check-work"
    if a.step:
        from draftlab.gpucheck.steps import run_one

        print(RESULT + json.dumps(run_one(a.step, work)), flush=True)
        return 0
    report = Report(out)
    started = time.monotonic()
    image = os.environ.get("DRAFTLAB_IMAGE")
    if image == "gpu":
        step = [sys.executable, "-m", "draftlab.gpucheck.check", "--step", "image", "--work", str(work)]
        run_steps(report, [("image", step, IMAGE_STEP_S)], budget_s=IMAGE_STEP_S, log_dir=work / "logs")
    elif image:
        report.add("image", "skip", reason=f"draftlab's {image} image: vllm and flash-attn are the GPU image's")
    a.budget_s -= time.monotonic() - started
    report.data["host"] = info = host()
    report.add("host", "pass" if info["cuda"] else "skip", reason="" if info["cuda"] else "no CUDA device visible",
               gpus=len(info["gpus"]), torch=info["versions"]["torch"] or "absent")
    if not info["cuda"]:
        for name, _ in STEPS:
            report.add(name, "skip", reason="no CUDA device visible")
    else:
        env = dict(os.environ, MLFLOW_TRACKING_URI=f"sqlite:///{(work / 'mlflow.db').resolve()}")
        steps = [(name, [sys.executable, "-m", "draftlab.gpucheck.check", "--step", name, "--work", str(work)], t)
                 for name, t in STEPS]
        run_steps(report, steps, budget_s=a.budget_s, log_dir=work / "logs", env=env)
    report.data["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S")
    report.write()
    print(report.table())
    print(f"gpu-check: {out}")
    if not info["cuda"]:
        return 4
    return 1 if any(s["status"] == "fail" for s in report.data["steps"]) else 0


if __name__ == "__main__":
    sys.exit(main())
