"""What a capture backend hands the features worker (``Captured``) and what the worker asks of one
(``CaptureBackend``): backends.py (http), transformers_backend.py (transformers) and vllm_backend.py (vllm)
implement it."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from budgetq.hidden_states.schema import FeaturesPayload
from budgetq.shared.config import Config, ServerConfig


def features_server(cfg: Config) -> ServerConfig:
    """features.server.urls when given (servers started for hidden states), else server.urls."""
    urls = cfg.features.server.urls
    return cfg.server.model_copy(update={"urls": urls}) if urls else cfg.server


@dataclass
class Captured:
    """One sample's tensors: ``data`` [tokens, hidden] (the target), ``aux`` [tokens, 3 x hidden] or None, as
    little-endian bytes (a memoryview of the transformers backend's batch tensor: read, never kept)."""

    data: bytes | memoryview
    shape: list[int]
    aux: bytes | memoryview | None = None
    aux_shape: list[int] | None = None
    endpoint: str = ""
    # Files the capture read (the vllm backend: the engine's file and its .lock): removed once the sample is
    # in a shard, or when its job fails.
    raw_files: list[str] = field(default_factory=list)
    # The sample as stored, where it is not the job's payload: single_pass's engine file holds every token but
    # the last sampled one, so the sample is the payload cut to the file's tokens (vllm_backend.py).
    payload: FeaturesPayload | None = None

    def remove_raw_files(self) -> None:
        for path in self.raw_files:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        self.raw_files = []

    @property
    def nbytes(self) -> int:
        return len(self.data) + (len(self.aux) if self.aux is not None else 0)


class CaptureBackend(Protocol):
    """What the features worker needs of a backend. ``hold(n)`` tells the worker how many bytes this
    job holds right now (its worker_max_mb accounting); a failure of this sample only raises
    HiddenStatesError (or the client's request errors), which fails that job."""

    name: str

    async def start(self) -> None: ...

    def bytes_per_token(self) -> float:
        """Bytes a job holds per token at its peak (memory admission before the request is sent)."""
        ...

    async def capture(self, payload: FeaturesPayload, job_id: str, hold: Callable[[int], None]) -> Captured: ...

    async def close(self) -> None: ...
