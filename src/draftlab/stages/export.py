"""The `export` stage: the trained draft as a folder vLLM serves.

speculators checkpoints are already in vLLM's format (`config.json` with
`speculators_model_type`, `model.safetensors`); export makes them safe to ship: the verifier
path is rewritten for the serving host (`export.verifier_path`), exactly 3 auxiliary layer ids
(a 4th crashes vLLM's EAGLE-3 loader), bf16 weights, a shape check against the target, and a
README with the `vllm serve` command. It never writes a null verifier path (such a checkpoint
cannot be reloaded offline).

    draftlab export --params params.yaml --train runs/train --out models/draft
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from draftlab.params import Params, ParamsError
from draftlab.util import atomic_dir, write_json_atomic


@dataclass(frozen=True)
class ExportResult:
    out_dir: Path
    verifier_path: str


def check_against_target(draft_cfg: dict, target_cfg: dict, manifest: dict | None) -> None:
    """One clear line naming the field that differs between a draft and its target."""
    layer = draft_cfg.get("transformer_layer_config", {})
    checks = [
        ("hidden_size", layer.get("hidden_size"), target_cfg.get("hidden_size")),
        ("vocab_size", layer.get("vocab_size"), target_cfg.get("vocab_size")),
    ]
    if manifest is not None:
        checks.append(("eagle_aux_hidden_state_layer_ids", draft_cfg.get("eagle_aux_hidden_state_layer_ids"),
                       manifest["layer_ids"]))
    for name, got, want in checks:
        if got is not None and want is not None and got != want:
            raise ParamsError(f"draft config.json: {name} is {got} but the target has {want}; "
                              "this draft was trained for another target")


def serve_command(served_target: str, draft_dir: str, num_speculative_tokens: int) -> str:
    spec = json.dumps({"model": draft_dir, "method": "eagle3", "num_speculative_tokens": num_speculative_tokens})
    return f"vllm serve {served_target} --speculative-config '{spec}'"


def run(params: Params, *, target_dir: Path, train_dir: Path, store_dir: Path, out_dir: Path, tracker=None) -> ExportResult:
    import torch
    from safetensors.torch import load_file, save_file

    from draftlab import store
    from draftlab.console import console
    from draftlab.stages.target import resolve

    train = json.loads((Path(train_dir) / "train.json").read_text())
    checkpoint = Path(train["checkpoint"])
    cfg = json.loads((checkpoint / "config.json").read_text())
    verifier_local = resolve(params, target_dir)
    target_cfg = json.loads((Path(verifier_local) / "config.json").read_text()) if Path(verifier_local).is_dir() else {}
    manifest = store.read_manifest(store_dir)
    check_against_target(cfg, target_cfg, manifest)
    layer_ids = cfg.get("eagle_aux_hidden_state_layer_ids") or manifest["layer_ids"]
    if len(layer_ids) != 3:
        raise ParamsError(f"{checkpoint}/config.json: {len(layer_ids)} aux layer ids; vLLM's EAGLE-3 loader needs exactly 3")
    serving = params.export.verifier_path or (params.target.path if params.target.source == "hub" else None)
    if not serving:
        serving = str(Path(verifier_local).resolve())
    cfg["eagle_aux_hidden_state_layer_ids"] = list(layer_ids)
    cfg.setdefault("speculators_config", {}).setdefault("verifier", {})["name_or_path"] = serving
    cfg["torch_dtype"] = "bfloat16"
    if "transformer_layer_config" in cfg:
        cfg["transformer_layer_config"]["torch_dtype"] = "bfloat16"

    weights = {k: (v.to(torch.bfloat16) if v.is_floating_point() else v)
               for k, v in load_file(checkpoint / "model.safetensors").items()}
    k = params.train.ttt_steps
    with atomic_dir(out_dir) as tmp:
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        save_file(weights, tmp / "model.safetensors", metadata={"format": "pt"})
        (tmp / "README.md").write_text(
            "# EAGLE-3 draft exported by draftlab\n\n"
            f"Trained in MLflow run `{train['run_id']}` from `{checkpoint}`; auxiliary layers {list(layer_ids)}.\n\n"
            "Serve it next to its target with vLLM:\n\n"
            f"```bash\n{serve_command(serving, str(out_dir.resolve()), k)}\n```\n\n"
            "`num_speculative_tokens` equals the draft's training unroll (`train.ttt_steps`).\n"
        )
        write_json_atomic(tmp / "export.json", {"run_id": train["run_id"], "checkpoint": str(checkpoint),
                                                "verifier_path": serving, "layer_ids": list(layer_ids),
                                                "num_speculative_tokens": k, "dtype": "bfloat16"})
    if tracker is not None:
        tracker.log_artifact(out_dir / "config.json", "export")
        tracker.log_artifact(out_dir / "README.md", "export")
        tracker.set_tags({"draftlab.export": str(out_dir), "draftlab.export.verifier_path": serving})
    console.print(f"[bold]export[/]: {out_dir} (verifier → {serving}); serve: {serve_command(serving, str(out_dir), k)}")
    return ExportResult(out_dir, serving)
