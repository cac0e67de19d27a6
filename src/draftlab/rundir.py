"""The files stages and processes hand each other, as typed records with one reader and writer.

Every JSON file a stage, the launcher, a rank or a sweep trial writes for another to read is a
pydantic model here, and its name is known only here:

    <store>/manifest.json           Manifest       extract → verify, train, evaluate, export, plan
    <store>/.journal.jsonl          (store.Journal) extraction's resume record
    <store>/bad-files.jsonl         (lines)        a reader or verify → extract: files to re-extract
    <run>/run.json                  RunState       the MLflow run this folder resumes, and its key
    <run>/launch.json               Launch         torchrun's process group (stop_orphans, the sweep)
    <parent>/.<run>.lock            (flock)        one launcher per folder, beside it (per node: .lock-node<k>)
    <run>/node<k>/pids/             (procs)        node k's ranks, stopped only by node k's launcher
    <run>/plan.json                 RankPlan       launcher → ranks: steps, tokens, ETA priors, settings
    <run>/accounting.json           AccountingRecord  the exact step accounting (an MLflow artifact)
    <run>/accounting-check.json     AccountingCheck   what the ranks did against it
    <run>/failure.json              Failure        a rank → the launcher: why training stopped
    <run>/command.json              Command        the torchrun command line
    <run>/timing.json               Timing         the cost model's measurements of the run
    <run>/rank0-done.json           RankDone       rank 0 → the launcher: its observers' CPU time
    <run>/progress.json             Progress       rank 0 → `draftlab status`, the live verdict: step, ETA, trend
    <run>/train.json                TrainRecord    train → evaluate, export, sweep trials
    <run>/tracking-spool.jsonl      SpoolRecord    MLflow calls kept during an outage → tracking-import
    <run>/tracking-relay.jsonl      SpoolRecord    rank 0's MLflow records → node 0's launcher (tracking.Relay)
    <run>/tracking-relay.sent       (offset)       how far the launcher has uploaded the relay file
    <run>/samples/rank<r>.jsonl     (lines)        each rank's sampler → the launcher's sharding check
    <run>/profile/rank<r>.jsonl     (lines)        each rank's step profile → telemetry's verdict, timing
    <run>/pids/<name>.json          (procs)        each process's pid → stop_orphans after a kill
    <run>/checkpoints/<epoch>/      (speculators)  a complete checkpoint: written aside, then renamed
                                                   (training.checkpoint; `draftlab-complete.json` last)
    <run>/bottleneck.json           (telemetry)    the bottleneck verdict and its evidence
    <run>/bottleneck-live.json      (observe.live) the launcher's latest window → `draftlab status`
    <prepared>/prepare.json         PrepareRecord  prepare's counts and drops (summary, tests)
    <draft>/export.json             ExportRecord   what export shipped (summary)
    <trial>/trial.json              TrialInfo      the sweep → its record of what a trial is
    <trial>/result.json             TrialResult    a trial process → the sweep
    <study>/tracking-spool.jsonl    SpoolRecord    the sweep's parent-run MLflow calls kept during an outage

Writes are atomic (a kill -9 leaves the old file or the new one); a file that is missing where
it must be, or is partial or malformed, is one line naming it and what to do (`RunFileError`,
exit 2). A record is written with the fields it was given, so a file read and written again
keeps its bytes. The lock and launch files are per node (`node_rank`); node 0 has the names
single-node runs always had.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any, Generic, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, RootModel, TypeAdapter, ValidationError

from draftlab.errors import RunFileError
from draftlab.util import write_json_atomic


class Record(BaseModel):
    model_config = ConfigDict(extra="forbid")


M = TypeVar("M", bound=BaseModel)


def _problem(err: ValidationError) -> str:
    first = err.errors()[0]
    where = ".".join(str(p) for p in first["loc"]) or "the top level"
    more = f" (and {err.error_count() - 1} more)" if err.error_count() > 1 else ""
    return f"{where}: {first['msg']}{more}"


class JsonFile(Generic[M]):
    """One run-folder file of one model: read, write (atomic), exists, unlink."""

    def __init__(self, path: Path, model: type[M], remedy: str):
        self.path, self.model, self.remedy = Path(path), model, remedy

    def __repr__(self) -> str:
        return f"JsonFile({self.path}, {self.model.__name__})"

    def exists(self) -> bool:
        return self.path.is_file()

    def parse(self, text: str) -> M:
        try:
            return self.model.model_validate_json(text)
        except ValidationError as err:
            if any(e["type"] == "json_invalid" for e in err.errors()):
                why = "partial or not JSON" if text.strip() else "empty"
            else:
                why = f"malformed ({_problem(err)})"
            raise RunFileError(f"{self.path}: {why}; {self.remedy}") from None

    def read(self) -> M:
        try:
            text = self.path.read_text()
        except FileNotFoundError:
            raise RunFileError(f"{self.path}: not found; {self.remedy}") from None
        except (OSError, UnicodeDecodeError) as err:
            raise RunFileError(f"{self.path}: unreadable ({err}); {self.remedy}") from None
        return self.parse(text)

    def read_or_none(self) -> M | None:
        """None when the file is not there (yet); a malformed one still raises."""
        return self.read() if self.exists() else None

    def peek(self) -> M | None:
        """Best effort, for a watcher of a process that may be writing it: None on any problem."""
        try:
            return self.read_or_none()
        except RunFileError:
            return None

    def write(self, value: M) -> None:
        if not isinstance(value, self.model):
            raise TypeError(f"{self.path}: expects a {self.model.__name__}, got {type(value).__name__}")
        write_json_atomic(self.path, value.model_dump(mode="json", exclude_unset=True))

    def unlink(self) -> None:
        self.path.unlink(missing_ok=True)


def _file(name: str, model: type[BaseModel], remedy: str) -> property:
    """A folder's JSON file of one model, as an attribute: `RunDir(p).train.read()`."""
    return property(lambda self: JsonFile(self.path / name, model, remedy), doc=f"`{name}`: {model.__name__}")


def _path(name: str, doc: str = "") -> property:
    return property(lambda self: self.path / name, doc=doc or f"`{name}`")


class _Folder:
    def __init__(self, path: Path):
        self.path = Path(path)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.path})"


# ---------------------------------------------------------------- stage records


class PrepareRecord(Record):
    num_samples: int
    num_train: int
    num_val: int
    num_tokens: int
    num_loss_tokens: int
    skipped_records: int
    dropped_no_assistant_tokens: int
    regenerated: bool
    regenerate_compute: dict[str, Any] | None = Field(None, description="device and compute dtype of the "
                                                      "regeneration (GPU bf16 and CPU differ token by token)")
    wall_clock_s: float


class ExportRecord(Record):
    run_id: str
    checkpoint: str
    verifier_path: str
    layer_ids: list[int] = Field(min_length=3, max_length=3)
    num_speculative_tokens: int
    dtype: str
    serve_command: str


def prepare_record(data_dir: Path) -> JsonFile[PrepareRecord]:
    """The prepared dataset folder's record (beside speculators' dataset files)."""
    return JsonFile(Path(data_dir) / "prepare.json", PrepareRecord, "run `draftlab prepare` (or `dvc repro prepare`)")


def export_record(draft_dir: Path) -> JsonFile[ExportRecord]:
    return JsonFile(Path(draft_dir) / "export.json", ExportRecord, "run `draftlab export` (or `dvc repro export`)")


# ---------------------------------------------------------------- the hidden-state store


class StoreFile(Record):
    index: int
    name: str
    bytes: int
    sha256: str
    tokens: int


class TargetInfo(Record):
    path: str | None = None
    source: str
    num_layers: int
    hidden_size: int
    vocab_size: int | None = None


class Manifest(Record):
    """What a store holds; written last by extract (either backend), so its presence means done."""

    key: str
    key_fields: dict[str, Any] | None = None
    target: TargetInfo
    layer_ids: list[int] = Field(min_length=3, max_length=3, description="the 3 auxiliary layers, "
                                 "before the final one; the draft is trained and served with exactly these")
    dtype: Literal["bfloat16", "float16", "float32", "float8_e4m3fn"] = "bfloat16"
    compute: dict[str, Any] | None = None
    num_files: int
    num_tokens: int
    total_bytes: int
    bytes_per_token_analytic: int | None = None
    files: list[StoreFile]


EXTRACT = "run `draftlab extract` (or `dvc repro extract`)"


class StoreDir(_Folder):
    """A hidden-state store folder (see draftlab.store.layout for its layout)."""

    manifest = _file("manifest.json", Manifest, f"{EXTRACT}: it rewrites the manifest")
    journal_path = _path(".journal.jsonl", "extraction's resume record (draftlab.store.layout.Journal)")
    bad_files_path = _path("bad-files.jsonl", "files a reader or `verify` found bad (draftlab.store.layout.record_bad)")


# ---------------------------------------------------------------- a training run folder


class RunState(Record):
    key: str
    run_id: str
    experiment_id: str | None = Field(None, description="the run's experiment (progress.json's UI link)")


class Launch(Record):
    pgid: int
    host: str | None = Field(None, description="where that process group runs (a node's launch file)")


class RankPlan(Record):
    """What the launcher tells its ranks: the accounting's steps and tokens (perf/*), where the
    ETA starts, and the settings a rank needs beyond speculators' flags."""

    total_steps: int
    step_tokens: list[int] = Field(default_factory=list, description="real (unpadded) tokens of every global step")
    last_logged_step: int = Field(-1, description="steps up to here are in the MLflow run already (a resume)")
    epoch_steps: list[int] = Field(default_factory=list, description="global steps of each epoch (for the ETA)")
    val_steps: int = 0
    epoch_s_prior: float | None = None
    tail_s_prior: float | None = Field(None, description="median tail (after the last step) of matching runs")
    tail_s_lo: float | None = Field(None, description="smallest of those tails (the ETA's range)")
    tail_s_hi: float | None = Field(None, description="largest of those tails (the ETA's range)")
    optimizer: str = Field("AdamW", description="speculators' optimizer name, as in its `lr/<optimizer>` metric")
    verify_reads: Literal["sha256", "header"] = "sha256"
    warmup_steps: int = Field(0, description="train.warmup_steps: the convergence watch's early window starts here")
    watch: dict[str, Any] | None = Field(None, description="train.watch (draftlab.training.watch); null: no watch")


class EpochRecord(Record):
    epoch: int
    steps: int
    samples_used: int
    dropped_samples: int
    rank_digests: list[str]
    rank_samples: list[int]


class AccountingRecord(Record):
    """draftlab.plan.accounting.Accounting.to_json(): the plan and its MLflow params."""

    world_size: int
    train_samples: int
    train_tokens: int
    train_loss_tokens: int
    total_seq_len: int
    epochs: list[EpochRecord]
    max_steps: int | None = None
    trained_steps: list[int] = Field(default_factory=list)
    steps_per_epoch: list[int]
    total_steps: int
    tokens_per_step: int
    dropped_samples: list[int]
    steps_per_epoch_list: list[int]
    trained_steps_per_epoch: list[int] | None = None


class AccountingCheck(Record):
    problems: list[str]
    observed_steps: int | None


class Failure(Record):
    reason: str
    message: str


class Command(Record):
    cmd: list[str]


class Timing(RootModel[dict[str, float]]):
    """costmodel.step_timing of a run (timing/* in MLflow)."""


class Progress(Record):
    """Rank 0 → `draftlab status` and the launcher's live verdict: where the training is now
    (rewritten about once a second, at each trend check and at the last step)."""

    step: int
    total_steps: int
    epoch: int = 0
    updated_at: float = Field(description="time.time() of the write")
    eta_s: float | None = None
    eta_p10_s: float | None = None
    eta_p90_s: float | None = None
    losses: dict[str, float] = Field(default_factory=dict, description="the step's train/loss and train/loss_k")
    convergence: str = Field("warming up", description="draftlab.training.watch: warming up, learning, "
                             "stalled, diverging or diverged")
    trend: dict[str, Any] | None = Field(None, description="the last trend check (watch.Check.to_json)")
    experiment_id: str | None = None


class RankDone(Record):
    harness_cpu_s: dict[str, float] = Field(default_factory=dict,
                                            description="CPU seconds of rank 0's observers, by name")
    node_rank: int | None = Field(None, description="the node (train.node_rank) this rank ran on: torch's "
                                  "rank 0 may be on any node")
    tracking: dict[str, float] | None = Field(None, description="what tracking held the trainer's thread: "
                                              "drains (count, max and total s), outages, the longest failed call")
    startup: dict[str, float] | None = Field(None, description="when rank 0's process started, entered main(), "
                                             "had speculators loaded and called the trainer (training.startup)")


class TrainRecord(Record):
    """A finished training: what evaluate, export and a sweep trial read."""

    run_id: str
    checkpoint: str
    total_steps: int
    world_size: int
    wall_clock_s: float = Field(..., description="the `draftlab train` process's start (start-up) to the run's end: "
                                "the span `draftlab plan` predicts as wall_clock_s (= timing.wall_s)")
    tokens_per_s: float
    accounting: str
    bottleneck: str
    calibration: bool = False
    timing: dict[str, float] | None = None
    harness_cpu: dict[str, Any] | None = None
    tracking: dict[str, float] | None = Field(None, description="the writing rank's tracking stall "
                                              "(RankDone.tracking) and the launcher's outages")
    torchrun_wall_s: float | None = Field(None, description="torchrun's span alone (the ranks: from their "
                                          "launch to their exit), shorter than wall_clock_s")
    startup: dict[str, float] | None = Field(None, description="the time to the first step by phase, in seconds, "
                                             "and its total_s (training.startup)")


TRAIN = "run `draftlab train` (or `dvc repro train`)"


class SpooledMetrics(Record):
    run_id: str
    kind: Literal["metrics"]
    metrics: dict[str, float]
    step: int | None = None
    timestamp: int


class SpooledParams(Record):
    run_id: str
    kind: Literal["params"]
    params: dict[str, str]


class SpooledTags(Record):
    run_id: str
    kind: Literal["tags"]
    tags: dict[str, str]


class SpooledArtifact(Record):
    run_id: str
    kind: Literal["artifact"]
    path: str
    artifact_path: str | None = None


class SpooledEnd(Record):
    """The run's end (MlflowTracker.end): status and when it ended, as MLflow's set_terminated takes them."""

    run_id: str
    kind: Literal["end"]
    status: Literal["FINISHED", "FAILED", "KILLED"]
    end_time: int


class SpooledInputs(Record):
    """A run's dataset inputs (draftlab.registry.lineage): MLflow's Dataset fields and the context."""

    run_id: str
    kind: Literal["inputs"]
    datasets: list[dict[str, str]]


class SpooledRegistration(Record):
    """An exported draft to log as a model of the run and register (draftlab.registry.drafts);
    `digest` is the folder's at export: a folder changed since is not registered under it."""

    run_id: str
    kind: Literal["register"]
    path: str
    digest: str
    name: str
    tags: dict[str, str]
    description: str


class SpooledAlias(Record):
    """A sweep's best (draftlab.registry.drafts.name_best), logged by the sweep's run `run_id`: the
    alias moves to trial run `trial_run_id`'s version only if its objective beats the holder's."""

    run_id: str
    kind: Literal["alias"]
    trial_run_id: str
    name: str
    alias: str
    metric: str
    direction: Literal["minimize", "maximize"]
    value: float


SpoolRecord = Annotated[SpooledMetrics | SpooledParams | SpooledTags | SpooledArtifact | SpooledEnd | SpooledInputs
                        | SpooledRegistration | SpooledAlias, Field(discriminator="kind")]
_SPOOL = TypeAdapter(SpoolRecord)


def append_spool(path: Path, record: dict) -> None:
    """One MLflow call, kept while the tracking store is unreachable (one JSON line)."""
    from draftlab import appendlog

    _SPOOL.validate_python(record)  # a record the import could not read is never written
    appendlog.append(Path(path), record)  # json's NaN/Infinity, as MLflow takes them; a torn last line trimmed


def spool_folder(path: Path) -> Path:
    """The folder a spool belongs to: the run folder it lies in (`<run>/tracking-spool.jsonl`), or
    the stage output it lies beside (`<parent>/.<out>.tracking-spool.jsonl`, tracking.spool_beside)."""
    path = Path(path)
    suffix = ".tracking-spool.jsonl"
    if path.name.startswith(".") and path.name.endswith(suffix) and len(path.name) > len(suffix) + 1:
        return path.parent / path.name[1:-len(suffix)]
    return path.parent


def read_spool(path: Path) -> list[SpoolRecord]:
    """Every record of a spool, or one line naming the first bad one (nothing is uploaded then).
    A partial last line (a kill or a full disk mid-write) is a record never made, and is left out.
    An artifact record may name only a file under the spool's own folder (spool_folder): a line
    naming anything else (`~/.ssh/id_rsa`) is refused, symlinks resolved."""
    from draftlab import appendlog

    path = Path(path)
    remedy = ("a `draftlab tracking-import` spool has one MLflow call per line, as MlflowTracker writes them; "
              "fix or delete that line and import again (nothing was uploaded)")
    try:
        lines = appendlog.complete_lines(path)
    except FileNotFoundError:
        raise RunFileError(f"{path}: not found; pass the spool named when MLflow was unreachable") from None
    except (OSError, UnicodeDecodeError) as err:
        raise RunFileError(f"{path}: unreadable ({type(err).__name__}); {remedy}") from None
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            records.append(_SPOOL.validate_json(line))
        except ValidationError as err:
            why = "not JSON" if any(e["type"] == "json_invalid" for e in err.errors()) else f"malformed ({_problem(err)})"
            raise RunFileError(f"{path}:{number}: {why}; {remedy}") from None
        rec = records[-1]
        if rec.kind == "artifact" and not _under(Path(rec.path), spool_folder(path)):
            raise RunFileError(f"{path}:{number}: names {rec.path}, outside {spool_folder(path)}, the folder this "
                               "spool belongs to; draftlab uploads only that folder's files: delete that line and "
                               "import again (nothing was uploaded)")
    return records


def read_relay(path: Path, offset: int) -> tuple[list[SpoolRecord], int]:
    """The complete records of a relay file (tracking.Relay) after byte `offset`, and the offset
    after the last of them; a partial last line (a rank writing it now, or killed mid-write) is
    left for later. A malformed line is one RunFileError naming it."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            data = f.read()
    except FileNotFoundError:
        return [], 0
    end = data.rfind(b"\n") + 1
    records = []
    for line in data[:end].splitlines():
        if not line.strip():
            continue
        try:
            records.append(_SPOOL.validate_json(line))
        except ValidationError as err:
            raise RunFileError(f"{path}: a malformed record after byte {offset} ({_problem(err)}); upload the file "
                               f"with `draftlab tracking-import {path}` once that line is fixed") from None
    return records, offset + end


def _under(path: Path, folder: Path) -> bool:
    try:
        path.resolve().relative_to(folder.resolve())
        return True
    except ValueError:
        return False


class RunDir(_Folder):
    """A training run folder (the train stage's output, or a sweep trial's `train/`)."""

    run = _file("run.json", RunState, "delete it to start a new MLflow run in this folder")
    plan = _file("plan.json", RankPlan, f"{TRAIN}: the launcher rewrites it")
    accounting = _file("accounting.json", AccountingRecord, f"{TRAIN}: the launcher rewrites it")
    accounting_check = _file("accounting-check.json", AccountingCheck, f"{TRAIN}: it is rewritten")
    failure = _file("failure.json", Failure, "see the training's output; delete it and retrain")
    command = _file("command.json", Command, f"{TRAIN}: the launcher rewrites it")
    timing = _file("timing.json", Timing, f"{TRAIN}: it is rewritten")
    rank_done = _file("rank0-done.json", RankDone, f"{TRAIN}: rank 0 rewrites it")
    train = _file("train.json", TrainRecord, f"{TRAIN}: it rewrites this record")
    spool_path = _path("tracking-spool.jsonl", "MLflow calls kept while the store is unreachable (SpoolRecord)")
    relay_path = _path("tracking-relay.jsonl", "rank 0's MLflow records, which node 0's launcher uploads (tracking.Relay)")
    relay_sent_path = _path("tracking-relay.sent", "the relay file's bytes the launcher has uploaded (tracking.Relay)")
    checkpoints = _path("checkpoints")
    logs = _path("logs")
    samples_dir = _path("samples", "each rank's `rank<r>.jsonl`: the sample ids its train sampler handed out")
    pids_dir = _path("pids", "each process's `<name>.json` (pid, start time): a killed launcher's ranks")
    bottleneck_path = _path("bottleneck.json", "the bottleneck verdict and its evidence (telemetry.conclude)")
    live_verdict_path = _path("bottleneck-live.json", "the launcher's latest telemetry window (observe.live)")
    progress = _file("progress.json", Progress, "rank 0 rewrites it while it trains")
    step_metrics_path = _path("metrics.jsonl", "rank 0's train/* metrics, one JSON line a global step (train_metrics)")

    def lock_path(self, node_rank: int = 0) -> Path:
        """Beside the folder, not in it (draftlab.folder_lock): a folder set aside keeps no lock."""
        from draftlab.folder_lock import lock_path

        return lock_path(self.path, "" if node_rank == 0 else f"-node{node_rank}")

    def node_dir(self, node_rank: int = 0) -> Path:
        """Where one node's launcher keeps what only that host can act on (its ranks' pids, in
        `pids/`): the folder itself for node 0, `node<k>/` for the others."""
        return self.path if node_rank == 0 else self.path / f"node{node_rank}"

    def launch_file(self, node_rank: int = 0) -> JsonFile[Launch]:
        name = "launch.json" if node_rank == 0 else f"launch-node{node_rank}.json"
        return JsonFile(self.path / name, Launch, "no launcher is running: delete it")

    def samples_file(self, rank: int) -> Path:
        return self.samples_dir / f"rank{rank}.jsonl"

    def profile_file(self, rank: int) -> Path:
        """A rank's step profile records (telemetry.StepProfileRecorder), one JSON line a step."""
        return self.path / "profile" / f"rank{rank}.jsonl"

    def profile_files(self) -> list[Path]:
        return sorted((self.path / "profile").glob("rank*.jsonl"))


# ---------------------------------------------------------------- a sweep trial folder


class TrialInfo(Record):
    number: int
    values: dict[str, Any]
    devices: list[str]
    role: str


class TrialResult(Record):
    ok: bool
    objective: float | None = None
    run_id: str | None = None
    timing: dict[str, float] | None = None
    wall_s: float | None = None
    message: str | None = None
    convergence: str | None = Field(None, description="why the convergence watch stopped the training "
                                    "(diverged, stalled, diverging): the sweep prunes the trial")


class StudyDir(_Folder):
    """A sweep's study folder (`draftlab sweep --out`): what of it the sweep's parent run needs."""

    spool_path = _path("tracking-spool.jsonl", "the parent run's MLflow calls kept while the store is unreachable")


class TrialDir(_Folder):
    """One sweep trial's folder: its params, its record, its result, its training run folder."""

    info = _file("trial.json", TrialInfo, "the sweep rewrites it when it starts the trial")
    result = _file("result.json", TrialResult, "delete it; the sweep re-runs the trial")
    params_path = _path("params.yaml")
    log_path = _path("trial.log")
    reports = _path("reports")
    draft = _path("draft", "the trial's exported draft (a search trial's; registered in MLflow)")

    @property
    def train(self) -> RunDir:
        return RunDir(self.path / "train")
