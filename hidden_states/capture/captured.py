"""What a capture backend hands the features worker (``Captured``) and what the worker asks of one
(``CaptureBackend``): backends.py (http) and transformers_backend.py (transformers) implement it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from budgetq.hidden_states.schema import FeaturesPayload


@dataclass
class Captured:
    """One sample's tensors: ``data`` [tokens, hidden] (the target), ``aux`` [tokens, 3 x hidden] or None, as
    little-endian bytes (a memoryview of the transformers backend's batch tensor: read, never kept)."""

    data: bytes | memoryview
    shape: list[int]
    aux: bytes | memoryview | None = None
    aux_shape: list[int] | None = None
    endpoint: str = ""

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
