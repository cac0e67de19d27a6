"""The interpreter's frame stack: run a hot loop where its calls cannot cross a chunk boundary.

CPython 3.11 keeps a thread's frames in chunks of 16 KiB, each mapped with mmap on the first
call that does not fit and unmapped when that call returns (cpython#142183). The fix that keeps
one spare chunk (cpython#145789, 2026) went into 3.13 and later, not into 3.11 (the CPU image's
Python, where the figures below were measured) or 3.12 (the GPU image's). A loop whose calls go
in and out at a boundary maps and unmaps a chunk, and faults its pages in again, at every
crossing; where the boundary falls depends only on how deep the loop starts. The trainer's steps
are such a loop: under draftlab's rank, a few frames deeper than under speculators' own script,
the tiny default's steps took about 250 minor page faults each, 5,600 a second of them in
`_PyThreadState_BumpFramePointerSlow` (`perf record -e page-faults`), against 49 a step for the
bare script in one process and 16 through `call` (docs/figures.md, "The frame stack's chunks").

`call(fn, ...)` runs `fn` inside one frame that reserves half a chunk of 1 MiB: the interpreter
gives a frame that large a chunk of its own, and every call below it has the other half, about
64 k slots, so the loop stays inside that chunk at any depth it reaches. The reserved slots are
empty locals: the frame costs 512 KiB of memory written once, and nothing per call.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

RESERVED_SLOTS = 64 * 1024  # 512 KiB of 8-byte slots: the interpreter rounds the chunk up to 1 MiB


def _run(fn, args, kwargs):
    return fn(*args, **kwargs)


def _roomy(fn: types.FunctionType, slots: int) -> types.FunctionType:
    code = fn.__code__
    padded = code.replace(co_nlocals=code.co_nlocals + slots,
                          co_varnames=code.co_varnames + tuple(f"_slot{i}" for i in range(slots)))
    return types.FunctionType(padded, fn.__globals__, fn.__name__)


_roomy_run = _roomy(_run, RESERVED_SLOTS)


def call(fn: Callable[..., T], *args, **kwargs) -> T:
    """``fn(*args, **kwargs)``, its whole call tree inside one roomy chunk of the frame stack."""
    return _roomy_run(fn, args, kwargs)
