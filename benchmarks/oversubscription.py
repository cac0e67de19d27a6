"""What CPU oversubscription costs the tiny default, with torch's default threads and with
draftlab's (draftlab.threads: budget from usable CPUs, OpenMP passive wait), side by side.

The workload is the tiny target's pre-training loop (`draftlab target`'s 300-step loop, the
first heavy thing a tiny pipeline does), `--steps` steps of it in a fresh process. For each
setting it runs one copy alone and `--copies` copies at once (2 on 2 cores = "2×"), repeats
interleaved (default alone, default side by side, draftlab alone, draftlab side by side, then
the reverse), and prints seconds per step and slowdown = side-by-side / alone, median and
min–max. The machine's load average is printed beside it: other work counts as load too.

    python benchmarks/oversubscription.py                  # 40 steps, 2 copies, 2 rounds
    python benchmarks/oversubscription.py --steps 60 --rounds 3 --json reports/oversubscription.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

CHILD = r"""
import sys, time
from draftlab.params import Params
from draftlab.stages import target as t
tiny = Params().target.tiny.model_copy(update={"pretrain_steps": int(sys.argv[1])})
tok = t.build_tokenizer()
model = t.build_model(tiny, tok)
class P:
    def add_task(self, *a, **k): return 0
    def update(self, *a, **k): pass
import torch
start = time.perf_counter()
t._pretrain(model, tok, tiny, P())
print(f"{time.perf_counter() - start:.3f} {torch.get_num_threads()}")
"""


def env_for(setting: str) -> dict:
    base = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OMP_WAIT_POLICY")}
    if setting == "default":
        return base
    from draftlab import threads

    return threads.thread_env(1, base)


def run(setting: str, copies: int, steps: int, timeout_s: float) -> tuple[list[float], int]:
    env = env_for(setting)
    procs = [subprocess.Popen([sys.executable, "-c", CHILD, str(steps)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, text=True) for _ in range(copies)]
    out = []
    nthreads = 0
    for p in procs:
        try:
            text, _ = p.communicate(timeout=timeout_s)
            secs, nthreads = text.split()[-2:]
            out.append(float(secs) / steps)
        except subprocess.TimeoutExpired:
            p.kill()
            p.communicate()
            out.append(float("inf"))
    return out, int(nthreads)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--copies", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--timeout-s", type=float, default=600)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    from draftlab import threads

    print(f"usable CPUs {threads.usable_cpus()}, os.cpu_count {os.cpu_count()}, load average {os.getloadavg()}")
    per: dict[tuple[str, int], list[float]] = {}
    slow: dict[str, list[float]] = {"default": [], "draftlab": []}
    nthreads: dict[str, int] = {}
    order = [("default", 1), ("default", a.copies), ("draftlab", 1), ("draftlab", a.copies)]
    for r in range(a.rounds):
        alone: dict[str, float] = {}
        for setting, copies in (order if r % 2 == 0 else order[::-1]):
            load = os.getloadavg()[0]
            s_per_step, nthreads[setting] = run(setting, copies, a.steps, a.timeout_s)
            m = statistics.median(s_per_step)
            per.setdefault((setting, copies), []).append(m)
            print(f"round {r}: {setting:8s} × {copies}: {m * 1000:8.1f} ms/step ({nthreads[setting]} threads each; "
                  f"load before {load:.2f})", flush=True)
            if copies == 1:
                alone[setting] = m
        for setting in slow:
            slow[setting].append(per[(setting, a.copies)][-1] / alone[setting])
    summary = {}
    for setting, values in slow.items():
        med = statistics.median(values)
        summary[setting] = {"threads": nthreads[setting], "slowdown_median": med, "slowdown_min": min(values),
                            "slowdown_max": max(values),
                            "alone_ms_per_step": statistics.median(per[(setting, 1)]) * 1000,
                            "side_by_side_ms_per_step": statistics.median(per[(setting, a.copies)]) * 1000}
        print(f"{setting:8s}: {a.copies}× oversubscription slows a step {med:.2f}× ({min(values):.2f}–{max(values):.2f}); "
              f"alone {summary[setting]['alone_ms_per_step']:.0f} ms, side by side "
              f"{summary[setting]['side_by_side_ms_per_step']:.0f} ms ({nthreads[setting]} threads per process)")
    print(f"load average after: {os.getloadavg()}")
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps({"steps": a.steps, "copies": a.copies, "rounds": a.rounds, **summary}, indent=2))


if __name__ == "__main__":
    main()
