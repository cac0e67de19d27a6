"""Checkpoints that become visible only complete, and the newest complete one for resume and export.

speculators 0.9 writes `checkpoints/<epoch>/` in place, and its sub-epoch saves
(`train.checkpoint_freq` < 1) rewrite the same folder: a kill -9 or a full disk in the middle
of a save would leave the newest checkpoint torn and the last good state gone. Here every save
(`atomic_saves`, installed on the trainer's one save method through draftlab.training.compat):

1. checks free space first: the last complete checkpoint's size (or the model's, before the
   first) must fit with a margin, else the rank stops with one line (`CheckpointSpaceError`)
   and the last complete checkpoint is kept;
2. lets speculators write the checkpoint into `checkpoints/.partial/` (its checkpointer's root,
   swapped for the save), syncs every file and writes `draftlab-complete.json` (each file's
   size) last;
3. renames it over `checkpoints/<epoch>/` (the old one first to `.replaced-<epoch>`, removed
   after), so `<epoch>/` is at every instant the old complete checkpoint or the new one.

Before a launch (`set_aside_torn`, in the launcher under the folder's lock) a checkpoint that is
not complete (no marker, a file shorter than it says, a half-written training_state.json) is
moved aside to `checkpoints/.torn-<epoch>` with one line, so speculators resumes from the newest
complete one; a kill between the two renames is undone; `.partial/` is removed.

A checkpoint written before this module (no marker) counts as complete when every file
speculators writes is whole: training_state.json and config.json parse, model.safetensors is
as long as its header says, optimizer_state_dict.pt is a whole zip.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import zipfile
from pathlib import Path

from draftlab.errors import HostError

MARKER = "draftlab-complete.json"
STAGING = ".partial"
SPACE_MARGIN = 1.15  # the estimate is the last checkpoint's size; files grow a little as steps pass
SPACE_SLACK_BYTES = 16 << 20


class CheckpointSpaceError(HostError):
    """Too little free disk for the next checkpoint: the rank stops, the last complete one is kept."""


# ---------------------------------------------------------------- reading


def _safetensors_whole(path: Path) -> bool:
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > size - 8:
                return False
            header = json.loads(f.read(n))
    except (OSError, ValueError, struct.error):
        return False
    ends = [v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"]
    return 8 + n + max(ends, default=0) == size


def training_state(folder: Path) -> dict | None:
    """A checkpoint's training_state.json (epoch, local_step, global_step), or None when it is
    missing, half-written or not one."""
    try:
        state = json.loads((Path(folder) / "training_state.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(state, dict) or not isinstance(state.get("global_step"), int):
        return None
    return state


def problem(folder: Path) -> str | None:
    """Why `folder` is not a complete checkpoint, or None when it is."""
    folder = Path(folder)
    marker = folder / MARKER
    if marker.exists():
        try:
            sizes = json.loads(marker.read_text())["files"]
        except (OSError, ValueError, KeyError, TypeError):
            return f"{MARKER} is half-written"
        for name, size in sizes.items():
            try:
                got = (folder / name).stat().st_size
            except OSError:
                return f"{name} is missing"
            if got != size:
                return f"{name} has {got} bytes, {size} were written"
        return None
    # written before the marker existed: every file speculators writes must be whole
    if training_state(folder) is None:
        return "training_state.json is missing or half-written"
    try:
        json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return "config.json is missing or half-written"
    weights = folder / "model.safetensors"
    if weights.exists() and not _safetensors_whole(weights):
        return "model.safetensors is shorter than its header says"
    if not weights.exists() and not (folder / "model.safetensors.index.json").exists():
        return "model.safetensors is missing"
    optimizer = folder / "optimizer_state_dict.pt"
    if optimizer.exists() and not zipfile.is_zipfile(optimizer):
        return "optimizer_state_dict.pt is cut short"
    if not optimizer.exists():
        return "optimizer_state_dict.pt is missing"
    return None


def epoch_folders(checkpoints: Path) -> list[Path]:
    """The `<epoch>/` folders speculators resumes from (real folders, not its `epoch<k>_*` links)."""
    checkpoints = Path(checkpoints)
    if not checkpoints.is_dir():
        return []
    return sorted((p for p in checkpoints.iterdir() if p.name.isdigit() and p.is_dir() and not p.is_symlink()),
                  key=lambda p: int(p.name))


def complete(checkpoints: Path) -> list[Path]:
    return [p for p in epoch_folders(checkpoints) if problem(p) is None]


def newest_complete(checkpoints: Path) -> Path | None:
    """The checkpoint export and evaluate take: `checkpoint_best` when it points at a complete
    one, else the complete one of the highest epoch."""
    checkpoints = Path(checkpoints)
    best = checkpoints / "checkpoint_best"
    if best.exists() and problem(best.resolve()) is None:
        return best.resolve()
    done = complete(checkpoints)
    return done[-1] if done else None


def last_global_step(checkpoints: Path) -> int | None:
    """The global step of the newest complete checkpoint (where a resume starts), else None."""
    steps = [s["global_step"] for p in complete(checkpoints) if (s := training_state(p)) is not None]
    return max(steps, default=None)


# ---------------------------------------------------------------- before a launch


def set_aside_torn(checkpoints: Path, console) -> list[Path]:
    """Undo a kill between a save's two renames, drop a save's scratch folder, and move every
    checkpoint that is not complete to `.torn-<epoch>` (one line each), so the trainer resumes
    from the newest complete one. Returns where the torn ones went."""
    checkpoints = Path(checkpoints)
    if not checkpoints.is_dir():
        return []
    for replaced in checkpoints.glob(".replaced-*"):
        final = checkpoints / replaced.name.removeprefix(".replaced-")
        if final.exists():
            shutil.rmtree(replaced, ignore_errors=True)
        else:
            os.rename(replaced, final)  # killed after the old one moved, before the new one came
    shutil.rmtree(checkpoints / STAGING, ignore_errors=True)
    moved = []
    for folder in epoch_folders(checkpoints):
        why = problem(folder)
        if why is None:
            continue
        aside = checkpoints / f".torn-{folder.name}"
        shutil.rmtree(aside, ignore_errors=True)
        os.rename(folder, aside)
        moved.append(aside)
        console.print(f"[yellow]train[/]: checkpoint {folder} is incomplete ({why}); moved to {aside}, "
                      "resuming from the newest complete one", soft_wrap=True)
    return moved


# ---------------------------------------------------------------- saving


def _tree_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in Path(folder).rglob("*") if p.is_file() and not p.is_symlink())


def estimate_bytes(root: Path, model) -> int:
    """The next checkpoint's size: the last complete one's, else the model's bf16 weights plus
    AdamW's two bf16 moments of every trainable weight (this rank's share under FSDP)."""
    done = complete(root)
    if done:
        return _tree_bytes(done[-1])
    params = list(model.parameters())
    return sum(p.numel() * 2 for p in params) + sum(p.numel() * 4 for p in params if p.requires_grad)


def check_space(root: Path, need_bytes: int) -> None:
    root.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(root).free
    need = int(need_bytes * SPACE_MARGIN) + SPACE_SLACK_BYTES
    if need > free:
        last = complete(root)
        kept = f"the last complete checkpoint ({last[-1]}) is kept" if last else "no checkpoint was written yet"
        raise CheckpointSpaceError(
            f"checkpoint: {root} has {free / 2**20:.1f} MiB free, the next checkpoint needs about "
            f"{need / 2**20:.1f} MiB; training stopped before writing it and {kept}: free space, then "
            "rerun `draftlab train` to resume")


def _sync_tree(folder: Path) -> dict[str, int]:
    sizes = {}
    for path in sorted(Path(folder).rglob("*")):
        if path.is_file() and not path.is_symlink():
            with open(path, "rb") as f:
                os.fsync(f.fileno())
            sizes[str(path.relative_to(folder))] = path.stat().st_size
    return sizes


def _sync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def publish(staged: Path, final: Path) -> None:
    """Sync `staged`, mark it complete, and rename it over `final` (the old one kept until then)."""
    sizes = _sync_tree(staged)
    marker = staged / MARKER
    with open(marker, "w") as f:
        f.write(json.dumps({"files": sizes}) + "\n")
        f.flush()
        os.fsync(f.fileno())
    _sync_dir(staged)
    replaced = final.with_name(f".replaced-{final.name}")
    if final.exists():
        shutil.rmtree(replaced, ignore_errors=True)
        os.rename(final, replaced)
    os.rename(staged, final)
    _sync_dir(final.parent)
    shutil.rmtree(replaced, ignore_errors=True)


def _is_no_space(err: BaseException) -> bool:
    import errno

    return isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT)


def atomic_save(save, trainer, epoch) -> None:
    """One `Trainer.maybe_save_checkpoint` (`save()`), written aside and renamed into place on rank 0."""
    import torch.distributed as dist

    distributed = dist.is_available() and dist.is_initialized()
    writer = not distributed or dist.get_rank() == 0
    ckpt = trainer.checkpointer
    root = Path(ckpt.path)
    staging = root / STAGING
    short = None
    if writer:
        try:
            check_space(root, estimate_bytes(root, trainer.model))
        except CheckpointSpaceError as err:
            short = err
    if distributed:  # every rank refuses together: none is left waiting in the save's collectives
        import torch

        device = next((p.device for p in trainer.model.parameters()), "cpu")  # NCCL has no CPU tensors
        flag = torch.tensor([1.0 if short is not None else 0.0], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        refused = bool(flag.item())
    else:
        refused = short is not None
    if refused:
        raise short or CheckpointSpaceError("checkpoint: rank 0 found too little free disk for the next "
                                            "checkpoint; free space, then rerun `draftlab train` to resume")
    if writer:
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True, exist_ok=True)
        command = root / ckpt.TRAIN_COMMAND_FILENAME  # speculators copies it from its root: give it one
        if command.exists():
            shutil.copy2(command, staging / command.name)
    ckpt.path = staging
    try:
        save()
    except Exception as err:
        # torch's zip writer says "file write failed" (a RuntimeError), not ENOSPC: ask the disk
        full = _is_no_space(err) or (writer and shutil.disk_usage(root).free < SPACE_SLACK_BYTES)
        if writer:
            shutil.rmtree(staging, ignore_errors=True)  # the space it took goes back at once
        if full:
            raise CheckpointSpaceError(
                f"checkpoint: the disk of {root} filled up while a checkpoint was written; that checkpoint was "
                "dropped and the last complete one is kept: free space, then rerun `draftlab train` to resume") from None
        raise
    finally:
        ckpt.path = root
    if writer:
        name = str(epoch)
        if (staging / name).is_dir():
            try:
                publish(staging / name, root / name)
            except OSError as err:
                if _is_no_space(err):
                    raise CheckpointSpaceError(
                        f"checkpoint: the disk of {root} filled up while a checkpoint was written; the last "
                        "complete one is kept: free space, then rerun `draftlab train` to resume") from None
                raise
            for link in staging.glob(f"epoch{name}_*"):  # speculators' readable names: epoch0_step16 -> 0
                for old in root.glob(f"epoch{name}_*"):
                    if old.is_symlink():
                        old.unlink()
                (root / link.name).symlink_to(os.readlink(link))
        shutil.rmtree(staging, ignore_errors=True)
    if distributed:
        dist.barrier()  # every rank sees the checkpoint in place before training goes on


def install() -> None:
    """Make every checkpoint the trainer saves atomic (call in each rank before training)."""
    from draftlab.training import compat

    compat.around_checkpoint(atomic_save)


def epoch_end_steps(checkpoints: Path) -> dict[int, int]:
    """Global step at the end of each epoch, from the complete epoch checkpoints' training state."""
    states = [s for p in complete(checkpoints) if (s := training_state(p)) is not None]
    return {s["epoch"]: s["global_step"] for s in states if s.get("local_step", 0) == 0}
