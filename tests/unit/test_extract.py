"""extract: which layers are captured, batching, the store format speculators reads."""

import pytest

from draftlab.store.capture import plan_batches
from draftlab.store.vllm_extract import vllm_command
from tests.conftest import tiny_params


def test_batches_are_consecutive_bounded_and_deterministic():
    lens = [5, 9, 3, 30, 2, 2, 2, 17]
    batches = plan_batches(lens, 32)
    assert [i for b in batches for i in b] == list(range(len(lens)))
    assert all(len(b) * max(lens[i] for i in b) <= 32 or len(b) == 1 for b in batches)
    assert plan_batches(lens, 32) == batches


def test_vllm_backend_delegates_to_speculators_generator(tmp_path):
    params = tiny_params(extract={"backend": "vllm", "vllm_url": "http://gpu:8000/v1"},
                         target={"source": "hub", "path": "org/model"})
    cmd = vllm_command(params, data_dir=tmp_path / "d", out_dir=tmp_path / "hs")
    assert cmd[1:4] == ["-m", "speculators", "generate-offline-data"]
    assert cmd[cmd.index("--endpoint") + 1] == "http://gpu:8000/v1"
    assert cmd[cmd.index("--preprocessed-data") + 1] == str(tmp_path / "d")
    assert cmd[cmd.index("--output") + 1] == str(tmp_path / "hs")
    with pytest.raises(Exception, match="extract.vllm_url"):
        vllm_command(tiny_params(extract={"backend": "vllm"}), data_dir=tmp_path, out_dir=tmp_path)
