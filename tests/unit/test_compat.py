"""draftlab.training.compat: the pin, and the speculators symbols its patches rely on.

These fail loudly when a speculators upgrade moves what the patches replace; the
end-to-end proof is tests/integration/test_compat_torchrun.py.
"""

from __future__ import annotations

import importlib.metadata
import inspect
import re
import socket
from pathlib import Path

import pytest

from draftlab import pinned
from draftlab.plan import sampler
from draftlab.training import compat


@pytest.fixture
def restore_speculators(monkeypatch):
    """Undo compat's patches after the test (they are process-wide by design)."""
    from speculators.train import checkpointer, cli, trainer

    for module, name in [
        (cli, "maybe_setup_distributed"),
        (cli, "Trainer"),
        (cli, "setup_metric_logger"),
        (trainer, "_StepTimer"),
        (checkpointer, "get_current_device"),
    ]:
        monkeypatch.setattr(module, name, getattr(module, name))
    monkeypatch.setattr(compat, "_patched_device_type", None)


def test_installed_speculators_is_the_pinned_version():
    assert importlib.metadata.version("speculators") == pinned.SPECULATORS_VERSION == "0.9.0"


def test_a_different_speculators_version_fails_loudly(monkeypatch):
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.10.0")
    with pytest.raises(RuntimeError, match="written for speculators 0.9.0, but 0.10.0"):
        compat.check_speculators_version()


def test_cli_main_looks_up_the_patched_names_at_call_time():
    from speculators.train import cli

    source = inspect.getsource(cli.main)
    for call in ("setup_metric_logger(", "maybe_setup_distributed()", "Trainer(draft_model"):
        assert call in source
    assert inspect.signature(cli.setup_metric_logger).parameters.keys() == {
        "loggers", "run_name", "output_dir",
    }  # fmt: skip


def test_stock_distributed_setup_still_binds_an_accelerator():
    from speculators.train import distributed

    source = inspect.getsource(distributed.maybe_setup_distributed)
    assert "torch.accelerator.set_device_index(local_rank)" in source
    assert "device_id=local_rank" in source
    assert list(inspect.signature(distributed._init_sp_process_groups).parameters) == [
        "rank", "world_size", "sp_size",
    ]  # fmt: skip
    for state in ("_local_rank", "_rank", "_world_size", "_is_distributed", "_dp_size", "_sp_size"):
        assert hasattr(distributed, state), state


def test_trainer_uses_local_rank_only_as_a_device_and_sets_it_before_setup_model():
    from speculators.train.trainer import Trainer

    init = inspect.getsource(Trainer.__init__)
    assert init.index("self.local_rank = get_local_rank()") < init.index("self.setup_model()")
    assert init.index("self.device_type =") < init.index("self.setup_model()")
    source = inspect.getsource(Trainer)
    # Each use: the assignment in __init__, or the argument of a `.to(` (model, batches).
    uses = re.findall(r"(\S*)self\.local_rank\b(.{0,3})", source)
    assert len(uses) == 5 and all(
        (before, after) == ("", " = ") or before.endswith(".to(") for before, after in uses
    ), uses
    assert "torch.autocast(\n                self.device_type" in source


def test_step_timer_and_checkpointer_still_need_an_accelerator():
    from speculators.train import checkpointer, trainer

    timer = inspect.getsource(trainer._StepTimer)
    assert timer.count("torch.accelerator.synchronize()") == 2
    assert {"mark", "now", "profile", "reset", "mark_value"} <= set(vars(trainer._StepTimer))
    assert inspect.getsource(checkpointer).count("device = get_current_device()") == 2


def test_cpu_patch_replaces_each_name_once(restore_speculators):
    from speculators.train import checkpointer, cli, trainer

    stock_trainer = cli.Trainer
    compat.patch_speculators_for_device("cpu")
    patched = (cli.maybe_setup_distributed, cli.Trainer, trainer._StepTimer)
    assert issubclass(cli.Trainer, stock_trainer) and cli.Trainer is not stock_trainer
    assert checkpointer.get_current_device() == "cpu"
    compat.patch_speculators_for_device("cpu")  # idempotent
    assert (cli.maybe_setup_distributed, cli.Trainer, trainer._StepTimer) == patched
    with pytest.raises(RuntimeError, match="already patched for 'cpu'"):
        compat.patch_speculators_for_device("cuda")


def test_cuda_patches_nothing(restore_speculators):
    from speculators.train import cli, trainer

    before = (cli.maybe_setup_distributed, cli.Trainer, trainer._StepTimer)
    compat.patch_speculators_for_device("cuda")
    assert (cli.maybe_setup_distributed, cli.Trainer, trainer._StepTimer) == before


def test_unknown_device_type_is_refused():
    with pytest.raises(ValueError, match="device_type must be one of"):
        compat.patch_speculators_for_device("tpu")


def test_host_step_timer_profiles_without_an_accelerator(restore_speculators):
    from speculators.train import trainer

    compat.patch_speculators_for_device("cpu")
    timer = trainer._StepTimer(enabled=True)
    timer.mark_value("start", timer.now() - 0.01)
    for name in ("queue", "pre_h2d", "fetch", "fwd", "pre_clip", "bwd", "opt"):
        timer.mark(name)
    profile = timer.profile(num_tokens=100)
    assert profile["step_ms"] >= 10 and profile["tokens_per_s"] > 0
    assert "memory_mb" not in profile


def test_host_distributed_setup_initialises_gloo(restore_speculators, monkeypatch):
    import torch.distributed as dist
    from speculators.train import distributed

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for key, value in {
        "LOCAL_RANK": "0", "RANK": "0", "WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
    }.items():  # fmt: skip
        monkeypatch.setenv(key, value)
    compat._maybe_setup_distributed_on_host()
    try:
        assert dist.get_backend() == "gloo"
        assert distributed.is_distributed() and distributed.get_world_size() == 1
        assert distributed.get_dp_size() == 1 and distributed.get_dp_group() is not None
    finally:
        distributed.maybe_destroy_distributed()
    assert not dist.is_initialized()


def test_cpu_run_needs_sdpa_attention_and_eager_loss():
    from speculators.train.config import TrainConfig

    base = ["--verifier-name-or-path", "v"]
    ok = TrainConfig.resolve([*base, "--draft-attn-impl", "sdpa", "--loss-implementation", "eager"])
    compat.check_config_for_device(ok, "cpu")
    flex = TrainConfig.resolve([*base, "--loss-implementation", "eager"])
    with pytest.raises(ValueError, match="--draft-attn-impl sdpa"):
        compat.check_config_for_device(flex, "cpu")
    fused = TrainConfig.resolve([*base, "--draft-attn-impl", "sdpa"])
    with pytest.raises(ValueError, match="--loss-implementation eager"):
        compat.check_config_for_device(fused, "cpu")
    compat.check_config_for_device(fused, "cuda")


def test_run_trainer_feeds_extra_handlers_and_fails_when_interrupted(
    restore_speculators, monkeypatch, tmp_path
):
    """cli.main stubbed: it configures the metric logger, logs, and saves as on SIGTERM."""
    import logging

    from speculators.train import cli

    def fake_main(cfg):
        cli.setup_metric_logger(loggers="", run_name=None, output_dir=str(tmp_path / "logs"))
        logging.getLogger("speculators.metrics").info({"train": {"loss": 2.5}}, extra={"step": 3})
        interrupted = tmp_path / "ckpt" / "interrupted"
        interrupted.mkdir(parents=True)
        (interrupted / "model.safetensors").write_bytes(b"")

    received = []

    class Recorder(logging.Handler):
        def emit(self, record):
            received.append((record.step, record.msg))

    monkeypatch.setattr(cli, "main", fake_main)
    stock_setup = cli.setup_metric_logger
    argv = ["--verifier-name-or-path", "v", "--save-path", str(tmp_path / "ckpt"),
            "--draft-attn-impl", "sdpa", "--loss-implementation", "eager"]  # fmt: skip
    recorder = Recorder()
    try:
        with pytest.raises(SystemExit, match="interrupted by a signal"):
            compat.run_trainer(argv, device_type="cpu", metric_handlers=[recorder])
    finally:
        logging.getLogger("speculators.metrics").removeHandler(recorder)
    assert received == [(3, {"train": {"loss": 2.5}})]
    assert cli.setup_metric_logger is stock_setup


def test_explicit_scheduler_total_steps_overrides_max_steps():
    """draftlab passes --scheduler-total-steps; speculators would otherwise decay over max_steps."""
    from speculators.train.trainer import TrainerConfig, _resolve_scheduler_steps

    def total(**kw):
        cfg = TrainerConfig(lr=1e-3, num_epochs=2, save_path="unused", **kw)
        return _resolve_scheduler_steps(cfg, train_loader_len=10)[1]

    assert total(max_steps=5) == 5
    assert total(max_steps=5, scheduler_total_steps=9) == 9


def test_steps_under_max_steps_follows_the_trainer_loop():
    from draftlab.plan.sampler import steps_under_max_steps

    assert steps_under_max_steps([10, 10], None) == [10, 10]
    assert steps_under_max_steps([10, 10], 4) == [4, 1]
    assert steps_under_max_steps([10, 9, 8], 20) == [10, 9, 1]
    assert steps_under_max_steps([3, 3], 5) == [3, 2]


# ---------------------------------------------------------------- observers of the trainer's internals


@pytest.mark.parametrize("call", [
    lambda tmp: compat.record_sampler_batches(tmp / "rank0.jsonl"),
    lambda tmp: compat.metric_flattener(),
    lambda tmp: compat.before_checkpoint(lambda: None),
    lambda tmp: sampler.sampler_class(),
    lambda tmp: compat.around_checkpoint(lambda save, trainer, epoch: save()),
])  # fmt: skip
def test_every_observer_refuses_another_speculators_version(monkeypatch, tmp_path, call):
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.10.0")
    with pytest.raises(RuntimeError, match="written for speculators 0.9.0, but 0.10.0"):
        call(tmp_path)


def test_sampler_recording_sees_what_each_rank_is_given(monkeypatch, tmp_path):
    import json

    from speculators.train.distributed_batch_sampler import MultipackDistributedBatchSamplerV2 as Sampler

    assert "self._generate_batches(self.epoch)" in inspect.getsource(Sampler.__iter__)
    stock = Sampler.__init__, Sampler.__iter__
    monkeypatch.setattr(Sampler, "__init__", stock[0])  # restored after the test
    monkeypatch.setattr(Sampler, "__iter__", stock[1])
    lengths = [50 + (i * 37) % 300 for i in range(40)]
    given = {}
    for rank in (0, 1):  # each rank is a process of its own: the stock class, then the wrapper
        Sampler.__init__, Sampler.__iter__ = stock
        out = tmp_path / f"rank{rank}.jsonl"
        compat.record_sampler_batches(out)
        train = Sampler(batch_max_length=512, lengths=lengths, num_replicas=2, rank=rank, seed=3)
        Sampler(batch_max_length=512, lengths=lengths[:8], num_replicas=2, rank=rank, seed=3)  # the val loader's
        train.set_epoch(1)
        given[rank] = [int(i) for batch in train for i in batch]
        records = [json.loads(line) for line in out.read_text().splitlines()]
        assert [(r["epoch"], r["rank"], r["ids"]) for r in records] == [(1, rank, given[rank])]
    assert not set(given[0]) & set(given[1])


def test_metric_flattener_gives_speculators_metric_names():
    flat = compat.metric_flattener()({"train": {"loss": 2.5, "loss_0": 3.0}, "epoch": 1, "profile": {"step_ms": 9}})
    assert flat == {"train/loss": 2.5, "train/loss_0": 3.0, "epoch": 1, "profile/step_ms": 9}


def test_before_checkpoint_runs_ahead_of_each_checkpoint(monkeypatch):
    from speculators.train.trainer import Trainer

    assert "self.maybe_save_checkpoint(" in inspect.getsource(Trainer)
    calls = []
    monkeypatch.setattr(Trainer, "maybe_save_checkpoint", lambda self, *a, **k: calls.append("save"))
    compat.before_checkpoint(lambda: calls.append("hook"))
    Trainer.maybe_save_checkpoint(object())
    assert calls == ["hook", "save"]


def test_standalone_sampler_file_needs_nothing_from_speculators():
    import ast

    source = inspect.getsource(pinned._standalone("train.distributed_batch_sampler"))
    imported = {n.module or "" for n in ast.walk(ast.parse(source)) if isinstance(n, ast.ImportFrom)}
    imported |= {a.name for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Import) for a in n.names}
    assert not [m for m in imported if m.startswith("speculators")], imported


def test_the_launcher_loads_speculators_sampler_and_vocab_mapping_without_the_package():
    """pinned.speculators_module executes those two files alone (the package's __init__ costs
    the launcher seconds): they must import nothing of speculators, and give what the package
    gives."""
    import ast

    import torch
    from speculators.train import distributed_batch_sampler as sampler_mod
    from speculators.train import vocab_mapping

    for mod in (sampler_mod, vocab_mapping):
        tree = ast.parse(Path(mod.__file__).read_text())
        names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
        names += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
        assert not [m for m in names if m.startswith("speculators")], mod.__name__
    lengths = [17, 300, 90, 512, 40, 233, 128, 64, 700, 5] * 7

    def batches(cls):
        s = cls(batch_max_length=1024, lengths=lengths, num_replicas=2, rank=1, seed=3)
        s.set_epoch(2)
        return [[int(i) for i in b] for b in s]

    alone = pinned._standalone("train.distributed_batch_sampler").MultipackDistributedBatchSamplerV2
    assert alone is not sampler_mod.MultipackDistributedBatchSamplerV2
    assert batches(alone) == batches(sampler_mod.MultipackDistributedBatchSamplerV2) != []
    freq = {0: 5, 2: 9, 3: 1, 4: 7, 5: 3, 7: 2}
    a = pinned._standalone("train.vocab_mapping").build_vocab_mappings_from_distribution(freq, 4, 8)
    b = vocab_mapping.build_vocab_mappings_from_distribution(freq, 4, 8)
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_speculators_own_save_is_written_aside_and_renamed_whole(monkeypatch, tmp_path):
    """The real `Trainer.maybe_save_checkpoint` and checkpointer, through `around_checkpoint`:
    every file of the save (weights, optimizer, scheduler, training_state.json, the epoch link)
    lands under the root the checkpointer has when it runs, so draftlab's scratch root works."""
    import json
    from types import SimpleNamespace

    import torch
    from speculators.train.checkpointer import SingleGPUCheckpointer
    from speculators.train.trainer import Trainer
    from transformers import LlamaConfig, LlamaForCausalLM

    from draftlab.training import checkpoint as ck

    monkeypatch.setattr(Trainer, "maybe_save_checkpoint", Trainer.maybe_save_checkpoint)  # restored after
    compat.around_checkpoint(ck.atomic_save)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1))
    optimizer = torch.optim.AdamW(model.parameters())
    trainer = Trainer.__new__(Trainer)
    trainer.config = SimpleNamespace(save_best=False, checkpoint_freq=0.5)
    trainer.checkpointer = SingleGPUCheckpointer(tmp_path / "checkpoints")
    trainer.model, trainer.optimizers, trainer.schedulers = model, [optimizer], []
    trainer.is_distributed, trainer.global_step = False, 7
    trainer.maybe_save_checkpoint(0, local_step=3)
    root = tmp_path / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["0", "epoch0_step3"]
    assert ck.problem(root / "0") is None and json.loads((root / "0" / "training_state.json").read_text()) == \
        {"epoch": 0, "local_step": 3, "global_step": 7}
    assert {"model.safetensors", "optimizer_state_dict.pt", "config.json", ck.MARKER} <= \
        {p.name for p in (root / "0").iterdir()}
