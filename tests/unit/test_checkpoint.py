"""draftlab.training.checkpoint: a checkpoint is visible only complete, a save that would not fit
is refused before it writes, and resume and export take the newest complete checkpoint."""

import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file

from draftlab.training import checkpoint as ck


class _Console:
    def __init__(self):
        self.lines = []

    def print(self, line, **_):
        self.lines.append(line)


def _write_speculators_checkpoint(folder: Path, step: int, epoch: int = 0, local_step: int = 0) -> None:
    """The files speculators 0.9 writes for one save, real formats."""
    folder.mkdir(parents=True, exist_ok=True)
    save_file({"w": torch.full((64, 64), float(step))}, folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps({"speculators_model_type": "eagle3"}))
    torch.save({"state": {0: {"exp_avg": torch.zeros(64)}}}, folder / "optimizer_state_dict.pt")
    (folder / "training_state.json").write_text(json.dumps({"epoch": epoch, "local_step": local_step,
                                                            "global_step": step}))


def _trainer(root: Path):
    ckpt = SimpleNamespace(path=root, TRAIN_COMMAND_FILENAME="train_command.txt")
    return SimpleNamespace(checkpointer=ckpt, model=torch.nn.Linear(8, 8))


def _saver(trainer, epoch, step, fail_after=None):
    """What the stock save does: writes `<epoch>/` under the checkpointer's root as it is now."""

    def save():
        folder = Path(trainer.checkpointer.path) / str(epoch)
        folder.mkdir(parents=True, exist_ok=True)
        save_file({"w": torch.full((64, 64), float(step))}, folder / "model.safetensors")
        if fail_after == "model":
            raise OSError(28, "No space left on device")
        (folder / "config.json").write_text("{}")
        torch.save({}, folder / "optimizer_state_dict.pt")
        (folder / "training_state.json").write_text(json.dumps({"epoch": epoch, "local_step": 3, "global_step": step}))
        link = Path(trainer.checkpointer.path) / f"epoch{epoch}_step3"
        link.symlink_to(str(epoch))

    return save


def test_a_save_is_written_aside_and_replaces_the_epoch_folder_whole(tmp_path):
    root = tmp_path / "checkpoints"
    _write_speculators_checkpoint(root / "0", step=4, local_step=2)
    trainer = _trainer(root)
    ck.atomic_save(_saver(trainer, 0, 7), trainer, 0)
    assert trainer.checkpointer.path == root, "the checkpointer's root is given back"
    assert ck.problem(root / "0") is None and (root / "0" / ck.MARKER).is_file()
    assert ck.training_state(root / "0")["global_step"] == 7 and ck.last_global_step(root) == 7
    assert os.readlink(root / "epoch0_step3") == "0"
    assert sorted(p.name for p in root.iterdir()) == ["0", "epoch0_step3"], "no scratch folder left"


def test_a_full_disk_in_the_middle_of_a_save_keeps_the_last_complete_checkpoint(tmp_path):
    root = tmp_path / "checkpoints"
    _write_speculators_checkpoint(root / "0", step=4, local_step=2)
    before = (root / "0" / "model.safetensors").read_bytes()
    trainer = _trainer(root)
    with pytest.raises(ck.CheckpointSpaceError, match=r"^checkpoint: the disk of .* filled up while a checkpoint "
                                                      r"was written; that checkpoint was dropped"):
        ck.atomic_save(_saver(trainer, 0, 7, fail_after="model"), trainer, 0)
    assert (root / "0" / "model.safetensors").read_bytes() == before and ck.last_global_step(root) == 4
    assert not (root / ck.STAGING).exists()


def test_too_little_free_space_refuses_the_save_before_it_writes(tmp_path, monkeypatch):
    root = tmp_path / "checkpoints"
    _write_speculators_checkpoint(root / "0", step=4)
    size = sum(p.stat().st_size for p in (root / "0").iterdir())
    monkeypatch.setattr(ck.shutil, "disk_usage", lambda p: SimpleNamespace(free=size // 2, total=10 * size))
    trainer = _trainer(root)
    wrote = []
    with pytest.raises(ck.CheckpointSpaceError, match=r"MiB free, the next checkpoint needs about .* MiB; training "
                                                      r"stopped before writing it and the last complete checkpoint"):
        ck.atomic_save(lambda: wrote.append(1), trainer, 0)
    assert not wrote and ck.last_global_step(root) == 4 and not (root / ck.STAGING).exists()


@pytest.mark.parametrize("damage,why", [
    (lambda f: (f / "training_state.json").write_text('{"epoch": 0, "glo'), "training_state.json is missing or half"),
    (lambda f: os.truncate(f / "model.safetensors", 1000), "model.safetensors is shorter than its header says"),
    (lambda f: os.truncate(f / "optimizer_state_dict.pt", 100), "optimizer_state_dict.pt is cut short"),
    (lambda f: (f / "optimizer_state_dict.pt").unlink(), "optimizer_state_dict.pt is missing"),
])
def test_a_torn_checkpoint_of_an_older_draftlab_is_set_aside_and_the_previous_one_resumed(tmp_path, damage, why):
    root = tmp_path / "checkpoints"
    _write_speculators_checkpoint(root / "0", step=10)
    _write_speculators_checkpoint(root / "1", step=14, epoch=1, local_step=4)
    damage(root / "1")
    assert why in ck.problem(root / "1")
    assert ck.last_global_step(root) == 10 and ck.newest_complete(root) == root / "0"
    console = _Console()
    assert ck.set_aside_torn(root, console) == [root / ".torn-1"]
    assert len(console.lines) == 1 and why in console.lines[0]
    assert [p.name for p in ck.epoch_folders(root)] == ["0"], "speculators now resumes epoch 0's checkpoint"


def test_a_marked_checkpoint_with_a_file_cut_short_is_not_complete(tmp_path):
    root = tmp_path / "checkpoints"
    _write_speculators_checkpoint(root / ".partial" / "0", step=3)
    ck.publish(root / ".partial" / "0", root / "0")
    assert ck.problem(root / "0") is None
    with open(root / "0" / "optimizer_state_dict.pt", "r+b") as f:
        f.truncate(10)
    assert "optimizer_state_dict.pt has 10 bytes" in ck.problem(root / "0")
    (root / "0" / ck.MARKER).write_text('{"fil')
    assert "half-written" in ck.problem(root / "0")


def test_a_kill_between_the_two_renames_is_undone(tmp_path):
    root = tmp_path / "checkpoints"
    _write_speculators_checkpoint(root / ".partial" / "0", step=3)
    ck.publish(root / ".partial" / "0", root / "0")
    os.rename(root / "0", root / ".replaced-0")  # the old one moved, the new one not yet in place
    _write_speculators_checkpoint(root / ".partial" / "0", step=9)
    ck.set_aside_torn(root, _Console())
    assert ck.last_global_step(root) == 3 and not (root / ".partial").exists()


def test_checkpoint_best_is_taken_only_when_complete(tmp_path):
    root = tmp_path / "checkpoints"
    _write_speculators_checkpoint(root / "0", step=5)
    _write_speculators_checkpoint(root / "1", step=9, epoch=1)
    (root / "checkpoint_best").symlink_to("0", target_is_directory=True)
    assert ck.newest_complete(root) == (root / "0").resolve()
    (root / "0" / "training_state.json").write_text("{")
    assert ck.newest_complete(root) == root / "1"
    assert ck.newest_complete(tmp_path / "none") is None
