"""`draftlab` command line: a thin translation from flags and `--params` to stage functions.

Heavy libraries (torch, transformers, speculators, mlflow) are imported inside commands, so
`draftlab --help` and params errors answer at once. Every command is registered by `command`,
the one place a user error (draftlab.errors.UserError) becomes one line and its exit code
(2 for bad input, 1 for work that ran and failed).

    draftlab --help
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path
from typing import Annotated

import typer

from draftlab import paths
from draftlab.errors import UserError

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="Reproducible EAGLE-3 draft training on speculators: target → prepare → extract → train → evaluate → export.",
)

ParamsOpt = Annotated[Path, typer.Option("--params", help="Params file (see `draftlab params`).")]
TargetOpt = Annotated[Path, typer.Option("--target", help="The target stage's folder (tiny model or pointer).")]
DataOpt = Annotated[Path, typer.Option("--data", help="Prepared dataset folder.")]
StoreOpt = Annotated[Path, typer.Option("--store", help="Hidden-state store folder.")]
TrainDirOpt = Annotated[Path, typer.Option("--train", help="The train stage's run folder.")]
SourceOpt = Annotated[str | None, typer.Option(
    "--source", help="train.source for this command (store | vllm): where hidden states come from; "
    "online/dvc.yaml's stages give `vllm`.")]


def command(*args, **kwargs):
    """`app.command`, with user errors as one line and their exit code. A FileNotFoundError
    from a library (a folder given that is not there) is one too, exit 2."""

    def register(fn):
        @functools.wraps(fn)
        def run(*a, **kw):
            from draftlab import tracking

            tracking.fail_fast_defaults()  # an outage costs seconds per call, not minutes: the spool keeps it
            try:
                return fn(*a, **kw)
            except (UserError, FileNotFoundError) as err:
                from draftlab.console import console

                from draftlab import redact

                console.print(f"[red]error[/]: {redact.text(str(err))}", soft_wrap=True)
                raise typer.Exit(getattr(err, "exit_code", 2)) from None

        return app.command(*args, **kwargs)(run)

    return register


def _fail(message: str):
    raise UserError(message)


def _say_spool(tracker, stage: str) -> None:
    if line := tracker.spool_line(stage):
        from draftlab.console import console

        console.print(f"[yellow]tracking[/]: {line}", soft_wrap=True)


def _load(params_path: Path, source: str | None = None):
    from draftlab.params import load_params

    p = load_params(params_path)
    if source is not None:  # where hidden states come from for this run, not what it trains
        from draftlab.params import parse_params

        raw = p.model_dump()
        raw["train"]["source"] = source
        if source != "vllm":
            raw["train"]["vllm_url"] = None
        p = parse_params(raw)
    return p


@command()
def target(
    params: ParamsOpt = paths.PARAMS,
    out: Annotated[Path, typer.Option(help="Target folder: the tiny model, or a pointer to a real one.")] = paths.TARGET,
    report: Annotated[Path, typer.Option(help="JSON report of what was built.")] = paths.TARGET_REPORT,
) -> None:
    """Build the tiny default target (or record which real target is used)."""
    p = _load(params)
    from draftlab.stages import target as stage

    stage.run(p, out_dir=out, report_path=report)


@command()
def prepare(
    params: ParamsOpt = paths.PARAMS,
    target: TargetOpt = paths.TARGET,
    out: Annotated[Path, typer.Option(help="Output dataset folder.")] = paths.PREPARED,
) -> None:
    """Conversations → tokenized, loss-masked dataset in speculators' format."""
    p = _load(params)
    from draftlab.stages import prepare as stage

    stage.run(p, target_dir=target, out_dir=out)


@command()
def extract(
    params: ParamsOpt = paths.PARAMS,
    target: TargetOpt = paths.TARGET,
    data: DataOpt = paths.PREPARED,
    out: Annotated[Path, typer.Option(help="Hidden-state store folder.")] = paths.STORE,
    report: Annotated[Path | None, typer.Option(help="JSON report of the store (files, tokens, bytes, what "
                                                "was extracted now).")] = None,
) -> None:
    """Target hidden states → hs_<i>.safetensors files + manifest (resumable)."""
    p = _load(params)
    from draftlab.store import dvc_track

    if problem := dvc_track.mismatch(paths.DVC_YAML, p.extract.dvc_track):
        _fail(problem)
    from draftlab.stages import extract as stage
    from draftlab.tracking import spool_beside, stage_run

    checked = stage.check(p, target_dir=target, data_dir=data)  # refusals before any run or move
    from draftlab import folder_lock

    # one extract per store, before its MLflow run is opened (the stage holds it too)
    with folder_lock.hold(out, "draftlab extract", reentrant=True), stage_run("extract", spool=spool_beside(out)) as tracker:
        result = stage.run(p, target_dir=target, data_dir=data, out_dir=out, tracker=tracker, checked=checked)
    if report is not None:
        from draftlab.util import write_json_atomic

        write_json_atomic(report, {"store": str(out), "num_files": result.num_files, "num_tokens": result.num_tokens,
                                   "total_bytes": result.total_bytes, "extracted_now_tokens": result.extracted_now})


@command()
def train(
    params: ParamsOpt = paths.PARAMS,
    target: TargetOpt = paths.TARGET,
    data: DataOpt = paths.PREPARED,
    store: StoreOpt = paths.STORE,
    out: Annotated[Path, typer.Option(help="Run folder (checkpoints, accounting, run id).")] = paths.TRAIN,
    node_rank: Annotated[int | None, typer.Option("--node-rank", help="This host's train.node_rank (multi-node: "
                                                  "the same params on every node, this flag on the others).")] = None,
    rdzv_endpoint: Annotated[str | None, typer.Option("--rdzv-endpoint", help="train.rdzv_endpoint, host:port "
                                                      "on node 0 (multi-node).")] = None,
    source: SourceOpt = None,
) -> None:
    """Train the draft with speculators' trainer under torchrun; accounting checked, MLflow-tracked."""
    p = _load(params, source)
    if node_rank is not None or rdzv_endpoint is not None:  # where this host runs, not what it trains
        from draftlab.params import parse_params

        raw = p.model_dump()
        raw["train"].update({k: v for k, v in (("node_rank", node_rank), ("rdzv_endpoint", rdzv_endpoint))
                             if v is not None})
        p = parse_params(raw)
    from draftlab.stages import train as stage
    from draftlab.training.startup import process_start

    started = process_start()  # the cost model's start-up begins with this process
    stage.run(p, target_dir=target, data_dir=data, store_dir=store, out_dir=out, started_at=started)


@command()
def evaluate(
    params: ParamsOpt = paths.PARAMS,
    target: TargetOpt = paths.TARGET,
    data: DataOpt = paths.PREPARED,
    store: StoreOpt = paths.STORE,
    train_dir: TrainDirOpt = paths.TRAIN,
    out: Annotated[Path, typer.Option(help="Reports folder (metrics.json, plots, figures).")] = paths.REPORTS,
    source: SourceOpt = None,
) -> None:
    """Predicted (validation) and measured (speculative decoding) acceptance length."""
    p = _load(params, source)
    from draftlab.stages import evaluate as stage
    from draftlab.tracking import MlflowTracker, run_id_of, spool_beside

    tracker = MlflowTracker(run_id_of(train_dir), spool=spool_beside(out))
    stage.run(p, target_dir=target, data_dir=data, store_dir=store, train_dir=train_dir, out_dir=out, tracker=tracker)
    _say_spool(tracker, "evaluate")


@command()
def export(
    params: ParamsOpt = paths.PARAMS,
    target: TargetOpt = paths.TARGET,
    train_dir: TrainDirOpt = paths.TRAIN,
    store: Annotated[Path, typer.Option(help="Hidden-state store folder (its manifest).")] = paths.STORE,
    out: Annotated[Path, typer.Option(help="Exported draft folder.")] = paths.DRAFT,
    reports: Annotated[Path, typer.Option(help="The evaluate stage's reports folder: its figures (acceptance) go "
                                          "on the registered version when they are this training's.")] = paths.REPORTS,
    source: SourceOpt = None,
) -> None:
    """Write the trained draft as a folder vLLM serves (speculators format, bf16, 3 aux layers) and register it in MLflow."""
    p = _load(params, source)
    from draftlab.stages import export as stage
    from draftlab.tracking import MlflowTracker, run_id_of, spool_beside

    tracker = MlflowTracker(run_id_of(train_dir), spool=spool_beside(out))
    stage.run(p, target_dir=target, train_dir=train_dir, store_dir=store, out_dir=out, tracker=tracker,
              reports_dir=reports)
    _say_spool(tracker, "export")


@command()
def plan(
    params: ParamsOpt = paths.PARAMS,
    target: TargetOpt = paths.TARGET,
    data: Annotated[Path, typer.Option(help="Prepared dataset (exact per-sample lengths).")] = paths.PREPARED,
    store: Annotated[Path, typer.Option(help="Hidden-state store folder (disk checks).")] = paths.STORE,
    gpus: Annotated[str, typer.Option(help="GPU counts to plan for, comma-separated.")] = "1,2,4,8",
    samples: Annotated[int | None, typer.Option(help="Stated sample count (with --tokens; instead of the dataset).")] = None,
    tokens: Annotated[int | None, typer.Option(help="Stated token count (with --samples).")] = None,
    hidden_size: Annotated[int | None, typer.Option(help="Target hidden size (default: the target's config.json).")] = None,
    tokens_per_s: Annotated[float | None, typer.Option(help="Stated training tokens/s at --at-gpus GPUs.")] = None,
    at_gpus: Annotated[int, typer.Option(help="GPU count of --tokens-per-s.")] = 1,
    extract_tokens_per_s: Annotated[float | None, typer.Option(help="Stated extraction tokens/s.")] = None,
    shm_mb: Annotated[float | None, typer.Option(help="Shared memory available (default: /dev/shm here).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the plan as JSON.")] = False,
) -> None:
    """Predict store size, extraction hours, steps, wall-clock and GPU-hours before anything runs (writes nothing)."""
    import json

    from draftlab.console import console
    from draftlab.params import load_params
    from draftlab.plan import planning

    p = load_params(params, check_paths=False)  # a profile whose data is not there yet can be planned from counts
    try:
        counts = [int(x) for x in gpus.split(",") if x.strip()]
        if not counts or min(counts) < 1:
            raise ValueError
    except ValueError:
        _fail(f"--gpus: expected comma-separated positive integers, got {gpus!r}")
    result, note = planning.plan_for(
        p, target_dir=target, data_dir=data, store_dir=store, gpu_counts=counts, samples=samples, tokens=tokens,
        hidden_size=hidden_size, tokens_per_s=tokens_per_s, at_gpus=at_gpus, extract_tokens_per_s=extract_tokens_per_s,
        shm_bytes=int(shm_mb * 1e6) if shm_mb else None)
    if as_json:
        typer.echo(json.dumps(result.to_json(), default=str))
    else:
        console.print(planning.plan_table(result))
        console.print(f"[dim]measurements: {note}[/]")


@command()
def sweep(
    space: Annotated[Path, typer.Argument(help="Search space file, e.g. experiments/sweep-tiny.yaml.")],
    budget: Annotated[str | None, typer.Option(help="Total wall-clock, calibration included: 24h, 90m, 1h30m.")] = None,
    trial_cap: Annotated[str | None, typer.Option("--trial-cap", help="Longest one trial may run.")] = None,
    storage: Annotated[str | None, typer.Option(help="Optuna storage: journal file path or postgresql://….")] = None,
    study: Annotated[str | None, typer.Option(help="Study name (default: the space file's).")] = None,
    devices: Annotated[str | None, typer.Option(help="Device slots of this worker: a count or ids (0,1,2,3).")] = None,
    n_trials: Annotated[int | None, typer.Option("--n-trials", help="Stop after this many trials have run.")] = None,
    params: Annotated[Path | None, typer.Option("--params", help="Base params (default: the space file's).")] = None,
    target: TargetOpt = paths.TARGET,
    data: DataOpt = paths.PREPARED,
    store: StoreOpt = paths.STORE,
    out: Annotated[Path, typer.Option(help="Sweeps folder (one subfolder per study).")] = paths.SWEEPS,
) -> None:
    """Optuna over epochs, lr and GPU count inside a wall-clock budget (resumable; workers share it)."""
    from draftlab.sweep import study as sweep_study
    from draftlab.sweep.space import read_spec

    spec = read_spec(space, budget=budget, trial_cap=trial_cap, storage=storage, study=study,
                     params=str(params) if params else None)
    base = _load(Path(spec.params))
    summary = sweep_study.run(spec, base, target_dir=target, data_dir=data, store_dir=store, out_dir=out,
                              devices_flag=devices, n_trials=n_trials)
    if "best" not in summary:  # the study has no completed trial: the line above said why
        raise typer.Exit(1)


def _check_params(params_path: Path, target: Path, data: Path) -> None:
    """Every refusal a later stage would make from params alone, or from params and the target's
    config (extract's layer ids): dvc.yaml's verify runs before extract, and DVC deletes
    extract's output before extract's command can refuse."""
    p = _load(params_path)  # every section, typed: the key's dotted path on error
    from draftlab.store import dvc_track

    if problem := dvc_track.mismatch(paths.DVC_YAML, p.extract.dvc_track):
        _fail(problem)
    if not (data / "dataset_info.json").exists():
        return  # no dataset yet: nothing later has been produced either
    from draftlab.training.job import check_seq_len

    check_seq_len(p, data)  # train's packing length against the samples
    local = (target / "config.json").exists() if p.target.source == "tiny" else p.target.source == "local"
    if local:  # a hub target's config is extract's to fetch
        from draftlab.stages import extract as stage

        stage.check(p, target_dir=target, data_dir=data)


@command()
def verify(
    store: Annotated[Path, typer.Argument(help="Hidden-state store folder.")] = paths.STORE,
    quick: Annotated[bool, typer.Option(help="Check sizes and headers only, skip re-hashing.")] = False,
    report: Annotated[Path | None, typer.Option(help="Write the problems to this JSON file and exit 0 "
                                                     "(dvc.yaml's check before extract); re-hashes only files "
                                                     "changed since extraction wrote them.")] = None,
    params: Annotated[Path | None, typer.Option("--params", help="Also check every stage's params (and extract's "
                                                "against the target), before `dvc repro` runs any later stage: a "
                                                "params error then costs no produced file.")] = None,
    target: TargetOpt = paths.TARGET,
    data: Annotated[Path, typer.Option(help="Prepared dataset folder (with --params).")] = paths.PREPARED,
) -> None:
    """Name every missing, truncated or corrupt file of a hidden-state store."""
    from draftlab.console import console
    from draftlab.store import layout as st

    if params is not None:
        _check_params(params, target, data)
    if report is not None:
        from draftlab.util import write_json_atomic

        # No manifest yet (first run, or a killed extraction): nothing to disagree with; extract
        # runs anyway because its manifest is missing.
        found = st.verify(store, changed_only=True, record=True) if st.has_manifest(store) else []
        write_json_atomic(report, {"store": str(store), "problems": found})
        for line in found:
            console.print(f"[yellow]verify[/]: {line}", soft_wrap=True)
        console.print(f"[bold]verify[/]: {len(found)} bad file(s) in {store} → {report}")
        return
    problems = st.verify(store, full=not quick, record=True)  # extract re-extracts what it names
    for line in problems:
        console.print(line, soft_wrap=True)
    if problems:
        _fail(f"{store}: {len(problems)} bad file(s); {st.REPAIR}")
    console.print(f"[green]ok[/]: {store} matches its manifest")


@command()
def use(
    experiment: Annotated[Path, typer.Argument(help="A profile from experiments/ (a partial params tree).")],
    params: ParamsOpt = paths.PARAMS,
) -> None:
    """Merge an experiment profile into params.yaml, so DVC sees (and records) what runs."""
    import yaml

    from draftlab.console import console
    from draftlab.params import merge, parse_params
    from draftlab.util import write_bytes_atomic

    if not experiment.is_file():
        _fail(f"{experiment}: no such experiment file (see experiments/)")
    try:
        base = yaml.safe_load(params.read_text()) or {}
        overlay = yaml.safe_load(experiment.read_text()) or {}
    except (yaml.YAMLError, OSError) as err:
        _fail(str(err))
    merged = merge(base, overlay)
    parse_params(merged, str(experiment))
    header = f"# params.yaml: {experiment} merged in by `draftlab use`; run `dvc repro` (or `dvc exp run`).\n"
    write_bytes_atomic(params, (header + yaml.safe_dump(merged, sort_keys=False)).encode())
    console.print(f"[bold]use[/]: {experiment} → {params}; `git diff {params}` shows what changed")


@command("dvc-track")
def dvc_track_cmd(
    mode: Annotated[str, typer.Argument(help="files (DVC versions every store file) | manifest (only manifest.json).")],
    params: ParamsOpt = paths.PARAMS,
    dvc_yaml: Annotated[Path, typer.Option("--dvc-yaml", help="The pipeline file to keep in step.")] = paths.DVC_YAML,
) -> None:
    """Choose what DVC versions of the hidden-state store: sets extract.dvc_track and dvc.yaml's extract outputs."""
    from draftlab.console import console
    from draftlab.store import dvc_track

    if mode not in dvc_track.MODES:
        _fail(f"dvc-track: {mode!r} is not one of {', '.join(dvc_track.MODES)}")
    for path in (params, dvc_yaml):
        if not path.is_file():
            _fail(f"{path}: not found (run from the repository root, or pass --params / --dvc-yaml)")
    try:
        dvc_track.write(mode, params_yaml=params, dvc_yaml=dvc_yaml)
    except ValueError as err:
        _fail(str(err))
    _load(params)
    console.print(f"[bold]dvc-track[/]: extract.dvc_track = {mode} in {params}; {dvc_yaml}'s extract outputs: "
                  + ("the whole store" if mode == "files" else "its manifest.json only (the files are outside DVC)")
                  + "; `dvc repro` applies it")


@command()
def summary(
    params: ParamsOpt = paths.PARAMS,
) -> None:
    """What the pipeline produced and where to look."""
    from draftlab.summary import show

    show(_load(params))


@command()
def status(
    path: Annotated[Path, typer.Argument(help="A run folder (the train stage's --out) or a sweep's study folder.")]
    = paths.TRAIN,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object, nothing else.")] = False,
    watch: Annotated[bool, typer.Option("--watch", help="Refresh in place until the job ends (Ctrl-C leaves).")]
    = False,
) -> None:
    """Where a training or a sweep stands: state, step, ETA, loss trend, bottleneck, checkpoint, tracking."""
    from draftlab import status as st

    if watch:
        info = st.watch(path)
    else:
        info = st.status(path)
        if not as_json:
            from rich.console import Console

            Console(highlight=False).print(st.render(info))  # the answer: stdout
    if as_json:
        typer.echo(st.to_json(info))


@command("tracking-import")
def tracking_import(
    spools: Annotated[list[Path], typer.Argument(help="Spools written while MLflow was unreachable (each "
                                                 "stage names its own at its end).")],
) -> None:
    """Upload the records (metrics, params, tags, artifacts, the run's end) kept locally during a tracking outage."""
    from draftlab.console import console
    from draftlab.registry import replay as replay_registry
    from draftlab.tracking import replay_spool

    for spool in spools:
        if not spool.is_file():
            _fail(f"{spool}: no such spool file")
    for spool in spools:
        try:
            n = replay_spool(spool, replay_registry=replay_registry)
        except UserError:
            raise
        except Exception as err:  # noqa: BLE001 — the server is away again: nothing is lost, import again later
            from draftlab.errors import HostError

            from draftlab import redact

            raise HostError(f"{spool}: MLflow refused the upload ({type(err).__name__}: {redact.text(str(err))[:200]}); the spool "
                            "is kept: run `draftlab tracking-import` again once the server answers") from None
        spool.rename(spool.with_suffix(".imported.jsonl"))
        console.print(f"[bold]tracking[/]: {n} records uploaded from {spool}")


@command("params")
def params_reference() -> None:
    """Print the params reference (every key, its default and meaning)."""
    from draftlab.params import Params, reference

    typer.echo(reference(Params))


def main() -> None:
    import atexit
    import os

    from draftlab import threads

    threads.configure()  # before torch loads; children (torchrun, ranks, trials) inherit it
    try:
        app()
        code = 0
    except SystemExit as done:
        code = done.code
    except KeyboardInterrupt:
        code = 130
    if isinstance(code, str):
        print(code, file=sys.stderr)
        code = 1
    # The work is done and every atexit handler (MLflow's flushes included) runs here; what is
    # skipped is the interpreter's teardown of torch, transformers and mlflow, measured at 4–7 s
    # per command on a loaded 2-core VM: wall-clock no cost model or user should pay.
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code or 0)


if __name__ == "__main__":
    main()
