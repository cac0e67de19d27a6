"""export: the exported draft reloads offline and predicts what the checkpoint predicted, ships
what vLLM's EAGLE-3 loader needs (3 aux layer ids, bf16, a verifier path for the serving host,
the `vllm serve` command), and a draft that does not fit its target fails with one line.

Fixtures: a random tiny target built by the target stage and an untrained 1-layer draft built
with speculators' own config path, saved as a fake `checkpoints/0` next to a fake `train.json`
and a minimal store manifest."""

import json
import random
import shlex

import pytest
import torch

from draftlab.models import check_against_target
from draftlab.params import ParamsError
from draftlab.rundir import Manifest, RunDir, StoreDir, TargetInfo, TrainRecord
from draftlab.stages import export
from tests.conftest import tiny_params

LAYER_IDS = [2, 4, 5]  # the tiny target's default aux layers (8 layers)
SERVED_TARGET = "example-org/served-target"  # a hub id that does not exist here


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def params():
    return tiny_params(target={"tiny": {"hidden_size": 32, "intermediate_size": 64}})


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory, params):
    from draftlab.stages.target import build_model, build_tokenizer

    out = tmp_path_factory.mktemp("export") / "target"
    tokenizer = build_tokenizer()
    build_model(params.target.tiny, tokenizer).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def draft(target_dir):
    """An untrained draft with non-trivial norms and a draft vocabulary ≠ the target's."""
    from speculators.models.eagle3 import Eagle3DraftModel
    from speculators.train.cli import create_transformer_layer_config

    torch.manual_seed(0)
    layer_config = create_transformer_layer_config(
        str(target_dir), num_layers=1, draft_arch="llama", hidden_act=None,
        sliding_window=None, full_attention_indices=[0])  # fmt: skip
    vocab = layer_config.vocab_size
    kept = torch.tensor(sorted(random.Random(0).sample(range(vocab), 48)))
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[kept] = True
    model = Eagle3DraftModel.from_training_args(
        verifier_config=layer_config, t2d=t2d, d2t=kept - torch.arange(len(kept)), draft_vocab_size=len(kept),
        norm_before_residual=True, norm_before_fc=True, norm_output=True, ttt_steps=3,
        verifier_name_or_path=str(target_dir), target_layer_ids=LAYER_IDS, draft_attn_impl="sdpa")  # fmt: skip
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.mul_(1 + 0.5 * torch.randn(param.shape))
    return model.eval()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, draft):
    """The draft as the trainer leaves it: `checkpoints/0` with config.json + model.safetensors."""
    path = tmp_path_factory.mktemp("run") / "checkpoints" / "0"
    draft.save_pretrained(path)
    return path


def _manifest(layer_ids=LAYER_IDS, **target) -> Manifest:
    """A store's manifest as extract writes it, holding no files (export reads its target and layers)."""
    return Manifest(key="k", target=TargetInfo(**{"source": "tiny", "hidden_size": 32, "num_layers": 8, **target}),
                    layer_ids=layer_ids, num_files=0, num_tokens=0, total_bytes=0, files=[])


def _layout(tmp_path, checkpoint, *, edit_config=None, layer_ids=LAYER_IDS):
    """(train_dir, store_dir) pointing at `checkpoint`, or at a copy whose config.json is edited."""
    import shutil

    if edit_config is not None:
        copy = tmp_path / "checkpoints" / "0"
        shutil.copytree(checkpoint, copy)
        cfg = json.loads((copy / "config.json").read_text())
        edit_config(cfg)
        (copy / "config.json").write_text(json.dumps(cfg))
        checkpoint = copy
    train_dir, store_dir = tmp_path / "train", tmp_path / "store"
    train_dir.mkdir()
    store_dir.mkdir()
    RunDir(train_dir).train.write(TrainRecord(run_id="x", checkpoint=str(checkpoint), total_steps=1, world_size=1,
                                              wall_clock_s=1.0, tokens_per_s=1.0, accounting="verified",
                                              bottleneck="unknown"))
    StoreDir(store_dir).manifest.write(_manifest(layer_ids))
    return train_dir, store_dir


def _reload(out_dir, verifier_dir):
    """The export loaded offline, verifier pointed at the local target (the served path is elsewhere)."""
    from speculators import SpeculatorModel, SpeculatorModelConfig

    config = SpeculatorModelConfig.from_pretrained(str(out_dir))
    config.transformer_layer_config._attn_implementation = "sdpa"  # not saved
    config.speculators_config.verifier.name_or_path = str(verifier_dir)
    return SpeculatorModel.from_pretrained(str(out_dir), config=config, dtype=torch.float32).eval()


def _predictions(draft):
    """Step-0 logits of 12 entries, then a greedy 3-token chain, as speculative decoding drafts."""
    from draftlab.serve.specdec import Eagle3Proposer

    g = torch.Generator().manual_seed(1)
    aux_T3H = torch.randn(12, 3 * 32, generator=g)
    ids = torch.randint(0, draft.verifier_vocab_size, (12,), generator=g).tolist()
    return Eagle3Proposer(draft, use_cache=False).propose(ids, aux_T3H, 3)


@pytest.fixture(scope="module")
def exported(tmp_path_factory, params, target_dir, checkpoint):
    tmp = tmp_path_factory.mktemp("exported")
    train_dir, store_dir = _layout(tmp, checkpoint)
    p = params.model_copy(update={"export": params.export.model_copy(update={"verifier_path": SERVED_TARGET})})
    out = tmp / "draft"
    result = export.run(p, target_dir=target_dir, train_dir=train_dir, store_dir=store_dir, out_dir=out)
    return result, out


def test_export_reloads_offline_and_predicts_what_the_checkpoint_predicted(exported, draft, target_dir):
    import copy

    _, out = exported
    reloaded = _reload(out, target_dir)
    reference = copy.deepcopy(draft)
    with torch.no_grad():  # the export casts to bf16: the reference is the same rounding of the checkpoint
        for param in reference.parameters():
            param.copy_(param.to(torch.bfloat16).float())
    got, want = _predictions(reloaded), _predictions(reference)
    torch.testing.assert_close(got.step0_logits_TV, want.step0_logits_TV)
    torch.testing.assert_close(got.logits_KV, want.logits_KV)
    assert got.token_ids == want.token_ids
    # and against the fp32 checkpoint itself: bf16 rounding only moves the logits a little
    torch.testing.assert_close(got.step0_logits_TV, _predictions(draft).step0_logits_TV, atol=0.05, rtol=0.05)


def test_export_is_what_vllm_loads(exported, params):
    from safetensors.torch import load_file

    result, out = exported
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["eagle_aux_hidden_state_layer_ids"] == LAYER_IDS
    assert cfg["speculators_config"]["verifier"]["name_or_path"] == SERVED_TARGET == result.verifier_path
    assert cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == params.train.ttt_steps
    # transformers 5 reads `dtype` (a `torch_dtype` beside a stale `dtype` is ignored)
    assert cfg["dtype"] == "bfloat16" and "torch_dtype" not in cfg
    weights = load_file(out / "model.safetensors")
    floats = {name: t.dtype for name, t in weights.items() if t.is_floating_point()}
    assert floats and set(floats.values()) == {torch.bfloat16}
    assert weights["t2d"].dtype == torch.bool and weights["d2t"].dtype == torch.int64


def test_readme_has_the_vllm_serve_command(exported, params):
    _, out = exported
    readme = (out / "README.md").read_text()
    line = next(line for line in readme.splitlines() if line.startswith("vllm serve "))
    argv = shlex.split(line)
    assert argv[:3] == ["vllm", "serve", SERVED_TARGET]
    spec = json.loads(argv[argv.index("--speculative-config") + 1])
    assert spec == {"model": str(out), "method": "eagle3", "num_speculative_tokens": params.train.ttt_steps}


def test_null_verifier_path_is_never_exported(tmp_path, params, target_dir, checkpoint):
    """A checkpoint saved with a null verifier path exports with this host's target path, and
    reloads offline as it is."""
    from speculators import SpeculatorModel

    def null_verifier(cfg):
        cfg["speculators_config"]["verifier"]["name_or_path"] = None

    train_dir, store_dir = _layout(tmp_path, checkpoint, edit_config=null_verifier)
    out = tmp_path / "draft"
    result = export.run(params, target_dir=target_dir, train_dir=train_dir, store_dir=store_dir, out_dir=out)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["speculators_config"]["verifier"]["name_or_path"] == str(target_dir.resolve()) == result.verifier_path
    SpeculatorModel.from_pretrained(str(out))  # no override needed


def _edited_target(tmp_path, target_dir, edit):
    """A target whose config.json differs (export reads only the config)."""
    fake = tmp_path / "other-target"
    fake.mkdir()
    cfg = json.loads((target_dir / "config.json").read_text())
    (fake / "config.json").write_text(json.dumps(edit(cfg)))
    return fake


@pytest.mark.parametrize("case, field", [
    ("hidden", "hidden_size"),
    ("vocab", "vocab_size"),
    ("multimodal", "hidden_size"),
    ("layers", "eagle_aux_hidden_state_layer_ids"),
    ("store", "eagle_aux_hidden_state_layer_ids"),
    ("four", "exactly 3"),
])  # fmt: skip
def test_mismatch_fails_with_one_line_naming_the_field(tmp_path, params, target_dir, checkpoint, case, field):
    target, layer_ids, edit = target_dir, LAYER_IDS, None
    if case == "hidden":
        target = _edited_target(tmp_path, target_dir, lambda cfg: {**cfg, "hidden_size": 64})
    elif case == "vocab":
        target = _edited_target(tmp_path, target_dir, lambda cfg: {**cfg, "vocab_size": 1000})
    elif case == "multimodal":  # the text model's sizes live under text_config (Kimi-K2.5)
        target = _edited_target(tmp_path, target_dir, lambda cfg: {
            "architectures": ["SomeVLForConditionalGeneration"], "text_config": {**cfg, "hidden_size": 64}})
    elif case == "layers":
        target = _edited_target(tmp_path, target_dir, lambda cfg: {**cfg, "num_hidden_layers": 5})
    elif case == "store":
        layer_ids = [2, 4, 6]
    else:
        def edit(cfg):
            cfg["eagle_aux_hidden_state_layer_ids"] = [1, 2, 4, 5]

    train_dir, store_dir = _layout(tmp_path, checkpoint, edit_config=edit, layer_ids=layer_ids)
    out = tmp_path / "draft"
    out.mkdir()
    (out / "keep.txt").write_text("an earlier export")
    with pytest.raises(ParamsError) as err:
        export.run(tiny_params(target={"tiny": {"hidden_size": 32, "intermediate_size": 64}}),
                   target_dir=target, train_dir=train_dir, store_dir=store_dir, out_dir=out)
    message = str(err.value)
    assert "\n" not in message and field in message
    assert (out / "keep.txt").read_text() == "an earlier export"  # a failed export deletes nothing


def test_store_manifest_stands_in_for_an_absent_target_config():
    """A hub target not present on this host: the manifest's recorded sizes are checked."""
    draft_cfg = {"transformer_layer_config": {"hidden_size": 32, "vocab_size": 303},
                 "eagle_aux_hidden_state_layer_ids": LAYER_IDS}
    check_against_target(draft_cfg, {}, _manifest(vocab_size=303))
    with pytest.raises(ParamsError, match="vocab_size is 303 but the target has 512"):
        check_against_target(draft_cfg, {}, _manifest(vocab_size=512))
