"""The speculators version draftlab's reaches into its internals were written for, and how one of
its files is loaded without the package (`speculators_module`).

Two modules touch speculators' internals, each behind :func:`check_speculators_version`:
`training.compat` (the trainer's CPU patches and observers) and `store.hidden_states` (the
dataset's reader, wrapped so every stored file is checked before it is decoded).
tests/unit/test_contracts.py keeps every other module to speculators' public names.
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import sys
from pathlib import Path

SPECULATORS_VERSION = "0.9.0"


def check_speculators_version() -> None:
    """Raise if the installed speculators is not the version these seams were written for."""
    installed = importlib.metadata.version("speculators")
    if installed != SPECULATORS_VERSION:
        raise RuntimeError(
            f"draftlab.training.compat and draftlab.store.hidden_states were written for speculators "
            f"{SPECULATORS_VERSION}, but {installed} is installed: re-read its trainer and dataset for the "
            "internals they patch, update them and tests/unit/test_compat.py, then "
            "draftlab.pinned.SPECULATORS_VERSION."
        )


@functools.cache
def _standalone(submodule: str):
    spec = importlib.util.find_spec("speculators")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("speculators is not installed")
    path = Path(list(spec.submodule_search_locations)[0], *submodule.split(".")).with_suffix(".py")
    mod_spec = importlib.util.spec_from_file_location(f"draftlab._speculators_{submodule.replace('.', '_')}", path)
    module = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(module)
    return module


def speculators_module(submodule: str):
    """`speculators.<submodule>` (e.g. "train.distributed_batch_sampler"): the imported module when
    speculators is loaded, else the same file executed on its own. Importing the package runs its
    `__init__` (every model, transformers: 9 s of a `draftlab train` launcher's start-up on a
    loaded 2-core VM); the launcher and `plan` need only the packing sampler and the vocab
    mapping, whose files import nothing of speculators (tests/unit/test_compat.py pins that)."""
    check_speculators_version()
    return sys.modules.get(f"speculators.{submodule}") or _standalone(submodule)
