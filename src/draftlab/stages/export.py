"""The `export` stage: the trained draft as a folder vLLM serves (draftlab.serve.draft_export), logged
into its training run as an MLflow model and registered as a new version of the target's
registered model, with the evaluate stage's figures where its reports are this run's
(draftlab.registry.drafts).

    draftlab export --params params.yaml --train runs/train --reports reports --out models/draft
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from draftlab.params import Params
from draftlab.serve.draft_export import export_draft


@dataclass(frozen=True)
class ExportResult:
    out_dir: Path
    verifier_path: str


def run(params: Params, *, target_dir: Path, train_dir: Path, store_dir: Path, out_dir: Path, tracker=None,
        reports_dir: Path | None = None) -> ExportResult:
    from draftlab.console import console

    done = export_draft(params, target_dir=target_dir, train_dir=train_dir, store_dir=store_dir, out_dir=Path(out_dir))
    if tracker is not None:
        tracker.log_artifact(done.out_dir / "config.json", "export")
        tracker.log_artifact(done.out_dir / "README.md", "export")
        tracker.set_tags({"draftlab.export": str(done.out_dir), "draftlab.export.verifier_path": done.verifier_path})
    console.print(f"[bold]export[/]: {done.out_dir} (verifier → {done.verifier_path}); serve: {done.serve_command}",
                  soft_wrap=True)
    if tracker is not None:
        from draftlab.registry.drafts import register_export

        if line := register_export(params, tracker, draft_dir=done.out_dir, train_dir=train_dir, store_dir=store_dir,
                                   reports_dir=reports_dir):
            console.print(f"[bold]export[/]: {line}", soft_wrap=True)
    return ExportResult(done.out_dir, done.verifier_path)
