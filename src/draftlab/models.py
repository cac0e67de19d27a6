"""The models every stage loads, below the stages: where the target loads from (`resolve`), its
tokenizer and weights (`load_target`), the trained draft (`load_draft`), and the forward hooks
that capture the target's hidden states (`LayerCapture`).

Aux layer id k is the input of decoder layer k (vLLM's EAGLE-3 convention: the residual stream
after k layers); the 4th captured slot is the final layer's output *before* the final norm (HF's
last `output_hidden_states` entry is after it). Both are captured with forward pre-hooks, so no
other layer's states are kept in memory.
"""

from __future__ import annotations

from pathlib import Path

from draftlab.errors import MissingInput
from draftlab.params import Params, ParamsError


def resolve(params: Params, target_dir: Path) -> str:
    """Where the target loads from: the built tiny folder, a local folder, or a hub id."""
    t = params.target
    if t.source == "tiny":
        if not (Path(target_dir) / "config.json").exists():
            raise MissingInput(f"{target_dir}: the tiny target is not built; run `dvc repro target`")
        return str(target_dir)
    return str(Path(t.path).expanduser()) if t.source == "local" else t.path


def load_tokenizer(params: Params, target_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolve(params, target_dir), trust_remote_code=params.target.trust_remote_code)


def load_target(params: Params, target_dir: Path, *, device: str = "cpu", device_map: str | None = None):
    """The one loading path for every target: a local folder or a hub id. `device_map="auto"`
    spreads a target too large for one GPU over all visible ones (instead of `device`)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t = params.target
    where = resolve(params, target_dir)
    tokenizer = AutoTokenizer.from_pretrained(where, trust_remote_code=t.trust_remote_code)
    model = AutoModelForCausalLM.from_pretrained(
        where,
        dtype=getattr(torch, t.dtype),
        trust_remote_code=t.trust_remote_code,
        attn_implementation="sdpa",
        **({"device_map": device_map} if device_map else {}),
    )
    if not device_map:
        model = model.to(device)
    model.eval()
    return model, tokenizer


def load_draft(checkpoint_dir: Path | str, verifier_dir: Path | str, *, dtype: str = "float32"):
    """A speculators checkpoint on CPU, eval mode, sdpa attention, verifier = the local target."""
    import torch
    from speculators import SpeculatorModel, SpeculatorModelConfig

    if not (Path(checkpoint_dir) / "config.json").exists():
        raise MissingInput(f"{checkpoint_dir}: no config.json; pass a speculators checkpoint folder")
    config = SpeculatorModelConfig.from_pretrained(str(checkpoint_dir))
    config.transformer_layer_config._attn_implementation = "sdpa"  # not saved; flex has no CPU path
    config.speculators_config.verifier.name_or_path = str(verifier_dir)  # saved path may be elsewhere
    draft = SpeculatorModel.from_pretrained(str(checkpoint_dir), config=config, dtype=getattr(torch, dtype))
    return draft.eval()


class LayerCapture:
    """Forward pre-hooks that keep the residual stream entering the chosen layers and the
    final norm: hidden_BTH for each aux layer, then the pre-norm final layer."""

    def __init__(self, model, layer_ids: list[int]):
        inner = model.model
        self.layers = inner.layers
        if max(layer_ids) >= len(self.layers):
            raise ParamsError(
                f"extract.layer_ids: {layer_ids} out of range for a target with {len(self.layers)} layers"
            )
        self.captured: dict[str, object] = {}
        self.handles = [
            self.layers[k].register_forward_pre_hook(self._hook(f"aux{j}"), with_kwargs=True)
            for j, k in enumerate(layer_ids)
        ]
        self.handles.append(inner.norm.register_forward_pre_hook(self._hook("final"), with_kwargs=True))

    def _hook(self, name):
        def fn(module, args, kwargs):
            self.captured[name] = args[0] if args else kwargs["hidden_states"]

        return fn

    def stacked(self):
        """[B, T, 4, H] in capture order: aux0, aux1, aux2, final."""
        import torch

        first = self.captured["aux0"]  # with device_map the layers live on several GPUs
        return torch.stack([self.captured[k].to(first.device) for k in ("aux0", "aux1", "aux2", "final")], dim=2)

    def close(self):
        for h in self.handles:
            h.remove()
