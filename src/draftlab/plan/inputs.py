"""What `draftlab plan` reads before it plans, without writing anything: the dataset's counts
(or the stated ones), the target's hidden size H, and the measured cost-model points in MLflow.

    H        --hidden-size, else the target's own config.json: the tiny profile's params, a local
             folder, or the hub cache (never the network); else the store's manifest when it
             was extracted from this target; else the flag is required
    points   draftlab.plan.costmodel.points_from_mlflow, only if the tracking store exists: a
             sqlite file or mlruns folder that is not there is not created
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from draftlab.params import Params, ParamsError


def stated_counts(samples: int | None, tokens: int | None) -> tuple[int, int] | None:
    """Both counts, or neither (then the dataset's lengths are read)."""
    if (samples is None) != (tokens is None):
        given, missing = ("--samples", "--tokens") if tokens is None else ("--tokens", "--samples")
        raise ParamsError(f"{given}: counts need {missing} too (or neither, to read the prepared dataset)")
    if samples is None:
        return None
    if samples < 1 or tokens < samples:
        raise ParamsError(f"--tokens: {tokens:,} tokens cannot fill {samples:,} samples (at least one token each)")
    return samples, tokens


def dataset_lengths(data_dir: Path) -> list[int]:
    if not (data_dir / "dataset_info.json").exists() and not list(data_dir.glob("*.arrow")):
        raise ParamsError(f"{data_dir}: no prepared dataset; run `dvc repro prepare` or pass --samples N --tokens N")
    from datasets import load_from_disk

    return [int(n) for n in load_from_disk(str(data_dir)).with_format(None)["seq_len"]]


def _config_hidden_size(config: dict) -> int | None:
    for c in (config, config.get("text_config") or {}):  # multimodal targets nest the LM's config
        if isinstance(c.get("hidden_size"), int):
            return c["hidden_size"]
    return None


def target_config(params: Params, target_dir: Path) -> tuple[dict | None, str]:
    """The target's config.json (and where it was read), or None with where it was looked for."""
    t = params.target
    if t.source == "tiny":
        return {"hidden_size": t.tiny.hidden_size}, "target.tiny.hidden_size"
    if t.source == "local":
        path = Path(t.path).expanduser() / "config.json"
        return (json.loads(path.read_text()), str(path)) if path.is_file() else (None, str(path))
    from huggingface_hub import try_to_load_from_cache

    cached = try_to_load_from_cache(t.path, "config.json", cache_dir=os.environ.get("HF_HUB_CACHE"),
                                    revision=t.revision)
    if isinstance(cached, str) and Path(cached).is_file():
        return json.loads(Path(cached).read_text()), f"{cached} (hub cache)"
    return None, f"the hub cache for {t.path!r}"


def hidden_size(params: Params, target_dir: Path, store_dir: Path, flag: int | None) -> tuple[int, str]:
    if flag is not None:
        return flag, "--hidden-size"
    config, where = target_config(params, target_dir)
    if config is not None and (h := _config_hidden_size(config)):
        return h, where
    from draftlab.store import layout as store

    if store.has_manifest(store_dir):
        target = store.read_manifest(store_dir).target
        if target.source == params.target.source and target.path == params.target.path:
            return target.hidden_size, str(store.manifest_path(store_dir))
    raise ParamsError(f"--hidden-size: the target's config.json is not here ({where}); pass --hidden-size "
                      "(e.g. 7168 for Kimi-K2.5) or download its config.json")


def source_identity(params: Params, store_dir: Path, target_dir: Path) -> str | None:
    """The identity of the hidden states `train.source` reads (`HiddenStateSource.identity`: a
    store's manifest hash, an online server's target and layers) when it can be named before
    anything runs; past runs must have trained on the same (their `data.hidden_states_hash`)."""
    from draftlab.store.hidden_states import planned_source

    config, _ = target_config(params, target_dir)
    source = planned_source(params, store_dir=store_dir, target_dir=target_dir, config=config)
    return None if source is None else source.identity()


def tracking_store_exists(uri: str) -> bool:
    if uri.startswith("sqlite:///"):
        return Path(uri[len("sqlite:///"):]).is_file()
    if uri.startswith("file:"):
        from urllib.parse import urlparse

        return Path(urlparse(uri).path).exists()
    if "://" not in uri:
        return Path(uri).exists()
    return True  # a server: reading it creates nothing


def measured_points(params: Params, store_dir: Path, target_dir: Path) -> tuple[dict, str]:
    """(points by GPU count, a note on where they were looked for): past runs that read the same
    kind of source (`train.source`) and, when it can be named, the same hidden states."""
    from draftlab import redact, tracking

    uri = tracking.tracking_uri()
    shown = redact.url(uri)
    if not tracking_store_exists(uri):
        return {}, f"no MLflow store at {shown}"
    from draftlab.plan import costmodel

    try:
        points = costmodel.points_from_mlflow(params, client=tracking.client(uri), source=params.train.source,
                                              store_hash=source_identity(params, store_dir, target_dir))
    except Exception as err:  # noqa: BLE001 — unreachable server, old schema: plan without them
        return {}, f"MLflow at {shown} not read ({type(err).__name__})"
    return points, f"{len(points)} matching run(s) in {shown}"
