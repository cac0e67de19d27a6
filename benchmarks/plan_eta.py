"""How close are `draftlab plan`'s wall-clock and the training ETA to what `draftlab train` really
takes? Both come from draftlab.plan.costmodel (start-up + steps × s/step + epoch boundaries × s/epoch).

For each GPU count (`--gpus 1,2`), each repeat:
  C  a calibration: `draftlab train` on the profile with train.epochs 2, train.max_steps N (a
     step-limited run, tagged draftlab.calibration) into a temp MLflow store;
  P  `draftlab plan --json --gpus n`: it finds C in that store (costmodel.points_from_mlflow, the
     lookup the sweep uses) and predicts the profile's run;
  A  the profile's own `draftlab train` at n ranks, timed from process start to exit.
C+P and A alternate order from repeat to repeat. Printed per repeat and as median and min–max:
  plan / actual      predicted ÷ actual wall-clock (goal: within ±10 %);
  ETA at 10 %        (perf/eta_s at the step nearest 10 % of the steps) ÷ (the run's end − that
                     step's time), as error = ratio − 1 (goal: within ±5 % on an idle machine);
  range coverage     along the run, the share of steps whose 10–90 % range (perf/eta_p10_s ..
                     perf/eta_p90_s) holds the actual time left (goal: ≥ 80 % under load).
The run's end is the training process's exit; MLflow metric timestamps give each step's time.
The load average before each run is printed: other work on the machine is load too.

Nothing passes or fails on timing. Everything is written to a temp dir (MLflow:
sqlite:///<tmp>/mlflow.db), never to runs/ or mlflow.db.

    python benchmarks/plan_eta.py --total-seq-len 256                  # the README's 63-step profile
    python benchmarks/plan_eta.py --total-seq-len 256 --epochs 12      # 4× the steps
    python benchmarks/plan_eta.py --gpus 1,2 --repeats 3 --json reports/plan_eta.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ETA_AT = 0.10


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", type=Path, default=REPO / "params.yaml", help="the profile to plan and run")
    ap.add_argument("--target", type=Path, default=REPO / "models/target")
    ap.add_argument("--data", type=Path, default=REPO / "data/prepared")
    ap.add_argument("--store", type=Path, default=REPO / "data/hidden_states")
    ap.add_argument("--gpus", default="1", help="rank counts, comma-separated")
    ap.add_argument("--total-seq-len", type=int, default=None, help="override train.total_seq_len")
    ap.add_argument("--epochs", type=int, default=None, help="override train.epochs (more steps)")
    ap.add_argument("--calibration-steps", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--json", type=Path, default=None)
    return ap.parse_args(argv)


def child_env(tmp: Path) -> dict:
    bindir = str(Path(sys.executable).parent)
    env = dict(os.environ, MLFLOW_TRACKING_URI=f"sqlite:///{tmp / 'mlflow.db'}", HF_HUB_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1", COLUMNS="200",
               PATH=f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}")
    for var in ("MLFLOW_RUN_ID", "DRAFTLAB_RUN_DIR", "MLFLOW_EXPERIMENT_NAME", "MLFLOW_EXPERIMENT_ID"):
        env.pop(var, None)
    return env


def draftlab(*args: str) -> list[str]:
    exe = Path(sys.executable).with_name("draftlab")
    return [str(exe), *args] if exe.exists() else [sys.executable, "-c", "from draftlab.cli import main; main()", *args]


def timed(cmd: list[str], *, cwd: Path, env: dict, log: Path) -> tuple[float, float]:
    """(wall-clock s, end time) of a command that must succeed."""
    started = time.perf_counter()
    with open(log, "w") as f:
        rc = subprocess.run(cmd, cwd=cwd, env=env, stdout=f, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        tail = "".join(log.read_text().splitlines(keepends=True)[-8:])
        raise SystemExit(f"{' '.join(cmd[:3])} … failed (exit {rc}); see {log}:\n{tail}")
    return time.perf_counter() - started, time.time()


def write_params(args, tmp: Path, name: str, **train) -> Path:
    import yaml

    raw = yaml.safe_load(args.params.read_text()) or {}
    t = raw.setdefault("train", {})
    if args.total_seq_len:
        t["total_seq_len"] = args.total_seq_len
    if args.epochs:
        t["epochs"] = args.epochs
    t.update(train)
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def train(args, tmp: Path, env: dict, name: str, params: Path) -> dict:
    out = tmp / name
    wall, end = timed(draftlab("train", "--params", str(params), "--target", str(args.target), "--data",
                               str(args.data), "--store", str(args.store), "--out", str(out)),
                      cwd=tmp, env=env, log=tmp / f"{name}.log")
    from draftlab.rundir import RunDir

    return {"wall_s": wall, "end": end, "out": out, "run_id": RunDir(out).run.read().run_id,
            "total_steps": RunDir(out).train.read().total_steps}


def plan(args, tmp: Path, env: dict, params: Path, gpus: int, i: int) -> dict:
    proc = subprocess.run(draftlab("plan", "--params", str(params), "--data", str(args.data), "--store",
                                   str(args.store), "--target", str(args.target), "--gpus", str(gpus), "--json"),
                          cwd=tmp, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"draftlab plan failed (exit {proc.returncode}):\n{proc.stderr[-2000:]}")
    (tmp / f"plan-{gpus}-{i}.json").write_text(proc.stdout)
    row = next(r for r in json.loads(proc.stdout.strip().splitlines()[-1])["rows"] if r["gpus"] == gpus)
    if row["wall_clock_s"] is None:
        raise SystemExit(f"plan found no measurement: {row['throughput_source']}")
    return row


def eta_figures(env: dict, run: dict) -> dict:
    """The ETA at ~10 % of the steps against two ends: the command's exit (`end`) and the MLflow
    run's end (`run_end`: the training's work done; what follows is the launcher process's own
    exit), and what the time left was made of: the steps (rank 0's records), the tail after the
    last step to the run's end, and the process exit."""
    import mlflow

    from draftlab.observe import telemetry

    client = mlflow.MlflowClient(env["MLFLOW_TRACKING_URI"])

    def history(key):
        return {m.step: m for m in client.get_metric_history(run["run_id"], key)}

    eta, lo, hi = history("perf/eta_s"), history("perf/eta_p10_s"), history("perf/eta_p90_s")
    at = min(eta, key=lambda s: abs(s + 1 - ETA_AT * run["total_steps"]))
    left = run["end"] - eta[at].timestamp / 1000
    run_end = client.get_run(run["run_id"]).info.end_time / 1000
    step_end = {r["step"]: r["t"] for r in telemetry.read_step_records(run["out"]) if r.get("rank") == 0}
    last = step_end[max(step_end)]
    inside = [lo[s].value <= run["end"] - lo[s].timestamp / 1000 <= hi[s].value for s in lo if s in hi]
    return {"eta_step": at, "eta_s": eta[at].value, "actual_left_s": left, "eta_error": eta[at].value / left - 1,
            "eta_error_run_end": eta[at].value / (run_end - eta[at].timestamp / 1000) - 1,
            "left_steps_s": last - step_end.get(at, eta[at].timestamp / 1000), "left_tail_s": run_end - last,
            "left_exit_s": run["end"] - run_end,
            "range_coverage": sum(inside) / len(inside) if inside else float("nan")}


def spread(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "values": xs}


def fmt(s: dict, pct: bool = False) -> str:
    f = (lambda v: f"{v * 100:+.1f} %") if pct else (lambda v: f"{v:.3f}")
    return f"median {f(s['median'])} (spread {f(s['min'])} … {f(s['max'])}, n = {len(s['values'])})"


def main() -> None:
    args = parse_args()
    for p in (args.params, args.target, args.data, args.store):
        if not p.exists():
            raise SystemExit(f"{p}: not found; build the pipeline first (`dvc repro extract`)")
    args.params, args.target, args.data, args.store = (p.resolve() for p in
                                                       (args.params, args.target, args.data, args.store))
    tmp = Path(tempfile.mkdtemp(prefix="plan_eta-", dir=args.workdir))
    env = child_env(tmp)
    t0 = time.time()
    rows = []
    try:
        for i in range(args.repeats):
            for gpus in [int(g) for g in args.gpus.split(",")]:
                profile = write_params(args, tmp, f"profile-{gpus}", gpus=gpus)
                cal_params = write_params(args, tmp, f"calibration-{gpus}", gpus=gpus, epochs=2,
                                          max_steps=args.calibration_steps)
                load = os.getloadavg()[0]

                def cp():
                    c = train(args, tmp, env, f"calibration-{gpus}-{i}", cal_params)
                    return c, plan(args, tmp, env, profile, gpus, i)

                if i % 2 == 0:
                    cal, pred = cp()
                    act = train(args, tmp, env, f"actual-{gpus}-{i}", profile)
                else:
                    act = train(args, tmp, env, f"actual-{gpus}-{i}", profile)
                    cal, pred = cp()
                row = {"gpus": gpus, "repeat": i, "load": load, "predicted_s": pred["wall_clock_s"],
                       "source": pred["throughput_source"], "calibration_s": cal["wall_s"], "actual_s": act["wall_s"],
                       "steps": act["total_steps"], "plan_over_actual": pred["wall_clock_s"] / act["wall_s"],
                       **eta_figures(env, act)}
                rows.append(row)
                print(f"{gpus} rank(s), repeat {i} (load {load:.1f}): calibration {cal['wall_s']:.0f} s; plan "
                      f"{row['predicted_s']:.1f} s vs actual {row['actual_s']:.1f} s for {row['steps']} steps → "
                      f"{row['plan_over_actual']:.3f}; ETA at step {row['eta_step']} {row['eta_s']:.1f} s vs "
                      f"{row['actual_left_s']:.1f} s left → {row['eta_error'] * 100:+.1f} % (to the MLflow run's end "
                      f"{row['eta_error_run_end'] * 100:+.1f} %; left: steps {row['left_steps_s']:.2f} s, tail "
                      f"{row['left_tail_s']:.2f} s, exit {row['left_exit_s']:.2f} s); 10–90 % range held "
                      f"the end at {row['range_coverage'] * 100:.0f} % of steps", flush=True)
    finally:
        if args.keep:
            print(f"kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    out = {}
    for gpus in sorted({r["gpus"] for r in rows}):
        mine = [r for r in rows if r["gpus"] == gpus]
        out[gpus] = {k: spread([r[k] for r in mine]) for k in ("plan_over_actual", "eta_error", "eta_error_run_end",
                                                                 "range_coverage")}
        print(f"RESULT {gpus} rank(s): plan / actual `draftlab train` {fmt(out[gpus]['plan_over_actual'])}; "
              f"ETA-at-10 % error {fmt(out[gpus]['eta_error'], pct=True)}, to the run's end "
              f"{fmt(out[gpus]['eta_error_run_end'], pct=True)}; range coverage "
              f"{fmt(out[gpus]['range_coverage'])}")
    print(f"benchmark wall-clock {time.time() - t0:.0f} s; load average now {os.getloadavg()}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"rows": rows, "summary": out}, indent=2, default=str))


if __name__ == "__main__":
    main()
