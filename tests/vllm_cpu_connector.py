"""Test scaffolding, not budgetq's production path: vLLM's ``ExampleHiddenStatesConnector`` made to run on the CPU.

The stock connector copies each finished request's hidden states from the (GPU) cache through a CUDA stream
into pinned host memory (``_submit_async_write``: ``torch.cuda.Stream()``, ``pin_memory=True``); on vLLM's
CPU build the first finished request kills the engine (``pin_memory=True requires a CUDA or other accelerator
backend``). This subclass does the same extraction synchronously: the same slots, the same file
(``hidden_states`` + ``token_ids``, ``save_file``), the same ``.lock`` protocol (the exclusive flock taken in
``wait_for_save`` is released once the file is written). On a GPU the stock connector is used.

vLLM loads it with ``kv_connector_module_path`` (``budgetq.hidden_states.capture.vllm_layout.server_flags``'s
``module_path``); the server's PYTHONPATH must reach this file (tests/test_vllm_features.py copies it).
This file runs inside the vLLM venv, never imported by the test suite.
"""

from __future__ import annotations

import fcntl
import os

import torch
from safetensors.torch import save_file
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    PendingSave,
    extract_from_kv_cache,
)


class _Done:
    """Stands in for the CUDA event that marks the copy done: here it is done when recorded."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


class CpuHiddenStatesConnector(ExampleHiddenStatesConnector):
    def _submit_async_write(self, pending: PendingSave) -> None:
        if not self._is_tp_rank_zero:
            return
        assert self._kv_cache is not None
        block_ids = torch.tensor(pending.block_ids, dtype=torch.long)
        offsets = torch.arange(0, self._block_size, dtype=torch.long)
        slots = (offsets.reshape((1, self._block_size)) + block_ids.reshape((-1, 1)) * self._block_size).flatten()
        states = extract_from_kv_cache(self._kv_cache, slots, pending.token_ids.shape[0]).clone()
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        if lock_fd is None and self.use_lock:
            lock_fd = os.open(pending.filename + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
        try:
            save_file({"hidden_states": states, "token_ids": pending.token_ids.clone()}, pending.filename)
        finally:
            if lock_fd is not None:
                os.close(lock_fd)
        self._req_copy_events[pending.req_id] = _Done()  # type: ignore[assignment]
