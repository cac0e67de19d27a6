"""prepare: record parsing, loss masking, the split order speculators relies on."""

import json

import pytest

from draftlab.params import ParamsError
from draftlab.stages.prepare import RecordError, parse_record, read_conversations
from tests.conftest import tiny_params


def test_parse_record_accepts_openai_messages():
    conv = parse_record({"messages": [{"role": "user", "content": "hi"},
                                      {"role": "assistant", "content": [{"type": "text", "text": "yo"}]}]}, "f:1")
    assert conv[1] == {"role": "assistant", "content": "yo"}


@pytest.mark.parametrize("obj, why", [
    ({"msgs": []}, "non-empty 'messages'"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages\\[0\\] needs a 'role'"),
    ({"messages": [{"role": "user", "content": 3}]}, "content must be a string"),
    ({"messages": [{"role": "user", "content": "only a question"}]}, "no assistant turn"),
])
def test_parse_record_rejects_with_location(obj, why):
    with pytest.raises(RecordError, match=f"^data.jsonl:7: .*{why}"):
        parse_record(obj, "data.jsonl:7")


def _jsonl(tmp_path, lines):
    path = tmp_path / "convs.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


GOOD = json.dumps({"messages": [{"role": "user", "content": "add 1 and 2"},
                                {"role": "assistant", "content": "3"}]})


def test_malformed_jsonl_line_fails_with_file_and_line(tmp_path):
    path = _jsonl(tmp_path, [GOOD, GOOD, "{not json"])
    params = tiny_params(prepare={"source": "jsonl", "path": str(path)})
    with pytest.raises(RecordError, match=rf"{path}:3: not valid JSON"):
        read_conversations(params, tmp_path)


def test_malformed_records_skipped_and_counted_when_asked(tmp_path):
    path = _jsonl(tmp_path, [GOOD, "{not json", json.dumps({"messages": []}), GOOD])
    params = tiny_params(prepare={"source": "jsonl", "path": str(path), "on_error": "skip"})
    convs, skipped = read_conversations(params, tmp_path)
    assert (len(convs), skipped) == (2, 2)


def test_dataset_source_needs_messages_column(tmp_path):
    from datasets import Dataset

    Dataset.from_dict({"text": ["a"]}).save_to_disk(str(tmp_path / "ds"))
    params = tiny_params(prepare={"source": "dataset", "path": str(tmp_path / "ds")})
    with pytest.raises(ParamsError, match="no 'messages' column"):
        read_conversations(params, tmp_path)
