"""Same budget, side by side: plain Optuna (`study.optimize(objective, timeout=budget)`) against
`draftlab sweep`, both over experiments/sweep-tiny.yaml's space on the tiny default, both
running the very same trial process (`python -m draftlab.sweep.trial`: draftlab train + evaluate,
started by the sweep's own launcher).

Plain Optuna runs one trial at a time (a trial with train.gpus = 2 takes both slots; running
trials side by side without knowing their GPU counts would oversubscribe), samples with the same
seeded TPE, and its `timeout=` only stops *starting* trials. `draftlab sweep` calibrates, rejects
what cannot fit, stops what overruns and packs trials onto the device slots.

Printed per repeat and as median (min–max): wall-clock, overrun past the budget, trials
completed, trials rejected for free, best objective. The order of the two alternates from repeat
to repeat. Needs the pipeline's outputs (`dvc repro`, or at least up to extract). Everything goes
to a temp dir (its own MLflow store and Optuna journals). Nothing passes or fails on timing.

    python benchmarks/sweep_budget.py                 # budget 5m, 1 repeat: ~11 min here
    python benchmarks/sweep_budget.py --budget 8m --repeats 2 --json reports/sweep_budget.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--space", type=Path, default=REPO / "experiments/sweep-tiny.yaml")
    ap.add_argument("--budget", default="5m")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--devices", default="2")
    ap.add_argument("--target", type=Path, default=REPO / "models/target")
    ap.add_argument("--data", type=Path, default=REPO / "data/prepared")
    ap.add_argument("--store", type=Path, default=REPO / "data/hidden_states")
    ap.add_argument("--json", type=Path, default=None, help="also write the figures here")
    return ap.parse_args(argv)


def plain_optuna(args, spec, base, tmp: Path, tag: str) -> dict:
    """The baseline: Optuna's timeout=, one trial process at a time."""
    import optuna
    from optuna.storages.journal import JournalFileBackend

    from draftlab.sweep.budget import TrialSpec
    from draftlab.sweep.propose import suggest
    from draftlab.sweep.space import trial_params
    from draftlab.sweep.trial import ProcessLauncher

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    out = tmp / f"plain-{tag}"
    out.mkdir(parents=True)
    storage = optuna.storages.JournalStorage(JournalFileBackend(str(out / "journal.log")))
    study = optuna.create_study(study_name="plain", storage=storage, direction=spec.objective.direction,
                                sampler=optuna.samplers.TPESampler(seed=spec.seed))

    launcher = ProcessLauncher(study="plain", metric=spec.objective.metric, target_dir=args.target,
                               data_dir=args.data, store_dir=args.store, parent_run_id=None, gpu_slots=False)

    def objective(trial):
        values = suggest(trial, spec, base)
        params = trial_params(base, values)
        handle = launcher.start(TrialSpec(trial.number, values, params, [f"cpu{i}" for i in range(params.train.gpus)],
                                          "search", out / f"trial-{trial.number:04d}"))
        while (res := handle.poll()) is None:
            time.sleep(1)
        if not res.ok:
            raise optuna.TrialPruned(res.message)
        return res.objective

    started = time.time()
    study.optimize(objective, timeout=spec.budget_s)
    wall = time.time() - started
    done = [t for t in study.trials if t.state.name == "COMPLETE"]
    return {"wall_s": wall, "overrun_s": max(wall - spec.budget_s, 0.0), "completed": len(done), "rejected": 0,
            "stopped": 0, "best": study.best_value if done else None}


def draftlab_sweep(args, spec, tmp: Path, tag: str) -> dict:
    out = tmp / f"draftlab-{tag}"
    cmd = [sys.executable, "-m", "draftlab.cli", "sweep", str(args.space), "--budget", str(args.budget),
           "--devices", args.devices, "--study", f"bench-{tag}", "--out", str(out), "--target", str(args.target),
           "--data", str(args.data), "--store", str(args.store)]
    started = time.time()
    # a store of its own: a second repeat must calibrate again, not reuse the first one's trials
    env = dict(os.environ, MLFLOW_TRACKING_URI=f"sqlite:///{tmp / f'mlflow-draftlab-{tag}.db'}")
    with open(tmp / f"draftlab-{tag}.log", "wb") as log:
        rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=env).returncode
    wall = time.time() - started
    if rc != 0:
        raise SystemExit(f"draftlab sweep exited {rc}; see {tmp / f'draftlab-{tag}.log'}")
    s = json.loads((out / f"bench-{tag}" / "report" / "summary.json").read_text())
    t = s["trials"]
    return {"wall_s": wall, "overrun_s": max(wall - spec.budget_s, 0.0), "spent_s": s["spent_s"],
            "completed": t["completed"], "rejected": t["rejected"],
            "stopped": t["stopped-cap"] + t["stopped-budget"] + t["pruned"], "best": s.get("best", {}).get("value")}


def _med(values) -> str:
    vals = [v for v in values if v is not None]
    if not vals:
        return "—"
    return f"{statistics.median(vals):.3f} ({min(vals):.3f}–{max(vals):.3f})"


def main(argv=None) -> None:
    args = parse_args(argv)
    sys.path.insert(0, str(REPO / "src"))
    from draftlab.params import load_params
    from draftlab.sweep.space import read_spec

    spec = read_spec(args.space, budget=args.budget)
    base = load_params(REPO / spec.params)
    tmp = Path(tempfile.mkdtemp(prefix="sweep-bench-"))
    os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{tmp / 'mlflow.db'}"
    print(f"budget {spec.budget_s:,.0f} s, space {args.space.name}, devices {args.devices}; temp dir {tmp}")
    rows = {"plain": [], "draftlab": []}
    for r in range(args.repeats):
        order = ("plain", "draftlab") if r % 2 == 0 else ("draftlab", "plain")
        for name in order:
            res = (plain_optuna(args, spec, base, tmp, str(r)) if name == "plain"
                   else draftlab_sweep(args, spec, tmp, str(r)))
            rows[name].append(res)
            spent = f" (budget spent {res['spent_s']:.1f} s)" if "spent_s" in res else ""
            print(f"repeat {r} {name:8s}: wall {res['wall_s']:7.1f} s{spent}, overrun {res['overrun_s']:6.1f} s "
                  f"({100 * res['overrun_s'] / spec.budget_s:4.1f}%), completed {res['completed']}, rejected "
                  f"{res['rejected']}, stopped/pruned {res['stopped']}, best {res['best']}", flush=True)
    print(f"\nover {args.repeats} repeat(s), median (min–max); budget {spec.budget_s:,.0f} s")
    for name, rs in rows.items():
        print(f"{name:8s}: overrun {_med([x['overrun_s'] for x in rs])} s, completed "
              f"{_med([x['completed'] for x in rs])}, rejected {_med([x['rejected'] for x in rs])}, "
              f"best {spec.objective.metric} {_med([x['best'] for x in rs])}")
    if args.json:
        args.json.write_text(json.dumps({"budget_s": spec.budget_s, "runs": rows}, indent=1))


if __name__ == "__main__":
    main()
