"""vLLM's hidden-state connector, writing synchronously: what `extract.backend: vllm` loads on a
host without CUDA (vLLM imports it by `kv_connector_module_path`, inside the vLLM server).

Upstream's `ExampleHiddenStatesConnector` (and hs_connectors' fp8 sibling) copy the states out
of the cache on a CUDA stream into pinned memory and write them on a thread pool; a CPU host has
neither (`pin_memory=True requires a CUDA or other accelerator backend`, and the engine dies).
This subclass keeps everything else of upstream's — the scheduler side, the per-file `.lock`
that clients wait on, the `hidden_states_path` it answers with — and replaces only the write:
read the request's slots from the cache, cast (or quantize) as `extract.dtype` says, write the
file atomically (temp name, then rename), release the lock, all before the request is reported
finished. The file's tensors and its atomic write are `hs_file`'s (fp8 as hs_connectors quantizes it).

This module runs in the vLLM server's interpreter: it imports vLLM, torch and safetensors only
and `hs_file` (draftlab's package root is put on the server's PYTHONPATH; `draftlab/__init__` and
`draftlab/store/__init__` import nothing).

Legend: T tokens, L the 4 layers (3 aux + the final one, pre-norm), H hidden size.
"""

from __future__ import annotations

import fcntl
import os
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    extract_from_kv_cache,
)

from draftlab.store.hs_file import sample_tensors, write_atomic

class _Written:
    """Stands where upstream keeps the CUDA event of a copy in flight: here the file is on disk."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


class SyncHiddenStatesConnector(ExampleHiddenStatesConnector):
    """Upstream's connector with a synchronous, CPU-only write. Extra config: `dtype`
    (`bfloat16`, `float16`, `float32`, `float8_e4m3fn`; absent: the cache's own)."""

    def __init__(self, vllm_config, role, kv_cache_config=None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self._dtype = self._kv_transfer_config.get_from_extra_config("dtype", None)

    def _submit_async_write(self, pending: Any) -> None:
        if not self._is_tp_rank_zero:
            return
        assert self._kv_cache is not None
        block_ids = torch.tensor(pending.block_ids, dtype=torch.long)
        offsets = torch.arange(self._block_size, dtype=torch.long)
        slots = (offsets.reshape(1, -1) + block_ids.reshape(-1, 1) * self._block_size).flatten()
        num_tokens = pending.token_ids.shape[0]
        hidden_TLH = extract_from_kv_cache(self._kv_cache, slots.to(self._kv_cache.device), num_tokens).cpu()
        tensors = sample_tensors(hidden_TLH, pending.token_ids.clone(), self._dtype)
        os.makedirs(os.path.dirname(pending.filename) or ".", exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        if lock_fd is None and self.use_lock:
            lock_fd = os.open(pending.filename + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
        try:
            write_atomic(tensors, pending.filename)
        finally:
            if lock_fd is not None:
                os.close(lock_fd)  # releases LOCK_EX: the client's wait ends
        self._req_copy_events[pending.req_id] = _Written()
