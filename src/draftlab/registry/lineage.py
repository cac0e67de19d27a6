"""Which data trained which draft, as MLflow datasets: the training run logs the prepared data's
train split and the hidden-state store as its inputs (context `training`), evaluation the
validation split (context `evaluation`, into the same run).

A digest is a hash the pipeline already keeps, cut to MLflow's 36-character limit: the prepared
data's `dataset_fingerprint` (sha256 of its Arrow files, part of every training's run key) and the
store manifest's sha256 (the `data.hidden_states_hash` tag). Two runs on the same data show the
same digest, and the full hashes are in each dataset's profile.
"""

from __future__ import annotations

import json
from pathlib import Path

DIGEST_CHARS = 32  # MLflow stores at most 36 characters of a dataset digest
CONTEXT_TAG = "mlflow.data.context"  # MLflow's own tag: what the UI shows beside a dataset
PREPARED, STORE = "prepared", "hidden-states"


def prepared_dataset(data_dir: Path, *, split: str, train_ratio: float, context: str) -> dict[str, str]:
    """The prepared dataset's `split` ("train" or "val") as a spoolable dataset record."""
    from draftlab.rundir import prepare_record
    from draftlab.store.capture import dataset_fingerprint

    fingerprint = dataset_fingerprint(Path(data_dir))
    profile: dict = {"split": split, "train_ratio": train_ratio, "fingerprint_sha256": fingerprint}
    record = prepare_record(data_dir).peek()
    if record is not None:
        profile.update(samples=record.num_train if split == "train" else record.num_val,
                       all_samples=record.num_samples, tokens=record.num_tokens, loss_tokens=record.num_loss_tokens)
    return _dataset(f"{PREPARED}.{split}", fingerprint, data_dir, profile, context)


def store_dataset(store_dir: Path, *, context: str) -> dict[str, str]:
    """The hidden-state store (its manifest) as a spoolable dataset record."""
    from draftlab.store import layout as store

    manifest = store.read_manifest(store_dir)
    sha = store.manifest_hash(store_dir)
    profile = {"manifest_sha256": sha, "dtype": manifest.dtype, "layer_ids": manifest.layer_ids,
               "files": manifest.num_files, "tokens": manifest.num_tokens, "bytes": manifest.total_bytes,
               "target": manifest.target.path or manifest.target.source, "hidden_size": manifest.target.hidden_size}
    return _dataset(STORE, sha, store_dir, profile, context)


def source_datasets(source, *, context: str) -> list[dict[str, str]]:
    """Where the hidden states came from (`HiddenStateSource.lineage`) as dataset records: the
    store, or the online server's description; none for a source that records nothing."""
    what = source.lineage()
    return [] if what is None else [_dataset(what["name"], what["sha"], what["path"], what["profile"], context)]


def _dataset(name: str, sha: str, path: Path, profile: dict, context: str) -> dict[str, str]:
    return {"name": name, "digest": sha[:DIGEST_CHARS], "source_type": "local",
            "source": json.dumps({"uri": str(Path(path).resolve())}), "profile": json.dumps(profile),
            "context": context}


def log_inputs(tracker, datasets: list[dict[str, str]]) -> None:
    """The datasets as inputs of the tracker's run, or a spool record while MLflow is away."""
    tracker.call("inputs", {"datasets": datasets}, lambda: send_inputs(tracker.client, tracker.run_id, datasets))


def send_inputs(client, run_id: str, datasets: list[dict[str, str]]) -> None:
    """MLflow keeps one input per (run, dataset name, digest): sending twice adds nothing."""
    from mlflow.entities import Dataset, DatasetInput, InputTag

    inputs = [DatasetInput(Dataset(d["name"], d["digest"], d["source_type"], d["source"], profile=d.get("profile")),
                           [InputTag(CONTEXT_TAG, d["context"])]) for d in datasets]
    client.log_inputs(run_id, datasets=inputs)
