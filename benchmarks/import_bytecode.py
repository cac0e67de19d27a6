"""What compiled bytecode saves every process: the imports a training rank, the launcher and a
vLLM server pay, with the venv's `.pyc` files against without them, side by side in one run.

An installer that compiles nothing (uv's default; pip compiles at install) leaves a venv without
`__pycache__`; on a host that sets PYTHONDONTWRITEBYTECODE (this project's CI and dev VMs do) Python
then compiles every module from source at every import, in every process, and writes nothing back.
The "source" arm reproduces that in the same venv: `-X pycache_prefix=<an empty folder>` with
PYTHONDONTWRITEBYTECODE=1 makes Python look for bytecode only where there is none. The "bytecode"
arm reads the venv's own `.pyc` files (scripts/lock-install.sh compiles them at install).

Each round times, in a fresh interpreter per import and the two arms alternating (which one goes
first swaps every round), the wall-clock of `import X` for each module below; it prints the median
and min-max per arm and the median of the per-round ratios source ÷ bytecode. Nothing passes or
fails on timing.

    python benchmarks/import_bytecode.py              # 5 rounds
    python benchmarks/import_bytecode.py --rounds 9
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

# (label, module, interpreter): what the launcher, a rank and a vLLM server each import first
IMPORTS = [
    ("launcher: mlflow's client", "mlflow.tracking.client", None),
    ("rank: torch", "torch", None),
    ("rank: speculators.train", "speculators.train", None),
    ("vLLM server: api_server", "vllm.entrypoints.openai.api_server", "vllm"),
]

TIMER = "import time, importlib; t = time.perf_counter(); importlib.import_module({mod!r}); print(time.perf_counter() - t)"


def _time_import(python: str, module: str, *, source: bool, empty: str) -> float:
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
    cmd = [python]
    if source:
        cmd += ["-X", f"pycache_prefix={empty}"]
    cmd += ["-c", TIMER.format(mod=module)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def _spread(xs: list[float]) -> str:
    return f"{statistics.median(xs):.2f} ({min(xs):.2f}-{max(xs):.2f})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    from draftlab.serve.vllm_env import vllm_python

    pythons = {None: sys.executable}
    try:
        pythons["vllm"] = str(vllm_python())
    except Exception as err:  # noqa: BLE001 — the vLLM row is left out, with the reason
        print(f"vLLM's interpreter not found ({err}): its row is left out")
    rows = [r for r in IMPORTS if r[2] in pythons]
    times = {(label, arm): [] for label, _, _ in rows for arm in ("source", "bytecode")}
    with tempfile.TemporaryDirectory(prefix="draftlab-pycache-") as empty:
        for rnd in range(args.rounds):
            order = ("source", "bytecode") if rnd % 2 == 0 else ("bytecode", "source")
            for label, module, py in rows:
                for arm in order:
                    times[(label, arm)].append(_time_import(pythons[py], module, source=arm == "source", empty=empty))
                    assert not any(Path(empty).iterdir()), "the source arm wrote bytecode"
            print(f"round {rnd + 1}/{args.rounds} done", flush=True)
    print(f"\nimport wall-clock, s, median (min-max) over {args.rounds} rounds; load average {os.getloadavg()[0]:.1f}")
    print(f"{'import':32} {'from source':>20} {'bytecode':>20} {'source / bytecode':>18}")
    for label, _, _ in rows:
        src, pyc = times[(label, "source")], times[(label, "bytecode")]
        ratio = statistics.median(s / b for s, b in zip(src, pyc))
        print(f"{label:32} {_spread(src):>20} {_spread(pyc):>20} {ratio:>18.2f}")


if __name__ == "__main__":
    main()
