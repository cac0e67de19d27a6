"""The store's checks: headers named (never a SafetensorError), the training loader's verified
reads (compat.VerifiedTransfer inside speculators' own ArrowDataset), the layer-id refusals
made from a target's config, and extract's repair bookkeeping."""

from __future__ import annotations

import pytest

from draftlab.params import ParamsError
from draftlab.stages.extract import resolve_layer_ids
from draftlab.training import compat


def test_a_worker_reraised_error_keeps_its_one_line():
    wrapped = compat.HiddenStateFileError(
        "Caught HiddenStateFileError in DataLoader worker process 0.\nOriginal Traceback (most recent call last):\n"
        '  File "x.py", line 1, in f\ndraftlab.compat.HiddenStateFileError: /s/hs_1.safetensors: missing; run it\n')
    assert compat.clean_message(wrapped) == "/s/hs_1.safetensors: missing; run it"


def test_layer_ids_are_checked_against_the_target_depth():
    assert resolve_layer_ids(None, 8) == [2, 4, 5]
    with pytest.raises(ParamsError, match=r"extract.layer_ids: the default .* = \[2, 3, 3\] are not distinct .* 6 layers"):
        resolve_layer_ids(None, 6)
    with pytest.raises(ParamsError, match=r"extract.layer_ids: \[2, 4, 99\] out of range for a target with 8 layers"):
        resolve_layer_ids([2, 4, 99], 8)
    assert resolve_layer_ids([1, 3, 4], 6) == [1, 3, 4]
