"""draftlab's CPU hidden-state connector runs inside the vLLM server: it may import only what the
vLLM venv has, and its fp8 files must be what speculators' fp8 reader (hs_connectors) dequantizes."""

import ast
from pathlib import Path

import pytest
import torch

from draftlab.store import hs_file

STORE = Path(hs_file.__file__).parent


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            names.add(node.module)
    return names


@pytest.mark.parametrize("module", ["vllm_connector.py", "hs_file.py"])
def test_the_connector_imports_only_what_the_vllm_venv_has(module):
    allowed = ("__future__", "fcntl", "os", "typing", "torch", "safetensors", "vllm", "draftlab.store.hs_file")
    assert {n for n in _imports(STORE / module) if not n.startswith(allowed)} == set()


def test_fp8_is_hs_connectors_quantization_and_its_reader_dequantizes_it(tmp_path):
    from hs_connectors import FP8Transfer
    from hs_connectors.fp8_utils import quantize_tensor_to_fp8

    hidden_TLH = torch.randn(7, 4, 32, dtype=torch.float32) * torch.logspace(-3, 2, 7).reshape(7, 1, 1)
    hidden_TLH[3] = 0  # a zero token: the clamp
    ours, scale = hs_file.quantize_fp8(hidden_TLH)
    theirs, their_scale = quantize_tensor_to_fp8(hidden_TLH)
    assert torch.equal(ours.view(torch.uint8), theirs.view(torch.uint8)) and torch.equal(scale, their_scale)

    hs_file.write_atomic(hs_file.sample_tensors(hidden_TLH, torch.arange(7), "float8_e4m3fn"),
                         str(tmp_path / "hs_0.safetensors"))
    back = FP8Transfer(tmp_path).get_cached(0)["hidden_states"]
    assert back.dtype == torch.bfloat16 and back.shape == (7, 4, 32)
    assert torch.allclose(back.float(), hidden_TLH, rtol=0.07, atol=1e-6)  # e4m3: 3 mantissa bits
    assert [p.name for p in tmp_path.iterdir()] == ["hs_0.safetensors"], "no temp file left"


def test_bf16_files_hold_the_cast_states_and_token_ids(tmp_path):
    hidden_TLH = torch.randn(5, 4, 16)
    tensors = hs_file.sample_tensors(hidden_TLH, torch.arange(5), "bfloat16")
    assert tensors["hidden_states"].dtype == torch.bfloat16
    assert torch.equal(tensors["hidden_states"], hidden_TLH.to(torch.bfloat16))
    assert hs_file.sample_tensors(hidden_TLH, torch.arange(5), None)["hidden_states"].dtype == torch.float32
