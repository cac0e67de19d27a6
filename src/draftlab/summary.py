"""`draftlab summary`: what `dvc repro` produced and where to look, read from the outputs
themselves (reports, manifests), so it never claims a stage ran when it did not."""

from __future__ import annotations

import json
from pathlib import Path

from draftlab import paths
from draftlab.params import Params
from draftlab.rundir import RunDir, StoreDir, export_record, prepare_record

OUTPUTS = [
    ("target", paths.TARGET, paths.TARGET_REPORT),
    ("prepare", paths.PREPARED, prepare_record(paths.PREPARED).path),
    ("extract", paths.STORE, StoreDir(paths.STORE).manifest.path),
    ("train", paths.TRAIN, RunDir(paths.TRAIN).train.path),
    ("evaluate", paths.REPORTS, paths.REPORTS / "metrics.json"),
    ("export", paths.DRAFT, export_record(paths.DRAFT).path),
]


def _read(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def _line(stage: str, info: dict) -> str:
    if stage == "target":
        return f"{info.get('source')} target, distinct-token ratio {info.get('distinct_token_ratio_trained', '—')}"
    if stage == "prepare":
        return f"{info['num_samples']} samples ({info['num_train']} train / {info['num_val']} val), {info['num_tokens']:,} tokens"
    if stage == "extract":
        return f"{info['num_files']} files, {info['num_tokens']:,} tokens, {info['total_bytes'] / 2**20:.1f} MiB, layers {info['layer_ids']}"
    if stage == "train":
        return f"{info.get('total_steps')} steps on {info.get('world_size')} rank(s), MLflow run {info.get('run_id')}"
    if stage == "evaluate":
        keys = [k for k in ("eval/simulated_acc_len", "eval/measured_acc_len") if k in info]
        return ", ".join(f"{k.split('/')[1]} = {info[k]:.3f}" for k in keys) or "metrics written"
    return f"verifier → {info.get('verifier_path')}, k = {info.get('num_speculative_tokens')} (see its README.md)"


def show(params: Params) -> None:
    from rich.table import Table

    from draftlab.console import console

    table = Table(title="draftlab: what was produced", show_lines=False)
    table.add_column("stage")
    table.add_column("output")
    table.add_column("figures")
    for stage, where, path in OUTPUTS:
        info = _read(path)
        if info is not None:
            table.add_row(stage, str(where), _line(stage, info))
    console.print(table)
    console.print("Look next:")
    from draftlab.tracking import ui_url

    console.print(f"  MLflow UI:   mlflow ui --backend-store-uri sqlite:///mlflow.db   (then open {ui_url()})")
    console.print(f"  DVC metrics: dvc metrics show    plots: dvc plots show   figures: {paths.REPORTS}/")
    console.print(f"  Store check: draftlab verify {paths.STORE}")
    console.print(f"  Sweep:       draftlab sweep experiments/sweep-tiny.yaml --budget 10m   (report: {paths.SWEEPS}/)")
