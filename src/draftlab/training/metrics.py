"""Rank 0's training metrics per global step, in the run folder: `runs/train/metrics.jsonl`, one
JSON line per step (`{"step": 12, "epoch": 0, "train/loss": …, "train/loss_0": …}`), each step once.

The ranks write it as they train (draftlab.training.rank); the evaluate stage draws the loss curves
from it, so they come from the train stage's declared output rather than from a tracking server.
After a kill and a resume the trainer redoes the steps since its last checkpoint: those already
in the file are not written again (their first values stay, as in the MLflow run), and a line
torn by the kill is dropped."""

from __future__ import annotations

import json
from pathlib import Path

from draftlab import appendlog
from draftlab.rundir import RunDir


def read(run_dir: Path) -> dict[int, dict]:
    """step → that step's record (train/* metrics and epoch); {} when there is no file."""
    path = RunDir(Path(run_dir)).step_metrics_path
    steps: dict[int, dict] = {}
    if not path.exists():
        return steps
    for line in appendlog.complete_lines(path):
        try:
            rec = json.loads(line)
        except ValueError:  # a line torn by a kill: the step is redone and written again
            continue
        steps.setdefault(int(rec["step"]), rec)
    return steps


class StepWriter:
    """Appends steps not yet in the run folder's file."""

    def __init__(self, run_dir: Path):
        self.path = RunDir(Path(run_dir)).step_metrics_path
        self.last = max(read(run_dir), default=-1)  # a line torn by a kill is not read, and trimmed at the first write
        self.lines = appendlog.Appender(self.path)

    def write(self, step: int, metrics: dict) -> None:
        if step <= self.last:
            return
        self.lines.append({"step": step, **metrics})
        self.last = step


def backfill(run_dir: Path, client, run_id: str) -> int:
    """Steps the MLflow run has and the file lacks, written into it (a run folder from before the
    file existed, or whose file was lost): the file is rewritten whole, in step order, atomically;
    steps already in it keep their values. Returns how many steps it added."""
    import os

    have = read(run_dir)
    keys = sorted(k for k in client.get_run(run_id).data.metrics if k.startswith("train/"))
    if "train/loss" not in keys:
        return 0
    found: dict[int, dict] = {}
    for key in [*keys, "epoch"]:
        for m in client.get_metric_history(run_id, key):
            found.setdefault(m.step, {}).setdefault(key, m.value)  # a step's first value, as in the ranks' file
    missing = {s: rec for s, rec in found.items() if s not in have and "train/loss" in rec}
    if not missing:
        return 0
    for rec in missing.values():
        rec["epoch"] = int(rec.get("epoch", 0))
    merged = {**{s: {"step": s, **r} for s, r in missing.items()}, **have}
    path = RunDir(Path(run_dir)).step_metrics_path
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(json.dumps(merged[s]) + "\n" for s in sorted(merged)))
    os.replace(tmp, path)
    return len(missing)
