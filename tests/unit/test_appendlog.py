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
