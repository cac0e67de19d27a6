"""draftlab.appendlog: a partial last line (a kill or a full disk mid-write) is trimmed before the
next append and left out by readers; nothing complete is lost or duplicated."""

import json

from draftlab import appendlog


def test_a_torn_last_line_is_trimmed_before_the_next_record(tmp_path):
    path = tmp_path / "log.jsonl"
    appendlog.append(path, {"i": 0})
    appendlog.append(path, {"i": 1})
    with open(path, "a") as f:
        f.write('{"i": 2, "pad')  # the write a kill cut short
    assert [json.loads(x) for x in appendlog.complete_lines(path)] == [{"i": 0}, {"i": 1}]
    appendlog.append(path, {"i": 2})  # the record redone
    assert [json.loads(x) for x in path.read_text().splitlines()] == [{"i": 0}, {"i": 1}, {"i": 2}]


def test_a_file_that_is_only_a_torn_line_becomes_empty(tmp_path):
    path = tmp_path / "log.jsonl"
    path.write_bytes(b"x" * 200_000)  # longer than one backwards read
    assert appendlog.trim_partial_line(path) == 200_000 and path.read_bytes() == b""
    assert appendlog.trim_partial_line(tmp_path / "absent.jsonl") == 0


def test_a_whole_file_is_left_as_it_is(tmp_path):
    path = tmp_path / "log.jsonl"
    path.write_text('{"a": 1}\n' + "y" * 70_000 + "\n")
    before = path.read_bytes()
    assert appendlog.trim_partial_line(path) == 0 and path.read_bytes() == before


def test_a_writer_that_keeps_the_file_open_trims_a_killed_writers_line_and_its_own_failed_write(tmp_path):
    import pytest

    path = tmp_path / "steps.jsonl"
    path.write_text('{"step": 0}\n{"step": 1, "lo')  # the rank before was killed mid-line
    steps = appendlog.Appender(path)
    steps.append({"step": 1})

    class DiskFills:  # the next write gets half its bytes out, then the disk is full
        def __init__(self, file):
            self.file = file

        def write(self, text):
            self.file.write(text[: len(text) // 2])
            self.file.flush()
            raise OSError(28, "No space left on device")

        def close(self):
            self.file.close()

    steps.file = DiskFills(steps.file)
    with pytest.raises(OSError):
        steps.append({"step": 2, "pad": "x" * 100})
    assert [json.loads(x) for x in appendlog.complete_lines(path)] == [{"step": 0}, {"step": 1}]
    steps.append({"step": 2})  # space again: the torn half goes first
    steps.close()
    assert [json.loads(x) for x in path.read_text().splitlines()] == [{"step": 0}, {"step": 1}, {"step": 2}]
