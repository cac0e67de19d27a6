"""Device placement: auto follows the host, bad asks fail with one line naming the key and exit 2."""

import pytest

from draftlab import devices
from draftlab.params import ParamsError


def test_auto_is_cpu_here_with_the_targets_own_dtype(monkeypatch):
    monkeypatch.setattr(devices, "cuda_count", lambda: 0)
    assert devices.resolve("extract.device", "auto", "float32").record() == {"device": "cpu", "compute_dtype": "float32"}
    monkeypatch.setattr(devices, "cuda_count", lambda: 2)
    assert devices.resolve("extract.device", "auto", "float32").record() == {"device": "cuda", "compute_dtype": "bfloat16"}
    assert devices.resolve("extract.device", "cpu", "float32").device == "cpu"


@pytest.mark.parametrize("key", ["prepare.device", "extract.device", "evaluate.device"])
def test_cuda_without_a_gpu_is_one_line(monkeypatch, key):
    monkeypatch.setattr(devices, "cuda_count", lambda: 0)
    with pytest.raises(ParamsError, match=f"^{key}: cuda asked but no CUDA device") as err:
        devices.resolve(key, "cuda", "float32")
    assert "\n" not in str(err.value)


def test_more_processes_than_gpus(monkeypatch, tmp_path):
    from draftlab.store.extract_ranks import plan_placement
    from tests.conftest import tiny_params

    (tmp_path / "config.json").write_text("{}")
    monkeypatch.setattr(devices, "cuda_count", lambda: 2)
    monkeypatch.setattr(devices, "fits_one_gpu", lambda nbytes: True)
    with pytest.raises(ParamsError, match=r"^extract.processes: 3 GPU processes asked but 2 CUDA device\(s\)"):
        plan_placement(tiny_params(extract={"processes": 3}), tmp_path)
    assert plan_placement(tiny_params(), tmp_path)[1:] == (2, None), "one rank per visible GPU"
    monkeypatch.setattr(devices, "fits_one_gpu", lambda nbytes: False)
    assert plan_placement(tiny_params(), tmp_path)[1:] == (1, "auto"), "too big: one process, device_map"
    with pytest.raises(ParamsError, match="^extract.processes: the target does not fit one GPU"):
        plan_placement(tiny_params(extract={"processes": 2}), tmp_path)


def test_a_gpu_store_has_another_key_and_a_cpu_key_is_unchanged():
    from draftlab.stages.extract import with_compute
    from draftlab.store import layout as store

    fields = {"target": {"hub_id": "t"}, "layer_ids": [2, 4, 5], "dtype": "bfloat16", "dataset": "d"}
    assert with_compute(fields, devices.on("cpu", "float32")) == fields
    gpu = with_compute(fields, devices.on("cuda", "float32"))
    assert gpu["compute"] == {"device": "cuda", "compute_dtype": "bfloat16"}
    assert store.store_key(gpu) != store.store_key(fields)
