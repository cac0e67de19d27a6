"""What does the `draftlab train` harness cost, and how good is its ETA? The full stage against
speculators' bare trainer on the same data and the same speculators argv, side by side.

  bare   speculators' trainer in one process, patched for the device by `draftlab.training.compat` and
         nothing else: what `python -m draftlab.training.rank <argv>` runs without DRAFTLAB_RUN_DIR
         and MLFLOW_RUN_ID (no sampler records, no MLflow, no telemetry, no torchrun), with one
         line-per-step profile recorder attached so that it can be measured at all;
  full   `draftlab train --params <tmp>/params.yaml --target … --data … --store … --out <tmp>`:
         accounting, MLflow run (temp sqlite store), telemetry sampler and system metrics in the
         launcher, torchrun, the rank's observers (sample records, StepProfileRecorder, MLflow
         metrics per step), the end-of-run checks;
  torchrun the bare trainer again, under `torchrun --standalone --nproc-per-node 1` (so a gloo
         process group and speculators' DDP wrapper): how much of full − bare is torchrun's, not
         draftlab's (`--no-torchrun-arm` skips it).
  roomy  (`--roomy-arm`) the torchrun arm with its trainer called through `draftlab.pystack.call`,
         as draftlab's rank calls it: the frame stack's chunk boundaries (CPython 3.11 maps and
         unmaps a chunk at every crossing) then fall alike in both, and full/roomy is draftlab's
         harness alone. Every arm's minor page faults per step (the profile's `minflt`) are printed.

Both build their argv with `draftlab.training.job.speculators_argv` from one params file (the
script checks they differ only in paths). Both are measured by the same instrument: the
`profile` dict speculators logs for every step (tokens = its real-token count, step_ms from
the start of the fetch to the end of the optimizer step; the previous step's metric logging
falls in the next step's fetch, so the harness's per-step work is inside step_ms):

  steps  tokens/s = Σ tokens / Σ step_ms over global steps 1..N-1 (step 0, start-up, excluded)
  span   tokens/s = Σ tokens of steps 1..N-1 / wall-clock from the end of step 0 to the end of
         step N-1 (validation, checkpoints and epoch turnovers included)

Runs alternate bare, torchrun, full / full, torchrun, bare, pair after pair; each ratio is
full/bare within one pair, reported as median and min–max. Goal: ratio ≥ 0.98. Start-up (process start to step 0) is
printed apart: it is a fixed cost per run, not a rate.

`--side-by-side` runs each pair's two arms at the same time instead, each pinned to its own CPU
(sched_setaffinity, inherited by torchrun and the ranks; the CPUs swap from pair to pair):
`full` (launcher, torchrun, rank and every draftlab thread on one CPU) against the bare
trainer under the same torchrun command on the other. On a shared VM the speed of the machine
moves by ±10 % from one minute to the next; run apart, that drift is in every ratio, run
together it moves both arms alike and cancels. The bare arm starts later by the start-up
difference the previous pair measured, and the rates count only the steps that ended while
both arms were stepping (with `--epochs 12`, 258 steps, about 220 of them). Needs 2 CPUs.

ETA: from the full run's MLflow history, `perf/eta_s` at the step nearest 10 % of the total,
against the command's exit (the ETA includes validation, checkpoints and the tail after the last step):
error = (ETA − actual remaining) / actual remaining. Goal: |error| ≤ 5 %. Printed beside it, to
tell the causes apart: the remaining time the steps themselves took (Σ step_ms) and the rest
(validation, checkpoints), and the ETA a plain mean of the steps so far would have given.

Start-up: process start to the end of step 0, full ÷ bare per pair, and both broken down by phase
(draftlab.training.startup: the full run's from its train.json `startup`, the bare one's from the
same rank marks, which its rank writes beside its profile). `--startup-only` measures only that
(the two arms started together; no rates, no ETA), a cheap run of many pairs with `--epochs 1`.
The benchmark gives draftlab its own plan cache in the temp dir: its first full run starts cold.

Harness CPU: the full run's own CPU seconds per step (draftlab.plan.run_timing.harness_cpu: the
launcher process while the ranks run, rank 0's step recorder, metric handler and tracking
thread), which unlike the ratios holds under load.

Nothing passes or fails on timing. Outputs go to a temp dir (MLflow: sqlite:///<tmp>/mlflow.db),
never to runs/ or mlflow.db.

    python benchmarks/train_overhead.py                 # 256-token rows, 3 epochs = 63 steps, 2 pairs: ~4-7 min here
    python benchmarks/train_overhead.py --pairs 3 --json reports/train_overhead.json
    python benchmarks/train_overhead.py --epochs 12 --pairs 48 --roomy-arm
    python benchmarks/train_overhead.py --threads 2 --total-seq-len 512 --epochs 6
    python benchmarks/train_overhead.py --side-by-side --epochs 12 --pairs 7
    python benchmarks/train_overhead.py --side-by-side --startup-only --epochs 1 --pairs 8   # ~4 min here
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PROFILE_KEYS = ("fetch_ms", "fwd_ms", "bwd_ms", "opt_ms", "step_ms", "fetch_frac", "tokens_per_s")
ETA_AT_FRACTION = 0.10
PHASES = ("fetch_ms", "fwd_ms", "bwd_ms", "opt_ms", "step_ms")  # fetch_ms also holds the previous step's logging


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", type=Path, default=REPO / "params.yaml", help="base params (the tiny default)")
    ap.add_argument("--target", type=Path, default=REPO / "models/target")
    ap.add_argument("--data", type=Path, default=REPO / "data/prepared")
    ap.add_argument("--store", type=Path, default=REPO / "data/hidden_states")
    ap.add_argument("--total-seq-len", type=int, default=256, help="train.total_seq_len (256: ~21 steps/epoch)")
    ap.add_argument("--epochs", type=int, default=3, help="train.epochs")
    ap.add_argument("--pairs", type=int, default=2, help="bare/full pairs (order alternates)")
    ap.add_argument("--torchrun-arm", action=argparse.BooleanOptionalAction, default=True,
                    help="also run the bare trainer under torchrun (1 rank), to tell torchrun's own cost "
                    "(process group, DDP wrapper) from draftlab's")
    ap.add_argument("--roomy-arm", action="store_true",
                    help="also run the torchrun arm with its trainer called through draftlab.pystack.call, as "
                    "draftlab's rank calls it (full/roomy: the harness alone, the frame stack's chunks alike)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads per process (OMP_NUM_THREADS; 0 = torch's default). 1 by default: on a "
                    "shared 2-core machine a descheduled OpenMP thread stalls every parallel region")
    ap.add_argument("--side-by-side", action="store_true",
                    help="run each pair's full and bare-under-torchrun arms at once, one CPU each (common-mode "
                    "machine drift cancels in the ratio)")
    ap.add_argument("--startup-only", action="store_true",
                    help="measure only the time to the first step: `full` and the bare trainer under the same torchrun "
                    "command started together (with --side-by-side, one CPU each, swapped pair after pair; else one "
                    "after the other, order alternating), by phase; no rates, no ETA (use --epochs 1)")
    ap.add_argument("--workdir", type=Path, default=None, help="where the temp dir goes (default: system temp)")
    ap.add_argument("--keep", action="store_true", help="keep the temp dir (run folders, logs, MLflow store)")
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    return ap.parse_args(argv)


# ---------------------------------------------------------------- the bare rank (a subprocess)


class ProfileLines(logging.Handler):
    """The bare run's instrument: the same fields as draftlab.observe.telemetry.StepProfileRecorder.
    The file opens on the first record: speculators' logging dictConfig closes every handler
    that exists before it runs."""

    def __init__(self, path: Path):
        super().__init__()
        self.path, self.file = Path(path), None

    def emit(self, record):
        profile = record.msg.get("profile") if isinstance(record.msg, dict) else None
        if not profile:
            return
        if self.file is None or self.file.closed:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.file = open(self.path, "a", buffering=1)  # noqa: SIM115
        rec = {"t": time.time(), "rank": 0, "step": getattr(record, "step", None)}
        rec.update({k: profile[k] for k in PROFILE_KEYS if k in profile})
        rec["minflt"] = resource.getrusage(resource.RUSAGE_SELF).ru_minflt  # as StepProfileRecorder's
        self.file.write(json.dumps(rec) + "\n")


def bare_rank(profile_path: str, argv: list[str], roomy: bool = False) -> None:
    """train_rank.main without DRAFTLAB_RUN_DIR: compat.run_trainer, no draftlab observers (`roomy`:
    called through draftlab.pystack.call, as the rank calls it). Notes the same start-up marks as
    draftlab's rank (training.startup), in startup.json beside the profile."""
    main_at = time.time()
    import speculators  # noqa: F401 — as draftlab's rank does: its cost shows apart

    speculators_at = time.time()
    from draftlab.training import startup
    from draftlab.training.compat import run_trainer

    marks = startup.rank_marks(main_at, speculators_at, time.time())
    Path(profile_path).with_name("startup.json").write_text(json.dumps(marks))
    if roomy:
        from draftlab import pystack

        pystack.call(run_trainer, argv, metric_handlers=[ProfileLines(Path(profile_path))])
    else:
        run_trainer(argv, metric_handlers=[ProfileLines(Path(profile_path))])


# ---------------------------------------------------------------- set-up


def write_params(args, dest: Path):
    import yaml

    from draftlab.params import load_params

    raw = yaml.safe_load(args.params.read_text()) or {}
    raw.setdefault("train", {}).update(total_seq_len=args.total_seq_len, epochs=args.epochs)
    dest.write_text(yaml.safe_dump(raw, sort_keys=False))
    return load_params(dest, root=args.params.resolve().parent)


def bare_argv(params, args, work: Path) -> tuple[list[str], int]:
    """The argv `draftlab train` would hand the ranks, for a run folder to be filled in later."""
    from draftlab.models import resolve
    from draftlab.store import layout as store
    from draftlab.training import job as train

    a, _ = train.plan(params, args.data)
    maps = work / "vocab"
    maps.mkdir()
    d2t, t2d = train.vocab_mappings(params, args.target, args.data, maps)
    from draftlab.store.hidden_states import StoreSource

    manifest = store.read_manifest(args.store)
    layer_ids = train.check_layer_ids(params, manifest)
    argv = train.speculators_argv(params, verifier=resolve(params, args.target), data_dir=args.data,
                                  source=StoreSource(args.store, dtype=manifest.dtype), out_dir=Path("@OUT@"), layer_ids=layer_ids,
                                  total_steps=a.total_steps, d2t=d2t, t2d=t2d, device=train.resolve_device(params))
    return argv, a.total_steps


def _without_paths(argv: list[str]) -> list[str]:
    return [x if not (x.startswith("/") or x.startswith("@OUT@")) else "<path>" for x in argv]


def child_env(args, tmp: Path) -> dict:
    # its own plan cache (draftlab.plan.cache): the first full run computes it, the later ones read it
    env = dict(os.environ, MLFLOW_TRACKING_URI=f"sqlite:///{tmp / 'mlflow.db'}", DRAFTLAB_CACHE_DIR=str(tmp / "cache"),
               HF_HUB_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1", COLUMNS="200")
    for var in ("MLFLOW_RUN_ID", "DRAFTLAB_RUN_DIR", "MLFLOW_EXPERIMENT_NAME", "MLFLOW_EXPERIMENT_ID"):
        env.pop(var, None)
    if args.threads > 0:
        env.update(OMP_NUM_THREADS=str(args.threads), MKL_NUM_THREADS=str(args.threads))
    return env


# ---------------------------------------------------------------- one run of each


class Started:
    """One arm's command, started now (optionally pinned to one CPU, after a delay); `finish()`
    waits for it and returns its record."""

    def __init__(self, cmd: list[str], *, env: dict, log: Path, cwd: Path, cpu: int | None = None,
                 delay_s: float = 0.0):
        if delay_s > 0:
            time.sleep(delay_s)
        pin = (lambda: os.sched_setaffinity(0, {cpu})) if cpu is not None else None
        self.log, self.file = log, open(log, "w")  # noqa: SIM115
        self.started = time.time()
        self.proc = subprocess.Popen(cmd, env=env, stdout=self.file, stderr=subprocess.STDOUT, cwd=cwd,
                                     preexec_fn=pin)

    def finish(self, what: str) -> dict:
        rc = self.proc.wait()
        ended = time.time()
        self.file.close()
        if rc != 0:
            tail = "".join(self.log.read_text().splitlines(keepends=True)[-6:])
            raise SystemExit(f"{what} failed (exit {rc}); see {self.log}:\n{tail}")
        return {"started": self.started, "ended": ended}


def start_bare(argv_template: list[str], out: Path, env: dict, log: Path, *, torchrun: bool = False,
               cpu: int | None = None, delay_s: float = 0.0, roomy: bool = False) -> tuple[Started, list[str]]:
    argv = [x.replace("@OUT@", str(out)) for x in argv_template]
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1"] if torchrun \
        else [sys.executable]
    cmd = [*launcher, str(Path(__file__).resolve()), "--_bare-rank", str(out / "profile.jsonl"),
           *(["--roomy"] if roomy else []), "--", *argv]
    return Started(cmd, env=env, log=log, cwd=out.parent, cpu=cpu, delay_s=delay_s), argv


def finish_bare(started: Started, argv: list[str], out: Path, *, torchrun: bool = False) -> dict:
    from draftlab.training import startup

    run = {**started.finish("bare trainer"), "records": read_profile(out / "profile.jsonl"), "argv": argv}
    marks_file = out / "startup.json"
    if marks_file.exists() and run["records"]:
        step0 = run["records"][0]
        spans = startup.rank_spans(json.loads(marks_file.read_text()), step0["t"], step0["step_ms"] / 1000,
                                   run["started"] if torchrun else None)
        run["startup"] = {**spans, "total_s": round(step0["t"] - run["started"], 3)}
    return run


def run_bare(argv_template: list[str], out: Path, env: dict, log: Path, *, torchrun: bool = False,
             roomy: bool = False) -> dict:
    return finish_bare(*start_bare(argv_template, out, env, log, torchrun=torchrun, roomy=roomy), out, torchrun=torchrun)


def start_full(params_path: Path, args, out: Path, env: dict, log: Path, *, cpu: int | None = None) -> Started:
    exe = Path(sys.executable).with_name("draftlab")
    draftlab = [str(exe)] if exe.exists() else [sys.executable, "-c", "from draftlab.cli import main; main()"]
    cmd = [*draftlab, "train", "--params", str(params_path), "--target", str(args.target), "--data", str(args.data),
           "--store", str(args.store), "--out", str(out)]
    return Started(cmd, env=env, log=log, cwd=out.parent, cpu=cpu)


def finish_full(started: Started, out: Path) -> dict:
    times = started.finish("draftlab train")
    from draftlab.rundir import RunDir

    rank_argv = RunDir(out).command.read().cmd
    rank_argv = rank_argv[rank_argv.index("draftlab.training.rank") + 1:]
    record = RunDir(out).train.read()
    return {**times, "records": read_profile(out / "profile" / "rank0.jsonl"),
            "argv": rank_argv, "run_id": record.run_id, "harness_cpu": record.harness_cpu,
            "startup": getattr(record, "startup", None)}


def run_full(params_path: Path, args, out: Path, env: dict, log: Path) -> dict:
    return finish_full(start_full(params_path, args, out, env, log), out)


def read_profile(path: Path) -> list[dict]:
    if not path.exists():
        return []
    recs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return sorted(recs, key=lambda r: r["step"])


class TooFewSteps(SystemExit):
    """Side by side, the arms' stepping barely overlapped (a start-up far off the previous pair's)."""


def rates(run: dict, total_steps: int, window: tuple[float, float] | None = None) -> dict:
    """tokens/s of steps 1..N-1, or (`window`) of those that ended inside it (side by side: while
    both arms were stepping)."""
    recs = run["records"]
    if len(recs) != total_steps:
        raise SystemExit(f"expected {total_steps} profiled steps, found {len(recs)}: profile every step "
                         "(speculators' --log-freq 1) and check the run's log")
    tokens = [round(r["tokens_per_s"] * r["step_ms"] / 1000) for r in recs]
    inside = [i for i in range(1, len(recs)) if window is None or window[0] <= recs[i]["t"] <= window[1]]
    if len(inside) < 10:
        raise TooFewSteps(f"only {len(inside)} steps ran while both arms stepped: raise --epochs")
    body, body_tokens = [recs[i] for i in inside], sum(tokens[i] for i in inside)
    step_s = sum(r["step_ms"] for r in body) / 1000
    span_s = body[-1]["t"] - recs[inside[0] - 1]["t"]
    faults = [recs[i]["minflt"] - recs[i - 1]["minflt"] for i in inside if "minflt" in recs[i] and "minflt" in recs[i - 1]]
    return {"steps_tokens_per_s": body_tokens / step_s, "span_tokens_per_s": body_tokens / span_s,
            "minflt_per_step": statistics.median(faults) if faults else None,
            "steps_counted": len(body),
            "step_tokens": tokens, "startup_s": recs[0]["t"] - run["started"],
            "after_last_step_s": run["ended"] - recs[-1]["t"], "wall_clock_s": run["ended"] - run["started"],
            **{f"{k}_median": statistics.median(r[k] for r in body) for k in PHASES}}


def eta_check(run: dict, total_steps: int, tracking_uri: str) -> dict:
    import mlflow

    client = mlflow.MlflowClient(tracking_uri)
    history = {m.step: m for m in client.get_metric_history(run["run_id"], "perf/eta_s")}
    at = max(1, round(ETA_AT_FRACTION * total_steps))
    last = total_steps - 1
    if at not in history or last not in history:
        raise SystemExit(f"perf/eta_s missing at step {at} or {last} in MLflow run {run['run_id']}")
    eta_s = history[at].value
    actual_s = run["ended"] - history[at].timestamp / 1000  # to the command's exit: the ETA includes the tail
    recs = {r["step"]: r for r in run["records"]}
    steps_only_s = sum(recs[s]["step_ms"] for s in range(at + 1, total_steps)) / 1000
    mean_so_far_ms = statistics.mean(recs[s]["step_ms"] for s in range(1, at + 1))
    plain_eta_s = (total_steps - at - 1) * mean_so_far_ms / 1000
    return {"at_step": at, "eta_s": eta_s, "actual_remaining_s": actual_s, "error": (eta_s - actual_s) / actual_s,
            "remaining_in_steps_s": steps_only_s, "remaining_between_steps_s": actual_s - steps_only_s,
            "plain_mean_eta_s": plain_eta_s, "plain_mean_error": (plain_eta_s - actual_s) / actual_s,
            "step_ms_first_10pct": mean_so_far_ms,
            "step_ms_rest": statistics.mean(recs[s]["step_ms"] for s in range(at + 1, total_steps))}


def spread(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "values": xs}


def _fmt(s: dict, digits: int = 3) -> str:
    return f"median {s['median']:.{digits}f} (spread {s['min']:.{digits}f}–{s['max']:.{digits}f})"


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--_bare-rank":
        rest = sys.argv[3:]
        roomy = rest[:1] == ["--roomy"]
        rest = rest[1:] if roomy else rest
        bare_rank(sys.argv[2], rest[1:] if rest[:1] == ["--"] else rest, roomy=roomy)
        return
    args = parse_args()
    for p in (args.target, args.data, args.store):
        if not p.exists():
            raise SystemExit(f"{p}: not found; build the pipeline first (`dvc repro extract`)")
    tmp = Path(tempfile.mkdtemp(prefix="train_overhead-", dir=args.workdir))
    env = child_env(args, tmp)
    os.environ["MLFLOW_TRACKING_URI"] = env["MLFLOW_TRACKING_URI"]  # this process reads the same store
    try:
        bench(args, tmp, env)
    finally:
        if args.keep:
            print(f"kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)


def one_after_other(args, tmp: Path, env: dict, params_path: Path, argv: list[str], total_steps: int,
                    order: tuple[str, ...], i: int) -> dict:
    runs = {}
    for kind in order:
        out, log = tmp / f"{kind}-{i}", tmp / f"{kind}-{i}.log"
        if kind == "full":
            runs[kind] = run_full(params_path, args, out, env, log)
        else:
            out.mkdir()
            runs[kind] = run_bare(argv, out, env, log, torchrun=kind in ("torchrun", "roomy"), roomy=kind == "roomy")
        runs[kind]["rates"] = rates(runs[kind], total_steps)
    return runs


def side_by_side(args, tmp: Path, env: dict, params_path: Path, argv: list[str], total_steps: int, i: int,
                 lead_s: float) -> tuple[dict, float]:
    """`full` and the bare trainer under torchrun at once, one CPU each (swapped on odd pairs), the
    bare one started `lead_s` later; rates over the steps that ended while both stepped. Returns
    the runs and the next pair's lead (this one's, corrected by how far apart the first steps were)."""
    cpus = sorted(os.sched_getaffinity(0))[:2]
    cpu_full, cpu_bare = cpus if i % 2 == 0 else cpus[::-1]
    out_f, out_b = tmp / f"full-{i}", tmp / f"torchrun-{i}"
    out_b.mkdir()
    full = start_full(params_path, args, out_f, env, tmp / f"full-{i}.log", cpu=cpu_full)
    bare, bare_argv = start_bare(argv, out_b, env, tmp / f"torchrun-{i}.log", torchrun=True, cpu=cpu_bare,
                                 delay_s=lead_s)
    runs = {"full": finish_full(full, out_f), "torchrun": finish_bare(bare, bare_argv, out_b, torchrun=True)}
    window = (max(run["records"][1]["t"] for run in runs.values()), min(run["records"][-1]["t"] for run in runs.values()))
    first = {kind: run["records"][0]["t"] for kind, run in runs.items()}
    next_lead_s = max(0.0, lead_s + first["full"] - first["torchrun"])
    try:
        for run in runs.values():
            run["rates"] = rates(run, total_steps, window)
    except TooFewSteps as err:
        err.lead_s = next_lead_s
        raise
    runs["full"]["cpu"], runs["torchrun"]["cpu"] = cpu_full, cpu_bare
    return runs, next_lead_s


def startup_pair(args, tmp: Path, env: dict, params_path: Path, argv: list[str], i: int) -> dict:
    """`full` and the bare trainer under torchrun, started together (side by side, one CPU each)
    or one after the other; each one's time to the end of step 0, by phase."""
    out_f, out_b = tmp / f"full-{i}", tmp / f"torchrun-{i}"
    out_b.mkdir()
    if args.side_by_side:
        cpus = sorted(os.sched_getaffinity(0))[:2]
        cpu_full, cpu_bare = cpus if i % 2 == 0 else cpus[::-1]
        full = start_full(params_path, args, out_f, env, tmp / f"full-{i}.log", cpu=cpu_full)
        bare, b_argv = start_bare(argv, out_b, env, tmp / f"torchrun-{i}.log", torchrun=True, cpu=cpu_bare)
        runs = {"full": finish_full(full, out_f), "torchrun": finish_bare(bare, b_argv, out_b, torchrun=True)}
        order = f"side by side, full on CPU {cpu_full}, bare under torchrun on CPU {cpu_bare}"
    else:
        runs, kinds = {}, ("full", "torchrun") if i % 2 == 0 else ("torchrun", "full")
        for kind in kinds:
            if kind == "full":
                runs[kind] = run_full(params_path, args, out_f, env, tmp / f"full-{i}.log")
            else:
                runs[kind] = run_bare(argv, out_b, env, tmp / f"torchrun-{i}.log", torchrun=True)
        order = ", then ".join(kinds)
    for run in runs.values():
        run["startup_s"] = run["records"][0]["t"] - run["started"]
    f, b = runs["full"], runs["torchrun"]
    return {"order": order, "full": {"startup_s": f["startup_s"]}, "torchrun": {"startup_s": b["startup_s"]},
            "startup_ratio": f["startup_s"] / b["startup_s"],
            "startup_phases": {kind: run.get("startup") for kind, run in runs.items()}}


def startup_summary(pairs: list[dict]) -> dict:
    """Prints the start-up ratio over the pairs and each phase's median, full beside bare."""
    su = spread([p["startup_ratio"] for p in pairs])
    su_full = spread([p["full"]["startup_s"] for p in pairs])
    su_bare = spread([p.get("bare", p.get("torchrun"))["startup_s"] for p in pairs])
    print(f"RESULT start-up (process start to the end of step 0) full/bare: {_fmt(su, 2)}; full {_fmt(su_full, 1)} s, "
          f"bare {_fmt(su_bare, 1)} s; goal ≤ 1.2")
    bare_kind = "bare" if "bare" in pairs[0]["startup_phases"] else "torchrun"
    names = list(dict.fromkeys(k for p in pairs for kind in ("full", bare_kind)
                               for k in (p["startup_phases"].get(kind) or {}) if k != "total_s"))
    rows = []
    for name in names:
        cols = []
        for kind in ("full", bare_kind):
            xs = [p["startup_phases"][kind][name] for p in pairs
                  if p["startup_phases"].get(kind) and name in p["startup_phases"][kind]]
            cols.append(f"{statistics.median(xs):5.2f} ({min(xs):.2f}–{max(xs):.2f})" if xs else "    —")
        rows.append(f"    {name:<18} {cols[0]:>20} {cols[1]:>20}")
    print(f"start-up by phase, median s (spread) over {len(pairs)} pairs:\n    {'phase':<18} {'full':>20} {bare_kind:>20}\n"
          + "\n".join(rows))
    return su


def startup_bench(args, tmp: Path, env: dict, params_path: Path, argv: list[str], total_steps: int) -> None:
    from draftlab.training import startup

    pairs = []
    for i in range(args.pairs):
        pair = startup_pair(args, tmp, env, params_path, argv, i)
        pairs.append(pair)
        print(f"pair {i} ({pair['order']}): start-up full {pair['full']['startup_s']:.1f} s, bare "
              f"{pair['torchrun']['startup_s']:.1f} s → full/bare {pair['startup_ratio']:.2f}; " + "; ".join(
              f"{kind} {startup.line(ph)}" for kind, ph in pair["startup_phases"].items() if ph), flush=True)
    su = startup_summary(pairs)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"total_steps": total_steps, "side_by_side": args.side_by_side,
                                         "pairs": pairs, "startup_ratio": su}, indent=2) + "\n")
        print(f"results → {args.json}")


def bench(args, tmp: Path, env: dict) -> None:
    from draftlab.training import startup

    t0 = time.time()
    params_path = tmp / "params.yaml"
    params = write_params(args, params_path)
    argv, total_steps = bare_argv(params, args, tmp)
    print(f"setup: {total_steps} global steps ({args.epochs} epochs of {args.total_seq_len}-token rows, "
          f"world size {params.train.world_size()}), torch threads {args.threads or 'default'}, temp dir {tmp}")

    if args.roomy_arm and (args.side_by_side or not args.torchrun_arm):
        raise SystemExit("--roomy-arm runs beside the torchrun arm, one after the other: drop --side-by-side "
                         "and --no-torchrun-arm")
    if args.side_by_side and len(os.sched_getaffinity(0)) < 2:
        raise SystemExit("--side-by-side needs 2 CPUs in this process's affinity")
    if args.side_by_side:
        arms = ("torchrun", "full")
    else:
        arms = ("bare", "torchrun", "full") if args.torchrun_arm else ("bare", "full")
        if args.roomy_arm:
            arms = (*arms[:-1], "roomy", "full")
    if args.startup_only:
        startup_bench(args, tmp, env, params_path, argv, total_steps)
        print(f"benchmark wall-clock {time.time() - t0:.0f} s")
        return
    pairs, etas = [], []
    lead_s = 6.0  # side by side: how much later the bare arm starts (full's longer start-up; measured per pair)
    for i in range(args.pairs):
        if args.side_by_side:
            try:
                runs, lead_s = side_by_side(args, tmp, env, params_path, argv, total_steps, i, lead_s)
            except TooFewSteps as err:  # the next pair starts with the lead this one measured
                lead_s = err.lead_s
                print(f"pair {i}: left out ({err.args[0]}; the next pair's bare arm starts {lead_s:.1f} s later)")
                continue
        else:
            runs = one_after_other(args, tmp, env, params_path, argv, total_steps, arms if i % 2 == 0 else arms[::-1], i)
        r = {kind: run["rates"] for kind, run in runs.items()}
        # the ratio's denominator: the bare trainer (side by side: under the same torchrun command)
        b, f = (r["bare"] if "bare" in r else r["torchrun"]), r["full"]
        same_argv = len({tuple(_without_paths(run["argv"])) for run in runs.values()}) == 1
        same_tokens = len({tuple(x["step_tokens"]) for x in r.values()}) == 1
        eta = eta_check(runs["full"], total_steps, env["MLFLOW_TRACKING_URI"])
        etas.append(eta)
        order = (f"side by side, full on CPU {runs['full']['cpu']}, bare under torchrun on CPU {runs['torchrun']['cpu']}"
                 if args.side_by_side else ",".join(arms if i % 2 == 0 else arms[::-1]))
        pair = {"order": order,
                "steps_ratio": f["steps_tokens_per_s"] / b["steps_tokens_per_s"],
                "span_ratio": f["span_tokens_per_s"] / b["span_tokens_per_s"],
                **{kind: {k: v for k, v in x.items() if k != "step_tokens"} for kind, x in r.items()},
                "same_argv_but_paths": same_argv, "same_step_tokens": same_tokens}
        if "torchrun" in r and "bare" in r:
            pair["torchrun_ratio"] = r["torchrun"]["steps_tokens_per_s"] / b["steps_tokens_per_s"]
            pair["full_over_torchrun"] = f["steps_tokens_per_s"] / r["torchrun"]["steps_tokens_per_s"]
        if "roomy" in r:
            pair["full_over_roomy"] = f["steps_tokens_per_s"] / r["roomy"]["steps_tokens_per_s"]
            pair["roomy_over_torchrun"] = r["roomy"]["steps_tokens_per_s"] / r["torchrun"]["steps_tokens_per_s"]
        pair["harness_cpu_ms_per_step"] = 1000 * runs["full"]["harness_cpu"]["per_step_s"]
        hc = runs["full"]["harness_cpu"]
        pair["harness_cpu_ms_per_step_by_thread"] = {
            "launcher process": 1000 * (hc["launcher_s"] - hc.get("launcher_relay_s", 0.0)) / total_steps,
            "launcher relay thread": 1000 * hc.get("launcher_relay_s", 0.0) / total_steps,
            **{f"rank 0 {k}": 1000 * v / total_steps for k, v in hc["rank0"].items()}}
        pair["startup_ratio"] = f["startup_s"] / b["startup_s"]
        pair["startup_phases"] = {kind: run.get("startup") for kind, run in runs.items()}
        pairs.append(pair)
        print(f"pair {i} ({pair['order']}): tokens/s (steps) " + ", ".join(
            f"{kind} {x['steps_tokens_per_s']:,.0f}" for kind, x in r.items()) + f" → full/bare {pair['steps_ratio']:.3f}"
            + (f", torchrun/bare {pair['torchrun_ratio']:.3f}, full/torchrun {pair['full_over_torchrun']:.3f}"
               if "torchrun_ratio" in pair else "")
            + (f", full/roomy {pair['full_over_roomy']:.3f}" if "full_over_roomy" in pair else "")
            + (f" ({f['steps_counted']} and {b['steps_counted']} steps while both stepped)" if args.side_by_side else "")
            + f"; span full/bare {pair['span_ratio']:.3f}; start-up " + ", ".join(
            f"{kind} {x['startup_s']:.1f} s" for kind, x in r.items()) + "; whole command " + ", ".join(
            f"{kind} {x['wall_clock_s']:.1f} s" for kind, x in r.items()))
        print(f"    median ms per step full − bare: " + ", ".join(
            f"{k[:-3]} {f[k + '_median'] - b[k + '_median']:+.0f}" for k in PHASES)
            + ("; torchrun − bare: " + ", ".join(
               f"{k[:-3]} {r['torchrun'][k + '_median'] - b[k + '_median']:+.0f}" for k in PHASES)
               if "torchrun_ratio" in pair else "")
            + "; minor page faults per step " + ", ".join(
                f"{kind} {x['minflt_per_step']:.0f}" for kind, x in r.items() if x["minflt_per_step"] is not None)
            + f"; ETA at step {eta['at_step']} {eta['eta_s']:.1f} s vs {eta['actual_remaining_s']:.1f} s actual "
            f"({eta['error']:+.1%}); same argv but paths: {same_argv}, same tokens per step: {same_tokens}")
        print(f"    start-up full/bare {pair['startup_ratio']:.2f}; by phase (s): " + "; ".join(
            f"{kind} {startup.line(ph)}" for kind, ph in pair["startup_phases"].items() if ph))

    steps_r = spread([p["steps_ratio"] for p in pairs])
    span_r = spread([p["span_ratio"] for p in pairs])
    err = spread([e["error"] for e in etas])
    plain = spread([e["plain_mean_error"] for e in etas])
    between = spread([e["remaining_between_steps_s"] / e["actual_remaining_s"] for e in etas])
    drift = spread([e["step_ms_rest"] / e["step_ms_first_10pct"] for e in etas])
    deltas = {k: spread([p["full"][k + "_median"] - p.get("bare", p.get("torchrun"))[k + "_median"] for p in pairs])
              for k in PHASES}
    print("where the harness's time goes, median ms per step full − bare: " + "; ".join(
        f"{k[:-3]} {_fmt(d, 0)}" for k, d in deltas.items()) + " (fetch holds the previous step's metric logging)")
    print(f"ETA diagnosis: of the actual remaining time, {_fmt(between, 3)} was outside steps (validation, "
          f"checkpoints, epoch turnovers); step_ms after the ETA point / before it: {_fmt(drift, 2)} (machine load "
          f"moves this); a plain mean of steps 1..{etas[0]['at_step']} would have erred {_fmt(plain, 3)}")
    how = ("pairs run side by side, one CPU each, bare under the same torchrun command, steps while both stepped"
           if args.side_by_side else "interleaved pairs")
    print(f"RESULT tokens/s full/bare (steps' own profile, step 0 excluded): {_fmt(steps_r)} over {len(pairs)} "
          f"{how}; goal ≥ 0.98")
    print(f"RESULT tokens/s full/bare (wall-clock span, validation + checkpoints included): {_fmt(span_r)}")
    su = startup_summary(pairs)
    cpu = spread([p["harness_cpu_ms_per_step"] for p in pairs])
    print(f"RESULT harness CPU per step (launcher process + rank 0's observers, "
          f"train.json harness_cpu): {_fmt(cpu, 1)} ms, against a median step of "
          f"{statistics.median(p['full']['step_ms_median'] for p in pairs):.0f} ms")
    threads = list(dict.fromkeys(k for p in pairs for k in p["harness_cpu_ms_per_step_by_thread"]))
    print("harness CPU per step by thread, median ms (spread): " + "; ".join(
        f"{k} {_fmt(spread([p['harness_cpu_ms_per_step_by_thread'].get(k, 0.0) for p in pairs]), 2)}"
        for k in threads) + " (rank 0's handlers run on the trainer's thread, and write the relay file there once a second; "
        "the launcher's relay thread uploads it to MLflow)")
    if all("torchrun_ratio" in p for p in pairs):
        print(f"RESULT split: torchrun alone (bare trainer under torchrun: gloo process group, DDP) tokens/s "
              f"torchrun/bare {_fmt(spread([p['torchrun_ratio'] for p in pairs]))}; draftlab's own part full/torchrun "
              f"{_fmt(spread([p['full_over_torchrun'] for p in pairs]))}")
    if all("full_over_roomy" in p for p in pairs):
        print(f"RESULT harness alone, the frame stack's chunks alike: tokens/s full/roomy "
              f"{_fmt(spread([p['full_over_roomy'] for p in pairs]))}; the stack's own part roomy/torchrun "
              f"{_fmt(spread([p['roomy_over_torchrun'] for p in pairs]))}")
    kinds = [k for k in ("bare", "torchrun", "roomy", "full") if all(p.get(k, {}).get("minflt_per_step") is not None
                                                                      for p in pairs)]
    if kinds:
        print("minor page faults per step, median (spread): " + "; ".join(
            f"{k} {_fmt(spread([p[k]['minflt_per_step'] for p in pairs]), 0)}" for k in kinds))
    print(f"RESULT ETA error at {ETA_AT_FRACTION:.0%} of {total_steps} steps (perf/eta_s vs end of the last step): "
          f"{_fmt(err)}; goal |error| ≤ 0.05")
    print(f"benchmark wall-clock {time.time() - t0:.0f} s")
    if args.json:
        res = {"total_steps": total_steps, "total_seq_len": args.total_seq_len, "epochs": args.epochs,
               "threads": args.threads, "pairs": pairs, "eta": etas, "steps_ratio": steps_r, "span_ratio": span_r,
               "eta_error": err, "phase_delta_ms": deltas, "startup_ratio": su}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(res, indent=2) + "\n")
        print(f"results → {args.json}")


if __name__ == "__main__":
    main()
