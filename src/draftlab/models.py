"""The models every stage loads, below the stages: where the target loads from (`resolve`), its
tokenizer and weights (`load_target`), the trained draft (`load_draft`), the forward hooks that
capture the target's hidden states (`LayerCapture`), and the checks that a draft fits its target
(`check_against_target` on its config, `check_weights` on its tensors).

Aux layer id k is the input of decoder layer k (vLLM's EAGLE-3 convention: the residual stream
after k layers); the 4th captured slot is the final layer's output *before* the final norm (HF's
last `output_hidden_states` entry is after it). Both are captured with forward pre-hooks, so no
other layer's states are kept in memory.
"""

from __future__ import annotations

from pathlib import Path

from draftlab.errors import MissingInput
from draftlab.params import Params, ParamsError
from draftlab.rundir import Manifest


def resolve(params: Params, target_dir: Path) -> str:
    """Where the target loads from: the built tiny folder, a local folder, or a hub id. A hub
    target pinned by `target.revision` whose commit is in the hub cache resolves to that
    commit's snapshot folder, so whatever loads it (the trainer's verifier, vLLM) reads the
    pinned files even where it takes no revision."""
    t = params.target
    if t.source == "tiny":
        if not (Path(target_dir) / "config.json").exists():
            raise MissingInput(f"{target_dir}: the tiny target is not built; run `dvc repro target`")
        return str(target_dir)
    if t.source == "local":
        return str(Path(t.path).expanduser())
    check_pinned(params)
    if t.revision is not None:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import LocalEntryNotFoundError

        try:
            return snapshot_download(t.path, revision=t.revision, local_files_only=True)
        except (LocalEntryNotFoundError, OSError, ValueError):
            pass  # not cached yet: its first load fetches it, by revision (revision_kwargs)
    return t.path


def check_pinned(params: Params) -> None:
    """A hub target's remote code runs only at a commit the user named. Checked before every
    load (not at params load: `draftlab plan` and `use` read a profile that loads nothing)."""
    t = params.target
    if t.source == "hub" and t.trust_remote_code and t.revision is None:
        raise ParamsError("target.trust_remote_code: runs the hub's code for target.path at every load, and "
                          "without target.revision that is whatever the hub holds that day; set target.revision "
                          "to the commit hash you reviewed")


def revision_kwargs(params: Params) -> dict:
    """What every `from_pretrained` of the target passes: trust_remote_code and, for a hub
    target, the pinned revision (code, config, tokenizer and weights at one commit)."""
    check_pinned(params)
    t = params.target
    pinned = {"revision": t.revision} if t.source == "hub" and t.revision else {}
    return {"trust_remote_code": t.trust_remote_code, **pinned}


def load_tokenizer(params: Params, target_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolve(params, target_dir), **revision_kwargs(params))


def load_target(params: Params, target_dir: Path, *, device: str = "cpu", device_map: str | None = None):
    """The one loading path for every target: a local folder or a hub id. `device_map="auto"`
    spreads a target too large for one GPU over all visible ones (instead of `device`)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t = params.target
    where = resolve(params, target_dir)
    tokenizer = AutoTokenizer.from_pretrained(where, **revision_kwargs(params))
    model = AutoModelForCausalLM.from_pretrained(
        where,
        dtype=getattr(torch, t.dtype),
        **revision_kwargs(params),
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
