"""What the packages the CPU lock leaves out would cost every process that imports speculators:
`import speculators, speculators.train.trainer` (what a training rank, extraction and evaluation
import first) in the venv as it is, against the same venv with scikit-learn, scipy, skops, joblib
and threadpoolctl put back on its path, side by side in one run.

mlflow declares those five for its sklearn flavour and model evaluation, which draftlab never uses;
transformers imports scikit-learn and scipy wherever they are installed (requirements/common.txt).
The "with" arm needs them in a folder of their own, outside the venv:

    .venv/bin/uv pip install --python .venv/bin/python --target /tmp/left-out --no-deps \\
        --compile-bytecode scikit-learn==1.9.1 scipy==1.17.1 skops==0.16.0 joblib==1.6.0 threadpoolctl==3.8.0
    python benchmarks/left_out_imports.py --with /tmp/left-out            # 8 pairs
    python benchmarks/left_out_imports.py --with /tmp/left-out --pairs 12

Each pair runs both arms in fresh interpreters, alternating which goes first; it prints each arm's
median and min-max wall-clock and CPU, and the median of the per-pair ratios without ÷ with. The
import asserts which arm it is (scikit-learn loaded or not), so a venv that still holds scikit-learn
is refused. Nothing passes or fails on timing.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

CODE = ("import sys, speculators, speculators.train.trainer\n"
        "loaded = 'sklearn' in sys.modules\n"
        "sys.exit(0 if loaded == {want} else 3)\n")


def one(with_dir: Path | None) -> tuple[float, float]:
    """(wall s, CPU s) of one import in a fresh interpreter; with_dir: the left-out packages' folder."""
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    if with_dir is not None:
        env["PYTHONPATH"] = str(with_dir)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", CODE.format(want=with_dir is not None)], env=env,
                          capture_output=True, text=True)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode == 3:
        sys.exit("left_out_imports: scikit-learn is " + ("not found on --with's path" if with_dir else
                 "installed in this venv; the 'without' arm needs a venv made from requirements/cpu.txt"))
    if done.returncode != 0:
        sys.exit(f"left_out_imports: the import failed:\n{done.stderr[-2000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--with", dest="with_dir", type=Path, required=True,
                    help="folder holding scikit-learn, scipy, skops, joblib and threadpoolctl")
    ap.add_argument("--pairs", type=int, default=8)
    args = ap.parse_args()
    if not (args.with_dir / "sklearn").is_dir():
        sys.exit(f"left_out_imports: --with {args.with_dir} holds no sklearn package (see this script's docstring)")
    runs: dict[str, list[tuple[float, float]]] = {"with": [], "without": []}
    for i in range(args.pairs):
        arms = ["with", "without"] if i % 2 == 0 else ["without", "with"]
        for arm in arms:
            runs[arm].append(one(args.with_dir if arm == "with" else None))
        print(f"pair {i + 1}/{args.pairs}: with {runs['with'][-1][0]:.2f} s, without {runs['without'][-1][0]:.2f} s",
              flush=True)
    print(f"\n`import speculators, speculators.train.trainer`, {args.pairs} pairs, alternating order")
    for arm in ("with", "without"):
        wall, cpu = [r[0] for r in runs[arm]], [r[1] for r in runs[arm]]
        print(f"  {arm:8s} wall {statistics.median(wall):.2f} s ({min(wall):.2f}-{max(wall):.2f}), "
              f"CPU {statistics.median(cpu):.2f} s ({min(cpu):.2f}-{max(cpu):.2f})")
    ratios = [b[0] / a[0] for a, b in zip(runs["with"], runs["without"])]
    saved = [a[1] - b[1] for a, b in zip(runs["with"], runs["without"])]
    print(f"  without ÷ with, wall: {statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f}); "
          f"CPU saved per process: {statistics.median(saved):.2f} s ({min(saved):.2f}-{max(saved):.2f})")


if __name__ == "__main__":
    main()
