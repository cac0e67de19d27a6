"""speculators' own trainer, patched by draftlab.training.compat, trains a tiny EAGLE-3 draft on CPU.

One rank in a plain process, then two gloo ranks under torchrun (DDP, and FSDP2 with
``--fsdp-shard``), each for 2 epochs on a 33-sample synthetic dataset. About a minute
on an idle 2-core machine:  pytest tests/integration/test_compat_torchrun.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO_SRC = Path(__file__).resolve().parents[2] / "src"
NUM_SAMPLES = 33  # odd, so two ranks cannot split it evenly
TOTAL_SEQ_LEN = 256
EPOCHS = 2
SEED = 0
AUX_LAYER_IDS = [2, 4, 5]  # speculators' default [2, L//2, L-3] for L = 8


@dataclass(frozen=True)
class Workspace:
    verifier: Path
    data: Path


def build_tiny_workspace(root: Path) -> Workspace:
    """A tiny Llama verifier and an offline dataset in speculators' format.

    Hidden states are the verifier's own: the aux layers, then the last layer
    before the final norm (vLLM's convention), bf16, ``hidden_states [T, 4, H]``.
    """
    import numpy as np
    import torch
    from datasets import Dataset
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(SEED)
    rng = np.random.default_rng(SEED)
    config = LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=512, max_position_embeddings=1024,
        tie_word_embeddings=False,
    )
    verifier = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        # Peaked targets: at init the verifier is near-uniform, leaving nothing to learn.
        verifier.lm_head.weight.mul_(20.0)
    verifier.save_pretrained(root / "verifier")

    pre_norm = {}
    verifier.model.norm.register_forward_hook(lambda m, args, out: pre_norm.update(h=args[0]))
    hidden_states_dir = root / "data" / "hidden_states"
    hidden_states_dir.mkdir(parents=True)
    rows: dict[str, list] = {"input_ids": [], "loss_mask": [], "seq_len": []}
    token_freq: dict[int, int] = {}
    for i in range(NUM_SAMPLES):
        num_tokens = int(rng.integers(20, 121))
        token_ids = torch.tensor(np.minimum(rng.zipf(1.3, num_tokens), 300) - 1)
        loss_mask = torch.zeros(num_tokens, dtype=torch.long)
        loss_mask[num_tokens // 4 :] = 1
        with torch.no_grad():
            out = verifier(token_ids[None], output_hidden_states=True)
        layers = [out.hidden_states[k][0] for k in AUX_LAYER_IDS] + [pre_norm["h"][0]]
        hidden_TLH = torch.stack(layers, dim=1).to(torch.bfloat16).contiguous()
        save_file(
            {"hidden_states": hidden_TLH, "token_ids": token_ids},
            hidden_states_dir / f"hs_{i}.safetensors",
        )
        rows["input_ids"].append(token_ids.tolist())
        rows["loss_mask"].append(loss_mask.tolist())
        rows["seq_len"].append(num_tokens)
        for t in token_ids[loss_mask.bool()].tolist():
            token_freq[t] = token_freq.get(t, 0) + 1
    dataset = Dataset.from_dict(rows)
    dataset.set_format(type="torch")
    dataset.save_to_disk(str(root / "data"))
    torch.save(token_freq, root / "data" / "token_freq.pt")
    return Workspace(verifier=root / "verifier", data=root / "data")


def train_argv(ws: Workspace, save_path: Path) -> list[str]:
    return [
        "--verifier-name-or-path", str(ws.verifier),
        "--data-path", str(ws.data),
        "--save-path", str(save_path),
        "--log-dir", str(save_path.parent / "logs"),
        "--epochs", str(EPOCHS),
        "--lr", "3e-3",
        "--optimizer", "adamw",
        "--total-seq-len", str(TOTAL_SEQ_LEN),
        "--num-workers", "0",
        "--draft-vocab-size", "256",
        "--mask-token-id", "0",  # otherwise resolved from a tokenizer the verifier lacks
        "--target-layer-ids", *map(str, AUX_LAYER_IDS),
        "--draft-attn-impl", "sdpa",
        "--loss-implementation", "eager",
        "--on-missing", "raise",
        "--seed", str(SEED),
    ]  # fmt: skip


def expected_steps_per_epoch(ws: Workspace, world_size: int) -> list[int]:
    """Global optimizer steps of each epoch, from the trainer's own sampler."""
    from datasets import load_from_disk
    from speculators.train.distributed_batch_sampler import MultipackDistributedBatchSamplerV2

    seq_len = list(load_from_disk(str(ws.data)).with_format(None)["seq_len"])
    train_lengths = seq_len[: int(len(seq_len) * 0.9)]  # default --train-data-ratio
    steps = []
    for epoch in range(EPOCHS):
        sampler = MultipackDistributedBatchSamplerV2(
            batch_max_length=TOTAL_SEQ_LEN, lengths=train_lengths,
            num_replicas=world_size, rank=0, seed=SEED,
        )  # fmt: skip
        sampler.set_epoch(epoch)
        steps.append(len(sampler))
    return steps


def run(cmd: list[str], cwd: Path) -> None:
    python_path = os.pathsep.join([str(REPO_SRC), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": python_path}
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    output = f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    assert proc.returncode == 0, f"{cmd[:6]}… exited {proc.returncode}\n{output}"


def assert_trained(save_path: Path, expected_steps: list[int]) -> None:
    for epoch in range(EPOCHS):
        config = json.loads((save_path / str(epoch) / "config.json").read_text())
        assert config["speculators_model_type"] == "eagle3"
        assert (save_path / str(epoch) / "model.safetensors").stat().st_size > 0
    state = json.loads((save_path / str(EPOCHS - 1) / "training_state.json").read_text())
    assert state == {"epoch": EPOCHS - 1, "local_step": 0, "global_step": sum(expected_steps)}
    # val_metrics.json is written only when validation loss improves on the best so far.
    val_losses = [
        json.loads((save_path / str(e) / "val_metrics.json").read_text())["loss_epoch"]
        for e in range(EPOCHS)
    ]
    assert val_losses[1] < val_losses[0]


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Workspace:
    return build_tiny_workspace(tmp_path_factory.mktemp("tiny"))


ONE_RANK_DRIVER = textwrap.dedent(
    """
    import json, logging, sys
    from draftlab.training.compat import run_trainer
    from speculators.train.logger import _flatten_dict

    out = open(sys.argv[1], "w")

    class JsonLines(logging.Handler):
        def emit(self, record):
            if not getattr(record, "hparams", False):
                out.write(json.dumps({"step": record.step, **_flatten_dict(record.msg)}) + "\\n")

    run_trainer(sys.argv[2:], metric_handlers=[JsonLines()])
    out.close()
    """
)


def test_one_rank_trains_with_extra_metric_handler(workspace, tmp_path):
    metrics_path = tmp_path / "metrics.jsonl"
    save_path = tmp_path / "checkpoints"
    argv = train_argv(workspace, save_path)
    run([sys.executable, "-c", ONE_RANK_DRIVER, str(metrics_path), *argv], tmp_path)

    expected = expected_steps_per_epoch(workspace, world_size=1)
    assert_trained(save_path, expected)
    records = [json.loads(line) for line in metrics_path.read_text().splitlines()]
    train = [r for r in records if "train/loss" in r]
    assert [r["step"] for r in train] == list(range(sum(expected)))
    expected_keys = {"profile/step_ms", "profile/tokens_per_s", "lr", "epoch", "train/full_acc_0"}
    assert expected_keys <= train[0].keys()
    losses = [r["train/loss"] for r in train]
    assert sum(losses[-3:]) < 0.7 * sum(losses[:3])
    assert [r["epoch"] for r in records if "val/loss_epoch" in r] == list(range(EPOCHS))


def test_max_steps_trains_one_more_step_per_later_epoch_as_pinned(workspace, tmp_path):
    """The quirk `draftlab.plan.sampler.steps_under_max_steps` pins: each epoch after the limit
    trains one step and validates. Fails when speculators changes it."""
    from draftlab.plan.sampler import steps_under_max_steps

    metrics_path = tmp_path / "metrics.jsonl"
    save_path = tmp_path / "checkpoints"
    expected = expected_steps_per_epoch(workspace, world_size=1)
    max_steps = 3
    assert expected[0] > max_steps, "the dataset must give the first epoch more steps than the limit"
    argv = train_argv(workspace, save_path) + ["--max-steps", str(max_steps)]
    run([sys.executable, "-c", ONE_RANK_DRIVER, str(metrics_path), *argv], tmp_path)

    records = [json.loads(line) for line in metrics_path.read_text().splitlines()]
    per_epoch = [sum(1 for r in records if "train/loss" in r and r["epoch"] == e) for e in range(EPOCHS)]
    assert per_epoch == steps_under_max_steps(expected, max_steps) == [max_steps] + [1] * (EPOCHS - 1)
    assert [r["epoch"] for r in records if "val/loss_epoch" in r] == list(range(EPOCHS))
    state = json.loads((save_path / str(EPOCHS - 1) / "training_state.json").read_text())
    assert state["global_step"] == max_steps + EPOCHS - 1


@pytest.mark.parametrize("sharding", ["ddp", "fsdp"])
def test_two_gloo_ranks_train_under_torchrun(workspace, tmp_path, sharding):
    save_path = tmp_path / "checkpoints"
    argv = train_argv(workspace, save_path) + (["--fsdp-shard"] if sharding == "fsdp" else [])
    # --standalone picks a free rendezvous port, so concurrent runs do not collide on 29500.
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    torchrun += ["--nproc-per-node", "2"]
    run([*torchrun, "-m", "draftlab.training.rank", *argv], tmp_path)

    expected_two = expected_steps_per_epoch(workspace, world_size=2)
    assert sum(expected_two) < sum(expected_steps_per_epoch(workspace, world_size=1))
    assert_trained(save_path, expected_two)
