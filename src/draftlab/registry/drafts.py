"""The exported draft in MLflow's model registry.

`export` logs the whole draft folder as a logged model of its training run (MLflow 3's logged
models, model type `eagle3-draft`) and registers it as a new version of one registered model per
target (`export.registered_model`, default `<target>-eagle3`). The folder is logged as it is, with
no MLmodel file: a speculators checkpoint is not a Python model, and nothing added to it means
`mlflow.artifacts.download_artifacts("models:/<name>@<alias>")` gives back exactly the folder
vLLM serves. The version carries the figures a user chooses by, as tags (`acceptance.*`,
`draft.*`, `store.dtype`, `train.*`) and a one-line description that the UI's version list shows.

A version is the draft folder's content: its digest (`draftlab.digest`) finds it again, so an
export rerun, or an import of a spool twice, registers nothing twice (the tags are refreshed).
A sweep's best trial's version gets the alias `best-<study>` (`name_best`), moved only when a
later sweep's best beats the holder's objective.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

MODEL_TYPE = "eagle3-draft"
DIGEST_TAG = "draftlab.digest"  # sha256 of the draft folder's files: what makes two exports the same version
OBJECTIVE_TAGS = ("sweep.objective", "sweep.value")  # the metric and value a `best-<study>` alias was won with
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,199}$")


def default_model_name(params) -> str:
    """`<target>-eagle3`: the tiny default's `tiny-eagle3`, a hub id's or folder's last part."""
    target = "tiny" if params.target.source == "tiny" else Path(params.target.path.rstrip("/")).name
    return re.sub(r"[^A-Za-z0-9._-]", "-", target).lstrip(".-_") + "-eagle3"


def model_name(params) -> str:
    return params.export.registered_model or default_model_name(params)


def folder_digest(folder: Path) -> str:
    """sha256 over the folder's relative file names and each file's sha256."""
    from draftlab.util import sha256_file

    h = hashlib.sha256()
    for path in sorted(p for p in Path(folder).rglob("*") if p.is_file()):
        h.update(path.relative_to(folder).as_posix().encode() + b"\0" + sha256_file(path).encode() + b"\n")
    return h.hexdigest()


def alias_for(study: str) -> str:
    return "best-" + re.sub(r"[^A-Za-z0-9_-]", "-", study)


# ---------------------------------------------------------------- what a version says about the draft


def _rounded(value: float, places: int = 3) -> str:
    return f"{value:.{places}f}"


def figures(*, draft_dir: Path, train_dir: Path, store_dir: Path, reports_dir: Path | None,
            online: bool = False) -> tuple[dict, str]:
    """(tags, description) of the draft exported into `draft_dir`: acceptance (from the evaluate
    stage's reports of the same run, where present), the draft's shape, the store's dtype and
    what its training cost. `online`: trained from a live vLLM (train.source: vllm), no store."""
    from draftlab.rundir import RunDir, export_record
    from draftlab.store import layout as store

    exported = export_record(draft_dir).read()
    cfg = json.loads((Path(draft_dir) / "config.json").read_text())
    train = RunDir(train_dir).train.read()
    dtype = "online (vllm)" if online else store.read_manifest(store_dir).dtype
    tokens = round(train.tokens_per_s * (train.torchrun_wall_s or train.wall_clock_s))
    tags = {"draft.vocab_size": str(cfg.get("draft_vocab_size", "")), "draft.layer_ids": json.dumps(exported.layer_ids),
            "draft.num_speculative_tokens": str(exported.num_speculative_tokens), "store.dtype": dtype,
            "train.tokens": str(tokens), "train.hours": _rounded(train.wall_clock_s / 3600, 4),
            "train.world_size": str(train.world_size), "train.steps": str(train.total_steps),
            "target": exported.verifier_path}
    metrics = _evaluated(reports_dir, train.run_id)
    parts = []
    for tag, key, label in (("acceptance.simulated", "eval/simulated_acc_len", "simulated"),
                            ("acceptance.measured", "eval/measured_acc_len", "measured"),
                            ("acceptance.vllm", "eval/vllm_measured_acc_len", "vLLM")):
        if key in metrics:
            tags[tag] = _rounded(metrics[key])
            parts.append(f"{label} {tags[tag]}")
    for tag, prefix in (("acceptance.simulated_per_position", "eval/full_acc_"),
                        ("acceptance.per_position", "eval/accept_rate_"),
                        ("acceptance.vllm_per_position", "eval/vllm_accept_rate_")):
        rates = [metrics[f"{prefix}{k}"] for k in range(exported.num_speculative_tokens) if f"{prefix}{k}" in metrics]
        if rates:
            tags[tag] = json.dumps([round(r, 3) for r in rates])
    acceptance = ("acceptance length " + ", ".join(parts)) if parts else "not evaluated (run `draftlab evaluate`)"
    description = (f"{acceptance}; draft vocab {tags['draft.vocab_size']}, layers {exported.layer_ids}, "
                   f"store {dtype}; {tokens:,} tokens in {train.wall_clock_s / 3600:.2f} h on "
                   f"{train.world_size} rank(s), {train.total_steps} steps")
    return tags, description


def _evaluated(reports_dir: Path | None, run_id: str) -> dict:
    """evaluate's metrics.json if it is this run's, else {} (a stale report describes another draft)."""
    path = Path(reports_dir) / "metrics.json" if reports_dir is not None else None
    if path is None or not path.is_file():
        return {}
    try:
        metrics = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if metrics.get("run_id") != run_id:
        return {}
    return {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float))}


# ---------------------------------------------------------------- registering


def register_export(params, tracker, *, draft_dir: Path, train_dir: Path, store_dir: Path,
                    reports_dir: Path | None) -> str | None:
    """Log and register the draft in `draft_dir` through `tracker` (its training run); the line
    to print, or None while MLflow is away (the registration waits in the tracker's spool)."""
    name = model_name(params)
    tags, description = figures(draft_dir=draft_dir, train_dir=train_dir, store_dir=store_dir, reports_dir=reports_dir,
                                online=params.train.source == "vllm")
    payload = {"path": str(Path(draft_dir).resolve()), "digest": folder_digest(draft_dir), "name": name,
               "tags": tags, "description": description}
    done: dict = {}
    tracker.call("register", payload,
                 lambda: done.update(version=register(tracker.client, run_id=tracker.run_id, **payload)))
    if "version" not in done:
        return None
    return f"registered as {name} version {done['version']} (models:/{name}/{done['version']}): {description}"


def register(client, *, run_id: str, path: str, digest: str, name: str, tags: dict[str, str],
             description: str) -> str:
    """The version of `name` holding the folder at `path` (digest `digest`), made if none is; its number."""
    from mlflow.entities import LoggedModelOutput, LoggedModelStatus
    from mlflow.exceptions import MlflowException
    from mlflow.protos.databricks_pb2 import RESOURCE_ALREADY_EXISTS, ErrorCode

    try:
        client.create_registered_model(name, description="EAGLE-3 drafts trained by draftlab; each version is "
                                       "an exported draft folder that vLLM serves as it is")
    except MlflowException as err:
        if err.error_code != ErrorCode.Name(RESOURCE_ALREADY_EXISTS):
            raise
    mine = [v for v in client.search_model_versions(f"name='{name}' and run_id='{run_id}'")
            if v.tags.get(DIGEST_TAG) == digest]
    if mine:  # registered before (an export rerun, an import twice): refresh what it says
        version = min(mine, key=lambda v: int(v.version)).version
        for key, value in tags.items():
            client.set_model_version_tag(name, version, key, value)
        client.update_model_version(name, version, description=description)
        return str(version)
    run = client.get_run(run_id)
    model = next((m for m in client.search_logged_models([run.info.experiment_id],
                                                         filter_string=f"source_run_id = '{run_id}'")
                  if m.tags.get(DIGEST_TAG) == digest and m.status == LoggedModelStatus.READY), None)
    if model is None:
        model = client.create_logged_model(run.info.experiment_id, name="draft", source_run_id=run_id,
                                           tags={DIGEST_TAG: digest, **tags}, model_type=MODEL_TYPE)
        client.log_model_artifacts(model.model_id, path)
        client.finalize_logged_model(model.model_id, "READY")
        client.log_outputs(run_id, [LoggedModelOutput(model.model_id, step=0)])
    version = client.create_model_version(name, source=f"models:/{model.model_id}", run_id=run_id,
                                          tags={**tags, DIGEST_TAG: digest}, description=description,
                                          model_id=model.model_id)
    return str(version.version)


def replay_registration(client, rec) -> None:
    """A spooled registration: the folder is registered only if it still has the digest it was
    exported with (a later export replaced it, and registers itself)."""
    from draftlab.console import console

    folder = Path(rec.path)
    if not folder.is_dir() or folder_digest(folder) != rec.digest:
        console.print(f"[yellow]registry[/]: {folder} changed since run {rec.run_id} exported it; not registered "
                      f"(`draftlab export` registers the draft it holds now)", soft_wrap=True)
        return
    version = register(client, run_id=rec.run_id, path=rec.path, digest=rec.digest, name=rec.name, tags=rec.tags,
                       description=rec.description)
    console.print(f"[bold]registry[/]: {rec.name} version {version} holds {folder}", soft_wrap=True)


# ---------------------------------------------------------------- a sweep's best


def name_best(tracker, params, *, study: str, metric: str, direction: str, value: float, run_id: str) -> None:
    """The alias `best-<study>` on the version trial run `run_id` registered, unless the holder's
    objective is at least as good; through `tracker` (the sweep's parent run) and its spool."""
    from draftlab import tracking
    from draftlab.console import console

    name, alias = model_name(params), alias_for(study)
    payload = {"name": name, "alias": alias, "metric": metric, "direction": direction, "value": value,
               "trial_run_id": run_id}
    done: dict = {}
    tracker.call("alias", payload, lambda: done.update(result=alias_best(
        tracker.client, name=name, alias=alias, run_id=run_id, metric=metric, direction=direction, value=value,
        required=False)))
    if "result" not in done:
        return
    version, moved, holder = done["result"]
    if version is None:
        console.print(f"[yellow]sweep[/]: the best trial's draft (run {run_id}) has no version of {name} (see its "
                      "trial.log); no alias set", soft_wrap=True)
        return
    if moved:
        console.print(f"[bold]sweep[/]: {alias} → {name} version {version} ({metric} = {value:.4f})", soft_wrap=True)
    elif str(holder.version) == version:
        console.print(f"[bold]sweep[/]: {alias} is already {name} version {version} ({metric} = {value:.4f})",
                      soft_wrap=True)
    else:
        console.print(f"[bold]sweep[/]: {alias} stays on {name} version {holder.version} ({metric} = "
                      f"{holder.tags.get(OBJECTIVE_TAGS[1])}, not beaten by {value:.4f})", soft_wrap=True)
    uri = tracking.tracking_uri()
    console.print(f"[bold]sweep[/]: load it: MLFLOW_TRACKING_URI={uri} mlflow artifacts download "
                  f"--artifact-uri 'models:/{name}@{alias}' --dst-path models/{alias}  (a folder vLLM serves)",
                  soft_wrap=True)


def alias_best(client, *, name: str, alias: str, run_id: str, metric: str, direction: str, value: float,
               required: bool = True):
    """(version, moved, holder): the alias moves to run `run_id`'s latest version of `name` when
    no version holds it, the holder was won on another metric, or `value` beats the holder's.
    A run with no version: (None, False, None), or with `required` an error (a spool's import
    before the trial's own)."""
    from mlflow.exceptions import MlflowException

    from draftlab.errors import HostError

    versions = client.search_model_versions(f"name='{name}' and run_id='{run_id}'")
    if not versions:
        if not required:
            return None, False, None
        raise HostError(f"{name}: no version registered from run {run_id}; import that trial's spool "
                        "(`draftlab tracking-import <trial>/train/tracking-spool.jsonl`) first, then this one again")
    version = str(max(int(v.version) for v in versions))
    for key, text in zip(OBJECTIVE_TAGS, (metric, repr(float(value))), strict=True):
        client.set_model_version_tag(name, version, key, text)
    try:
        holder = client.get_model_version_by_alias(name, alias)
    except MlflowException:
        holder = None
    if holder is not None and str(holder.version) == version:
        return version, False, holder
    held = holder.tags.get(OBJECTIVE_TAGS[1]) if holder is not None else None
    if holder is not None and held is not None and holder.tags.get(OBJECTIVE_TAGS[0]) == metric:
        beaten = value > float(held) if direction == "maximize" else value < float(held)
        if not beaten:
            return version, False, holder
    client.set_registered_model_alias(name, alias, version)
    return version, True, holder
