"""``features.backend: synthetic``: tensors at memory speed with no model, for tests and bench/features_store.py.

It measures the pipeline's own ceiling (claims, the store's writes or the Redis stream, the collector), not a
capture: the values are made up. So it is never a default, it needs its own section
(``features.synthetic.hidden_size``) besides naming it, and the worker says at start, in one line, that its
tensors are not a model's.

Each sample's target is ``[tokens, hidden]`` and its aux block ``[tokens, aux_layers x hidden]`` in the wire
dtype (bf16; float16 when stored so), views of one random buffer made at start (values ~N(0, 1), finite), so
a capture costs no compute and no copy: what follows (fp8, the shard write, the XADD) is what is measured.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np

from budgetq.hidden_states.capture.captured import Captured
from budgetq.hidden_states.capture.decode import to_dtype
from budgetq.hidden_states.schema import FeaturesPayload, wire_dtype
from budgetq.shared.config import Config

log = logging.getLogger("budgetq.features")


class SyntheticBackend:
    name = "synthetic"

    def __init__(self, cfg: Config) -> None:
        s = cfg.features.synthetic
        assert s is not None  # FeaturesConfig refuses backend synthetic without its section
        self.hidden, self.aux_layers, self.max_tokens = s.hidden_size, s.aux_layers, s.max_tokens
        self.dtype = wire_dtype(cfg.features.dtype)
        self.buf = memoryview(b"")

    async def start(self) -> None:
        values = np.random.default_rng(0).standard_normal((self.max_tokens, self.hidden * (1 + self.aux_layers)),
                                                          dtype=np.float32)
        self.buf = memoryview(to_dtype(values, self.dtype))
        log.warning("features worker: backend synthetic: tensors are made up (no model), for tests and benchmarks "
                    "only (hidden %d, %d aux layers)", self.hidden, self.aux_layers)

    def bytes_per_token(self) -> float:
        return 2.0 * self.hidden * (1 + self.aux_layers)

    async def capture(self, payload: FeaturesPayload, job_id: str, hold: Callable[[int], None]) -> Captured:
        n = len(payload.input_ids)
        if n > self.max_tokens:
            raise ValueError(f"synthetic backend: {n} tokens, more than features.synthetic.max_tokens "
                             f"{self.max_tokens}")
        h = self.hidden * 2
        target = self.buf[: n * h]
        if not self.aux_layers:
            return Captured(target, [n, self.hidden], endpoint="synthetic")
        aux = self.buf[n * h: n * h * (1 + self.aux_layers)]
        return Captured(target, [n, self.hidden], aux, [n, self.hidden * self.aux_layers], endpoint="synthetic")

    async def close(self) -> None:
        return None
