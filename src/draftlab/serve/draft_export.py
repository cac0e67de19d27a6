"""A trained draft as a folder vLLM serves: what the `export` stage writes, and what evaluate's
vLLM benchmark serves (a scratch copy).

speculators checkpoints are already in vLLM's format (`config.json` with
`speculators_model_type`, `model.safetensors`); exporting makes them safe to ship: the verifier
path is rewritten for the serving host (`export.verifier_path`), exactly 3 auxiliary layer ids
(a 4th crashes vLLM's EAGLE-3 loader), bf16 weights, a shape check against the target, and a
README with the `vllm serve` command. It never writes a null verifier path (such a checkpoint
cannot be reloaded offline).
"""

from __future__ import annotations

import json
import shlex
import shutil
from dataclasses import dataclass
from pathlib import Path

from draftlab.errors import MissingInput
from draftlab.models import check_against_target, check_weights, resolve
from draftlab.params import Params, ParamsError
from draftlab.rundir import ExportRecord, RunDir, TrainRecord, export_record
from draftlab.util import atomic_dir

WEIGHTS = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"


@dataclass(frozen=True)
class Exported:
    out_dir: Path
    verifier_path: str
    serve_command: str


def serve_command(served_target: str, draft_dir: str, num_speculative_tokens: int, *, revision: str | None = None,
                  trust_remote_code: bool = False) -> str:
    """The README's `vllm serve` line; a hub target pinned by `target.revision` is served at that
    commit (weights, code and tokenizer)."""
    spec = json.dumps({"model": str(draft_dir), "method": "eagle3", "num_speculative_tokens": num_speculative_tokens})
    line = f"vllm serve {shlex.quote(str(served_target))} --speculative-config {shlex.quote(spec)}"
    if trust_remote_code:
        line += " --trust-remote-code"
    if revision:
        line += f" --revision {revision} --code-revision {revision} --tokenizer-revision {revision}"
    return line


def load_weights(checkpoint: Path) -> dict:
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


def read_checkpoint(train_dir: Path) -> tuple[TrainRecord, Path, dict]:
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


def serving_config(cfg: dict, *, layer_ids: list[int], serving: str, k: int, target_cfg: dict, source: str) -> dict:
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


def export_draft(params: Params, *, target_dir: Path, train_dir: Path, store_dir: Path, out_dir: Path) -> Exported:
    """Write the draft trained in `train_dir` into `out_dir` (atomically) as vLLM serves it."""
    import torch
    from safetensors.torch import save_file

    from draftlab.rundir import StoreDir

    out_dir = Path(out_dir)
    train, checkpoint, cfg = read_checkpoint(train_dir)
    source = f"{checkpoint}/config.json"
    verifier_local = resolve(params, target_dir)
    target_config = Path(verifier_local) / "config.json"
    target_cfg = json.loads(target_config.read_text()) if target_config.is_file() else {}
    # the record alone: serving needs nothing of the store package (online training read no store)
    manifest = StoreDir(store_dir).manifest.read() if params.train.source == "store" else None
    layer_ids = cfg.get("eagle_aux_hidden_state_layer_ids") or (manifest.layer_ids if manifest else [])
    if len(layer_ids) != 3:
        raise ParamsError(f"{source}: {len(layer_ids)} aux layer ids {list(layer_ids)}; vLLM's EAGLE-3 loader "
                          "needs exactly 3 (set extract.layer_ids to 3 ids and retrain)")
    check_against_target({**cfg, "eagle_aux_hidden_state_layer_ids": list(layer_ids)}, target_cfg, manifest,
                         source=source)
    serving = params.export.verifier_path or (params.target.path if params.target.source == "hub" else None)
    if not serving:
        serving = str(Path(verifier_local).resolve())
    k = params.train.ttt_steps
    cfg = serving_config(cfg, layer_ids=layer_ids, serving=serving, k=k, target_cfg=target_cfg, source=source)

    weights = load_weights(checkpoint)
    check_weights(weights, target_cfg, manifest, source=str(checkpoint))
    weights = {name: (t.to(torch.bfloat16) if t.is_floating_point() else t).contiguous() for name, t in weights.items()}
    pinned = params.target.revision if params.target.source == "hub" and serving == params.target.path else None
    command = serve_command(serving, str(out_dir), k, revision=pinned, trust_remote_code=params.target.trust_remote_code)
    with atomic_dir(out_dir, record="export.json") as tmp:  # the record marks an older draftlab's folder
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
    return Exported(out_dir, serving, command)
