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
import shlex
import shutil
from dataclasses import dataclass
from pathlib import Path

from draftlab.errors import MissingInput
from draftlab.params import Params, ParamsError
from draftlab.rundir import ExportRecord, Manifest, RunDir, TrainRecord, export_record
from draftlab.util import atomic_dir

WEIGHTS = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"


@dataclass(frozen=True)
class ExportResult:
    out_dir: Path
    verifier_path: str


def target_facts(target_cfg: dict, manifest: Manifest | None) -> dict:
    """hidden_size, vocab_size, num_layers of the target: its config.json (or its `text_config`,
    as in multimodal targets such as Kimi-K2.5), else what the store's manifest recorded."""
    text = target_cfg.get("text_config") or {}
    recorded = manifest.target.model_dump() if manifest is not None else {}
    facts = {}
    for name, cfg_key, manifest_key in (("hidden_size", "hidden_size", "hidden_size"),
                                        ("vocab_size", "vocab_size", "vocab_size"),
                                        ("num_layers", "num_hidden_layers", "num_layers")):
        value = target_cfg.get(cfg_key, text.get(cfg_key))
        facts[name] = value if value is not None else recorded.get(manifest_key)
    return facts


def check_against_target(draft_cfg: dict, target_cfg: dict, manifest: Manifest | None, *,
                         source: str = "draft config.json") -> None:
    """One clear line naming the field that differs between a draft and its target."""
    layer = draft_cfg.get("transformer_layer_config") or {}
    want = target_facts(target_cfg, manifest)
    # a draft may have its own width; target_hidden_size is then the width of the states it reads
    draft_hidden = draft_cfg.get("target_hidden_size") or layer.get("hidden_size")
    for name, got in (("hidden_size", draft_hidden), ("vocab_size", layer.get("vocab_size"))):
        if got is not None and want[name] is not None and got != want[name]:
            raise ParamsError(f"{source}: {name} is {got} but the target has {want[name]}; this draft was "
                              "trained for another target (check --target and target.path)")
    ids = draft_cfg.get("eagle_aux_hidden_state_layer_ids")
    if ids is None:
        return
    if want["num_layers"] is not None and not all(0 <= i < want["num_layers"] for i in ids):
        raise ParamsError(f"{source}: eagle_aux_hidden_state_layer_ids {ids} out of range for a target with "
                          f"{want['num_layers']} layers; this draft was trained for another target")
    if manifest is not None and list(ids) != manifest.layer_ids:
        raise ParamsError(f"{source}: eagle_aux_hidden_state_layer_ids is {list(ids)} but the hidden-state store "
                          f"has {manifest.layer_ids}; export the draft trained on this store")


def check_weights(weights: dict, target_cfg: dict, manifest: Manifest | None, *, source: str) -> None:
    """The tensors themselves against the target: a config can be edited, a shape cannot lie."""
    want = target_facts(target_cfg, manifest)
    checks = []
    if "fc.weight" in weights and want["hidden_size"] is not None:
        checks.append(("fc.weight input features (3 aux layers × hidden_size)",
                       weights["fc.weight"].shape[-1], 3 * want["hidden_size"]))
    if "t2d" in weights and want["vocab_size"] is not None:
        checks.append(("t2d length (vocab_size)", weights["t2d"].shape[0], want["vocab_size"]))
    for name, got, expected in checks:
        if got != expected:
            raise ParamsError(f"{source}: {name} is {got} but the target needs {expected}; "
                              "this draft was trained for another target")


def serve_command(served_target: str, draft_dir: str, num_speculative_tokens: int) -> str:
    spec = json.dumps({"model": str(draft_dir), "method": "eagle3", "num_speculative_tokens": num_speculative_tokens})
    return f"vllm serve {shlex.quote(str(served_target))} --speculative-config {shlex.quote(spec)}"


def _load_weights(checkpoint: Path) -> dict:
    """All tensors of a checkpoint, single-file or sharded (save_pretrained above its shard size)."""
    from safetensors.torch import load_file

    if (checkpoint / WEIGHTS).exists():
        return dict(load_file(checkpoint / WEIGHTS))
    if (checkpoint / WEIGHTS_INDEX).exists():
        shards = sorted(set(json.loads((checkpoint / WEIGHTS_INDEX).read_text())["weight_map"].values()))
        weights = {}
        for shard in shards:
            weights.update(load_file(checkpoint / shard))
        return weights
    raise MissingInput(f"{checkpoint}: no {WEIGHTS} (nor {WEIGHTS_INDEX}); is this a speculators checkpoint?")


def _read_checkpoint(train_dir: Path) -> tuple[TrainRecord, Path, dict]:
    record = RunDir(train_dir).train
    train = record.read()
    pointer = record.path
    if train.calibration:
        raise ParamsError(f"{pointer}: MLflow run {train.run_id} is a step-limited calibration "
                          f"({train.total_steps} steps, train.max_steps set), not a trained draft; set "
                          "train.max_steps: null and train")
    checkpoint = Path(train.checkpoint)
    if not (checkpoint / "config.json").exists():
        raise MissingInput(f"{checkpoint}/config.json: the checkpoint named by {pointer} is missing")
    return train, checkpoint, json.loads((checkpoint / "config.json").read_text())


def _serving_config(cfg: dict, *, layer_ids: list[int], serving: str, k: int, target_cfg: dict, source: str) -> dict:
    """The checkpoint's config with what vLLM's speculators loader reads made right for serving."""
    spec = cfg.get("speculators_config")
    if not isinstance(spec, dict) or not spec.get("proposal_methods") or not isinstance(
            cfg.get("transformer_layer_config"), dict):
        raise ParamsError(f"{source}: not a speculators config (needs speculators_config.proposal_methods and "
                          "transformer_layer_config); export a checkpoint written by `draftlab train`")
    cfg["eagle_aux_hidden_state_layer_ids"] = list(layer_ids)
    verifier = spec.get("verifier") or {}  # a null verifier would keep the checkpoint from reloading
    verifier["name_or_path"] = serving
    if not verifier.get("architectures") and target_cfg.get("architectures"):
        verifier["architectures"] = target_cfg["architectures"]
    spec["verifier"] = verifier
    # what `vllm serve <draft>` uses when the command line does not say (README: the same k)
    spec["proposal_methods"][0]["speculative_tokens"] = k
    # transformers 5 reads `dtype`; a stale `torch_dtype` is only a fallback it never reaches
    for section in (cfg, cfg["transformer_layer_config"]):
        section["dtype"] = "bfloat16"
        section.pop("torch_dtype", None)
    return cfg


def run(params: Params, *, target_dir: Path, train_dir: Path, store_dir: Path, out_dir: Path, tracker=None) -> ExportResult:
    import torch
    from safetensors.torch import save_file

    from draftlab import store
    from draftlab.console import console
    from draftlab.models import resolve

    out_dir = Path(out_dir)
    train, checkpoint, cfg = _read_checkpoint(train_dir)
    source = f"{checkpoint}/config.json"
    verifier_local = resolve(params, target_dir)
    target_config = Path(verifier_local) / "config.json"
    target_cfg = json.loads(target_config.read_text()) if target_config.is_file() else {}
    manifest = store.read_manifest(store_dir)
    layer_ids = cfg.get("eagle_aux_hidden_state_layer_ids") or manifest.layer_ids
    if len(layer_ids) != 3:
        raise ParamsError(f"{source}: {len(layer_ids)} aux layer ids {list(layer_ids)}; vLLM's EAGLE-3 loader "
                          "needs exactly 3 (set extract.layer_ids to 3 ids and retrain)")
    check_against_target({**cfg, "eagle_aux_hidden_state_layer_ids": list(layer_ids)}, target_cfg, manifest,
                         source=source)
    serving = params.export.verifier_path or (params.target.path if params.target.source == "hub" else None)
    if not serving:
        serving = str(Path(verifier_local).resolve())
    k = params.train.ttt_steps
    cfg = _serving_config(cfg, layer_ids=layer_ids, serving=serving, k=k, target_cfg=target_cfg, source=source)

    weights = _load_weights(checkpoint)
    check_weights(weights, target_cfg, manifest, source=str(checkpoint))
    weights = {name: (t.to(torch.bfloat16) if t.is_floating_point() else t).contiguous() for name, t in weights.items()}
    command = serve_command(serving, str(out_dir), k)
    with atomic_dir(out_dir) as tmp:
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        save_file(weights, tmp / WEIGHTS, metadata={"format": "pt"})
        if (checkpoint / "config.py").exists():  # `auto_map` in config.json names it
            shutil.copy2(checkpoint / "config.py", tmp / "config.py")
        (tmp / "README.md").write_text(
            "# EAGLE-3 draft exported by draftlab\n\n"
            f"Trained in MLflow run `{train.run_id}` from `{checkpoint}`; auxiliary layers {list(layer_ids)}; "
            "bf16 weights.\n\n"
            "Serve it next to its target with vLLM (on another host, put the draft's path there in `model`):\n\n"
            f"```bash\n{command}\n```\n\n"
            "`num_speculative_tokens` equals the draft's training unroll (`train.ttt_steps`). The verifier path in "
            f"config.json is `{serving}` (`export.verifier_path`); to load the draft where that path does not exist, "
            "override `speculators_config.verifier.name_or_path` with the local target.\n"
        )
        export_record(tmp).write(ExportRecord(run_id=train.run_id, checkpoint=str(checkpoint), verifier_path=serving,
                                              layer_ids=list(layer_ids), num_speculative_tokens=k, dtype="bfloat16",
                                              serve_command=command))
    if tracker is not None:
        tracker.log_artifact(out_dir / "config.json", "export")
        tracker.log_artifact(out_dir / "README.md", "export")
        tracker.set_tags({"draftlab.export": str(out_dir), "draftlab.export.verifier_path": serving})
    console.print(f"[bold]export[/]: {out_dir} (verifier → {serving}); serve: {command}", soft_wrap=True)
    return ExportResult(out_dir, serving)
