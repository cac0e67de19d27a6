"""How close is `draftlab plan`'s wall-clock to what the train stage really takes? The plan for the
tiny default (params.yaml as it is, 1 rank) against the measured run, repeated.

Each repeat:
  C  calibration: `draftlab train` on the same params but `--calibration-epochs` (default 1) into a
     temp MLflow store; its whole-run tokens/s (`perf/run_tokens_per_s`) is the throughput that
     `plan` finds there ("mlflow run <id>": the latest finished run with matching draft and
     packing params, exactly what a user gets after one run; when that lookup does not pick the
     run, the script says so and passes the same figure as `--tokens-per-s`);
  P  `draftlab plan --json --gpus 1`: predicted wall-clock = epochs × trained tokens ÷ tokens/s;
  A  the actual run, one of
       train      `draftlab train` on the tiny default into a temp run folder (default);
       dvc-train  `dvc repro --single-item --force train` in a temp copy of the repo (`git ls-files`,
                  git init, with models/target, data/prepared and data/hidden_states copied in),
                  i.e. the train stage as `dvc repro` runs it, DVC's hashing and caching included;
       dvc-all    a full `dvc repro` from scratch in a fresh temp copy (target, prepare, extract,
                  train, evaluate, export): `plan` predicts training only, so the train stage's
                  share (train.json) is printed beside the total.
C+P and A alternate order from repeat to repeat (P always right after its C). Printed per repeat
and as median and min–max: predicted ÷ actual (1.0 = exact; < 1 = plan too optimistic) against
the whole command, against the launcher's training subprocess (torchrun start to exit,
train.json) and against the steps alone (Σ step_ms of the rank's profile), plus the same
formula with the calibration's steady per-step rate (median `perf/tokens_per_s`) in place of
its whole-run rate. Those tell the model's two parts apart: the rate, and the fixed costs
(imports, MLflow, torchrun, validation, checkpoints) that a tokens/s figure spreads over steps.

Nothing passes or fails on timing. Everything is written to a temp dir (MLflow:
sqlite:///<tmp>/mlflow.db), never to runs/ or mlflow.db.

    python benchmarks/plan_eta.py                        # 2 repeats, actual = draftlab train: ~5-6 min here
    python benchmarks/plan_eta.py --actual dvc-train --repeats 3
    python benchmarks/plan_eta.py --actual dvc-all --json reports/plan_eta.json   # ~10+ min
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
COPIED_OUTPUTS = ("models/target", "data/prepared", "data/hidden_states")  # dvc-train: upstream stages' outputs


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", type=Path, default=REPO / "params.yaml", help="the profile to plan and run")
    ap.add_argument("--target", type=Path, default=REPO / "models/target")
    ap.add_argument("--data", type=Path, default=REPO / "data/prepared")
    ap.add_argument("--store", type=Path, default=REPO / "data/hidden_states")
    ap.add_argument("--actual", choices=("train", "dvc-train", "dvc-all"), default="train",
                    help="what is timed against the plan (see the docstring)")
    ap.add_argument("--calibration-epochs", type=int, default=1, help="epochs of each calibration run")
    ap.add_argument("--repeats", type=int, default=2, help="C+P / A repeats (order alternates)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads per process (OMP_NUM_THREADS; 0 = torch's default). 1 by default: on a "
                    "shared 2-core machine a descheduled OpenMP thread stalls every parallel region")
    ap.add_argument("--workdir", type=Path, default=None, help="where the temp dir goes (default: system temp)")
    ap.add_argument("--keep", action="store_true", help="keep the temp dir")
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    return ap.parse_args(argv)


def child_env(args, tmp: Path) -> dict:
    bindir = str(Path(sys.executable).parent)
    env = dict(os.environ, MLFLOW_TRACKING_URI=f"sqlite:///{tmp / 'mlflow.db'}", HF_HUB_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1", COLUMNS="200",
               PATH=f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}")
    for var in ("MLFLOW_RUN_ID", "DRAFTLAB_RUN_DIR", "MLFLOW_EXPERIMENT_NAME", "MLFLOW_EXPERIMENT_ID"):
        env.pop(var, None)
    if args.threads > 0:
        env.update(OMP_NUM_THREADS=str(args.threads), MKL_NUM_THREADS=str(args.threads))
    return env


def draftlab_cmd() -> list[str]:
    exe = Path(sys.executable).with_name("draftlab")
    return [str(exe)] if exe.exists() else [sys.executable, "-c", "from draftlab.cli import main; main()"]


def timed(cmd: list[str], *, cwd: Path, env: dict, log: Path) -> float:
    started = time.perf_counter()
    with open(log, "w") as f:
        rc = subprocess.run(cmd, cwd=cwd, env=env, stdout=f, stderr=subprocess.STDOUT).returncode
    wall = time.perf_counter() - started
    if rc != 0:
        tail = "".join(log.read_text().splitlines(keepends=True)[-8:])
        raise SystemExit(f"{' '.join(cmd[:3])} … failed (exit {rc}); see {log}:\n{tail}")
    return wall


def steps_s(run_dir: Path) -> float:
    """Σ step_ms of the rank-0 profile: the time the optimizer steps themselves took."""
    path = run_dir / "profile" / "rank0.jsonl"
    recs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
    return sum(r["step_ms"] for r in recs) / 1000


# ---------------------------------------------------------------- C, P, A


def calibrate(args, tmp: Path, env: dict, i: int) -> dict:
    import yaml

    raw = yaml.safe_load(args.params.read_text()) or {}
    raw.setdefault("train", {})["epochs"] = args.calibration_epochs
    params = tmp / f"calibration-{i}.yaml"
    params.write_text(yaml.safe_dump(raw, sort_keys=False))
    out = tmp / f"calibration-{i}"
    wall = timed([*draftlab_cmd(), "train", "--params", str(params), "--target", str(args.target), "--data",
                  str(args.data), "--store", str(args.store), "--out", str(out)],
                 cwd=tmp, env=env, log=tmp / f"calibration-{i}.log")
    run_id = json.loads((out / "run.json").read_text())["run_id"]
    import mlflow

    client = mlflow.MlflowClient(env["MLFLOW_TRACKING_URI"])
    per_step = [m.value for m in client.get_metric_history(run_id, "perf/tokens_per_s")]
    run = client.get_run(run_id)
    return {"run_id": run_id, "wall_clock_s": wall, "run_tokens_per_s": run.data.metrics["perf/run_tokens_per_s"],
            "steady_tokens_per_s": statistics.median(per_step[1:] or per_step)}


def lookup_finds(args, env: dict, run_id: str) -> bool:
    """Would `plan`'s MLflow lookup pick the calibration run? (The same function, run here.)"""
    import mlflow

    from draftlab import planning as pl
    from draftlab.params import load_params

    found = pl.throughputs_from_mlflow(load_params(args.params), client=mlflow.MlflowClient(env["MLFLOW_TRACKING_URI"]))
    return any(t.gpus == 1 and run_id in t.source for t in found)


def plan(args, tmp: Path, env: dict, i: int, cal: dict) -> dict:
    log = tmp / f"plan-{i}.json"
    cmd = [*draftlab_cmd(), "plan", "--params", str(args.params), "--data", str(args.data), "--store", str(args.store),
           "--gpus", "1", "--json"]
    stated = not lookup_finds(args, env, cal["run_id"])
    if stated:  # the figure the lookup would have used, passed by hand
        print(f"note: `plan`'s MLflow lookup (planning.throughputs_from_mlflow) does not match calibration run "
              f"{cal['run_id']}; passing its perf/run_tokens_per_s as --tokens-per-s")
        cmd += ["--tokens-per-s", repr(cal["run_tokens_per_s"]), "--at-gpus", "1"]
    started = time.perf_counter()
    proc = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - started
    if proc.returncode != 0:
        raise SystemExit(f"draftlab plan failed (exit {proc.returncode}):\n{proc.stderr[-2000:]}")
    log.write_text(proc.stdout)
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    row = next(r for r in result["rows"] if r["gpus"] == 1)
    if row["wall_clock_s"] is None:
        raise SystemExit(f"plan found no throughput ({row['throughput_source']}); see {log}")
    return {"predicted_s": row["wall_clock_s"], "tokens_per_s": row["tokens_per_s"],
            "source": row["throughput_source"], "total_steps": row["total_steps"][0],
            "trained_tokens_per_epoch": result["steps"]["trained_tokens_per_epoch"],
            "epochs": result["scenario"]["epochs"], "plan_wall_clock_s": wall, "stated": stated}


def repo_copy(dest: Path, env: dict, params: Path, *, with_outputs: bool) -> Path:
    """A git-initialised copy of the tracked files (DVC needs git), with `params` as params.yaml."""
    files = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True)
    for rel in files.stdout.splitlines():
        src = REPO / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)
    if with_outputs:
        for rel in COPIED_OUTPUTS:
            shutil.copytree(REPO / rel, dest / rel)
    shutil.copy2(params, dest / "params.yaml")
    for cmd in (["git", "init", "-q"], ["git", "add", "-A"],
                ["git", "-c", "user.name=bench", "-c", "user.email=bench@localhost", "commit", "-qm", "copy"]):
        subprocess.run(cmd, cwd=dest, env=env, check=True, capture_output=True)
    return dest


def actual(args, tmp: Path, env: dict, i: int) -> dict:
    if args.actual == "train":
        out = tmp / f"actual-{i}"
        wall = timed([*draftlab_cmd(), "train", "--params", str(args.params), "--target", str(args.target),
                      "--data", str(args.data), "--store", str(args.store), "--out", str(out)],
                     cwd=tmp, env=env, log=tmp / f"actual-{i}.log")
    else:
        root = tmp / f"repo-{i}" if args.actual == "dvc-all" else tmp / "repo"
        if args.actual == "dvc-all":
            root.mkdir()
            repo_copy(root, env, args.params, with_outputs=False)
            cmd = ["dvc", "repro"]
        else:
            shutil.rmtree(root / "runs" / "train", ignore_errors=True)  # else the stage resumes a finished run
            cmd = ["dvc", "repro", "--single-item", "--force", "train"]
        wall = timed(cmd, cwd=root, env=env, log=tmp / f"actual-{i}.log")
        out = root / "runs" / "train"
    train_json = json.loads((out / "train.json").read_text())
    return {"wall_clock_s": wall, "train_subprocess_s": train_json["wall_clock_s"], "steps_s": steps_s(out),
            "total_steps": train_json["total_steps"]}


def spread(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "values": xs}


def _fmt(s: dict, digits: int = 2) -> str:
    return f"median {s['median']:.{digits}f} (spread {s['min']:.{digits}f}–{s['max']:.{digits}f})"


def main() -> None:
    args = parse_args()
    for p in (args.params, args.target, args.data, args.store):
        if not p.exists():
            raise SystemExit(f"{p}: not found; build the pipeline first (`dvc repro extract`)")
    args.params, args.target, args.data, args.store = (p.resolve() for p in
                                                       (args.params, args.target, args.data, args.store))
    tmp = Path(tempfile.mkdtemp(prefix="plan_eta-", dir=args.workdir))
    env = child_env(args, tmp)
    try:
        bench(args, tmp, env)
    finally:
        if args.keep:
            print(f"kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)


def bench(args, tmp: Path, env: dict) -> None:
    t0 = time.time()
    if args.actual == "dvc-train":
        (tmp / "repo").mkdir()
        repo_copy(tmp / "repo", env, args.params, with_outputs=True)
    print(f"setup: actual = {args.actual}, calibration {args.calibration_epochs} epoch(s), torch threads "
          f"{args.threads or 'default'}, temp dir {tmp}")
    rows = []
    for i in range(args.repeats):
        if i % 2 == 0:
            cal = calibrate(args, tmp, env, i)
            pred = plan(args, tmp, env, i, cal)
            act = actual(args, tmp, env, i)
        else:
            act = actual(args, tmp, env, i)
            cal = calibrate(args, tmp, env, i)
            pred = plan(args, tmp, env, i, cal)
        if not pred["stated"] and cal["run_id"] not in pred["source"]:
            print(f"note: plan used {pred['source']}, not calibration run {cal['run_id']}")
        steady_s = pred["epochs"] * pred["trained_tokens_per_epoch"] / cal["steady_tokens_per_s"]
        row = {"order": "C,P,A" if i % 2 == 0 else "A,C,P", "calibration": cal, "plan": pred, "actual": act,
               "ratio_command": pred["predicted_s"] / act["wall_clock_s"],
               "ratio_train_subprocess": pred["predicted_s"] / act["train_subprocess_s"],
               "ratio_steps": pred["predicted_s"] / act["steps_s"],
               "steady_predicted_s": steady_s, "steady_ratio_steps": steady_s / act["steps_s"],
               "steady_ratio_command": steady_s / act["wall_clock_s"]}
        rows.append(row)
        print(f"repeat {i} ({row['order']}): plan {pred['predicted_s']:.1f} s for {pred['total_steps']} steps at "
              f"{pred['tokens_per_s']:,.0f} tok/s ({pred['source']}; calibration {cal['wall_clock_s']:.0f} s); "
              f"actual: command {act['wall_clock_s']:.1f} s, training subprocess {act['train_subprocess_s']:.1f} s, "
              f"steps {act['steps_s']:.1f} s → predicted/actual {row['ratio_command']:.2f} / "
              f"{row['ratio_train_subprocess']:.2f} / {row['ratio_steps']:.2f}; at the steady rate "
              f"{cal['steady_tokens_per_s']:,.0f} tok/s: {steady_s:.1f} s → {row['steady_ratio_command']:.2f} / "
              f"{row['steady_ratio_steps']:.2f} (command / steps); `draftlab plan` itself {pred['plan_wall_clock_s']:.1f} s")
    res = {k: spread([r[k] for r in rows]) for k in
           ("ratio_command", "ratio_train_subprocess", "ratio_steps", "steady_ratio_command", "steady_ratio_steps")}
    pred_s = spread([r["plan"]["predicted_s"] for r in rows])
    act_s = spread([r["actual"]["wall_clock_s"] for r in rows])
    what = {"train": "`draftlab train`", "dvc-train": "`dvc repro -s -f train`", "dvc-all": "whole `dvc repro`"}
    print(f"predicted {_fmt(pred_s, 1)} s; actual {what[args.actual]} {_fmt(act_s, 1)} s")
    print(f"RESULT plan / actual {what[args.actual]} wall-clock: {_fmt(res['ratio_command'])} over {args.repeats} "
          f"repeats (1.00 = exact)")
    print(f"RESULT plan / training subprocess (torchrun start to exit): {_fmt(res['ratio_train_subprocess'])}; "
          f"plan / steps alone: {_fmt(res['ratio_steps'])}")
    print(f"RESULT same formula at the calibration's steady per-step rate: / command {_fmt(res['steady_ratio_command'])}"
          f", / steps alone {_fmt(res['steady_ratio_steps'])}")
    print(f"benchmark wall-clock {time.time() - t0:.0f} s")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"actual": args.actual, "repeats": rows, **res}, indent=2) + "\n")
        print(f"results → {args.json}")


if __name__ == "__main__":
    main()
