"""The store's checks: headers named (never a SafetensorError), the training loader's verified
reads (hidden_states.VerifiedTransfer inside speculators' own ArrowDataset), the layer-id refusals
made from a target's config, and extract's repair bookkeeping."""

from __future__ import annotations

import pytest

from draftlab.params import ParamsError
from draftlab.stages.extract import resolve_layer_ids
from draftlab.store import hidden_states


def test_a_worker_reraised_error_keeps_its_one_line():
    wrapped = hidden_states.HiddenStateFileError(
        "Caught HiddenStateFileError in DataLoader worker process 0.\nOriginal Traceback (most recent call last):\n"
        '  File "x.py", line 1, in f\ndraftlab.store.hidden_states.HiddenStateFileError: /s/hs_1.safetensors: missing; run it\n')
    assert hidden_states.clean_message(wrapped) == "/s/hs_1.safetensors: missing; run it"


def test_layer_ids_are_checked_against_the_target_depth():
    assert resolve_layer_ids(None, 8) == [2, 4, 5]
    with pytest.raises(ParamsError, match=r"extract.layer_ids: the default .* = \[2, 3, 3\] are not distinct .* 6 layers"):
        resolve_layer_ids(None, 6)
    with pytest.raises(ParamsError, match=r"extract.layer_ids: \[2, 4, 99\] out of range for a target with 8 layers"):
        resolve_layer_ids([2, 4, 99], 8)
    assert resolve_layer_ids([1, 3, 4], 6) == [1, 3, 4]


def test_bit_rot_a_reader_recorded_is_rehashed_and_redone_by_extract(tmp_path):
    """A flipped byte with size and mtime unchanged: extract trusts the file by its stat, until a
    reader (or `draftlab verify`) records it bad; then extract re-hashes it and forgets it in
    the journal (so it is re-extracted, after a kill too) and consumes the record."""
    import hashlib
    import os

    import numpy as np
    from safetensors.numpy import save_file

    from draftlab.console import console
    from draftlab.stages.extract import drop_bad_files
    from draftlab.store import layout as store

    published = tmp_path / "hidden_states"
    work = store.work_dir(published)
    work.mkdir()
    published.mkdir()
    journal = store.Journal.open(work, "key")
    recs = []
    for i in range(2):
        path = work / store.file_name(i)
        save_file({"hidden_states": np.full((3, 4, 2), i, np.float32), "token_ids": np.arange(3)}, str(path))
        blob = path.read_bytes()
        recs.append({"index": i, "name": path.name, "bytes": len(blob), "sha256": hashlib.sha256(blob).hexdigest(),
                     "tokens": 3, "mtime_ns": path.stat().st_mtime_ns})
        os.link(path, published / path.name)  # published as hardlinks, as extract does
    journal.record(recs)
    rotten = work / "hs_1.safetensors"
    st = rotten.stat()
    blob = bytearray(rotten.read_bytes())
    blob[-1] ^= 0xFF
    rotten.write_bytes(bytes(blob))
    os.utime(rotten, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert drop_bad_files(work, journal, console, published=published) == [], "trusted by size and mtime"

    store.record_bad(published, {"hs_1.safetensors": "corrupt (sha256 differs from the manifest)"})
    assert set(store.recorded_bad(published)) == set(store.recorded_bad(work)) == {"hs_1.safetensors"}
    bad = drop_bad_files(work, journal, console, published=published)
    assert len(bad) == 1 and "hs_1.safetensors: corrupt" in bad[0]
    assert set(journal.done) == {0} and set(store.Journal.open(work, "key").done) == {0}, "redone after a kill too"
    assert store.recorded_bad(work) == {}


def test_a_journal_torn_mid_line_is_trimmed_and_keeps_the_records_after_a_rerun(tmp_path):
    from draftlab.store.layout import Journal

    rec = {"index": 0, "name": "hs_0.safetensors", "bytes": 1, "sha256": "0", "tokens": 1}
    j = Journal.open(tmp_path, "k")
    j.record([rec])
    with open(j.path, "a") as f:
        f.write('{"files": [{"index": 1, "na')  # a kill or a full disk mid-append
    j = Journal.open(tmp_path, "k")  # the rerun: trimmed, so its records follow a whole line
    assert set(j.done) == {0}
    j.record([{**rec, "index": 1, "name": "hs_1.safetensors"}])
    j.record([{**rec, "index": 2, "name": "hs_2.safetensors"}])
    assert set(Journal.open(tmp_path, "k").done) == {0, 1, 2}, "no record after the torn line is lost"
    assert len(j.path.read_text().splitlines()) == 4


def test_a_journal_whose_header_was_torn_starts_afresh(tmp_path):
    from draftlab.rundir import StoreDir
    from draftlab.store.layout import Journal

    StoreDir(tmp_path).journal_path.write_text('{"ke')
    assert Journal.open(tmp_path, "k").done == {}
    assert StoreDir(tmp_path).journal_path.read_text() == '{"key": "k"}\n'
