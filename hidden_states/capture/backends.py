"""The features worker's capture backends: how one features job's sample becomes tensor bytes.

The worker (hidden_states/capture/features_worker.py) owns everything around a capture: claiming jobs, leases, memory
admission, the XADD to the collector's stream, finishing. A backend owns only "token ids in, the
last layer (and EAGLE-3's aux layers) out, as little-endian float16/bfloat16 bytes":

- ``http`` (this module): one prefill per sample on SGLang servers started with
  ``--enable-return-hidden-states`` (and one on an aux server, features.server.aux_urls), the
  JSON answers decoded in a process pool (hidden_states/capture/decode.py);
- ``transformers`` (hidden_states/capture/transformers_backend.py): the target loaded once in this process, samples
  packed into batches by token count, one forward pass with hooks on exactly the layers needed,
  tensors kept as tensors (no JSON anywhere);
- ``vllm`` (hidden_states/capture/vllm_backend.py): one prefill per sample on vLLM servers whose engine writes
  the layers to a file in features.store; the worker checks it and applies the final norm.

An in-process SGLang backend (its ModelRunner driven directly, as SpecForge's offline capture
does, for models too big for transformers) would be a third ``CaptureBackend``: ``capture``
queues a sample, a loop forms ScheduleBatch extends and splits the FULL-capture outputs by input
length. docs/hidden_states.md says what is missing to build it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context

import aiohttp

from budgetq.hidden_states.capture.captured import CaptureBackend, Captured, features_server
from budgetq.hidden_states.capture.decode import HiddenStatesError, decode
from budgetq.hidden_states.capture.synthetic_backend import SyntheticBackend
from budgetq.hidden_states.capture.transformers_backend import TransformersBackend
from budgetq.hidden_states.capture.vllm_backend import VllmBackend
from budgetq.hidden_states.schema import FeaturesPayload, wire_dtype
from budgetq.shared.config import Config
from budgetq.worker.sglang_client import HiddenStatesClient

# Before the first response: JSON bytes per token of a 4096-wide model (~11 characters a float).
FIRST_GUESS_JSON_BYTES_PER_TOKEN = 4096 * 11


class HttpBackend:
    """Prefills on SGLang servers, JSON decoded off the event loop (what budgetq did before backends)."""

    name = "http"

    def __init__(self, cfg: Config, decode_processes: int | None = None) -> None:
        self.cfg = cfg
        self.procs = cfg.features.decode_processes if decode_processes is None else decode_processes
        self.json_bytes_per_token = float(FIRST_GUESS_JSON_BYTES_PER_TOKEN)
        self.aux_urls = cfg.features.server.aux_urls
        self.decoders: ProcessPoolExecutor | None = None

    def new_decoders(self) -> None:
        """A fresh decode pool (also after a decode process died: BrokenProcessPool)."""
        old = self.decoders
        # spawn: a forked child of a process running an event loop and sockets inherits both.
        self.decoders = ProcessPoolExecutor(self.procs, mp_context=get_context("spawn"))
        if old is not None:
            old.shutdown(wait=False, cancel_futures=True)

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        if self.procs:  # 0: decode in this process (a plain rq worker's one job)
            self.new_decoders()
            # Start the decode processes now (a pool spawns them at first use, ~1 s each of imports).
            await asyncio.gather(*[loop.run_in_executor(self.decoders, int, 0) for _ in range(self.procs)])
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        self.client = HiddenStatesClient(self.session, features_server(self.cfg))
        self.aux_client = (HiddenStatesClient(self.session, self.cfg.server.model_copy(update={"urls": self.aux_urls}))
                           if self.aux_urls else None)

    def bytes_per_token(self) -> float:
        return self.json_bytes_per_token * (4 if self.aux_urls else 1)

    async def capture(self, payload: FeaturesPayload, job_id: str, hold: Callable[[int], None]) -> Captured:
        blob, shape, endpoint = await self._one(self.client, payload, job_id, hold, 0)
        if self.aux_client is None:
            return Captured(blob, shape, endpoint=endpoint)
        # The same prefill on a server returning EAGLE-3's aux layers (in place of the last layer).
        aux, aux_shape, _ = await self._one(self.aux_client, payload, job_id, hold, len(blob))
        if aux_shape[0] != shape[0]:
            raise HiddenStatesError(f"aux server returned {aux_shape[0]} rows, main server {shape[0]}")
        return Captured(blob, shape, aux, aux_shape, endpoint)

    async def _one(self, client: HiddenStatesClient, payload: FeaturesPayload, job_id: str,
                   hold: Callable[[int], None], kept: int) -> tuple[bytes, list[int], str]:
        """One prefill and its decode: (tensor bytes, shape, endpoint); ``kept`` bytes of this job are held already."""
        n = len(payload.input_ids)
        raw = await client.prefill_hidden_states(payload.input_ids, job_id)
        hold(kept + len(raw.body))
        if client is self.client:
            self.json_bytes_per_token = 0.8 * self.json_bytes_per_token + 0.2 * len(raw.body) / n
        blob, shape = await asyncio.get_running_loop().run_in_executor(
            self.decoders, decode, raw.body, n, wire_dtype(payload.dtype))
        hold(kept + len(blob))
        return blob, shape, raw.endpoint

    async def close(self) -> None:
        await self.client.close()
        if self.aux_client is not None:
            await self.aux_client.close()
        await self.session.close()
        if self.decoders is not None:
            self.decoders.shutdown(wait=False, cancel_futures=True)


def make_backend(cfg: Config, decode_processes: int | None = None) -> CaptureBackend:
    """The backend features.backend names (the transformers one imports torch when it starts)."""
    if cfg.features.backend == "transformers":
        return TransformersBackend(cfg)
    if cfg.features.backend == "vllm":
        return VllmBackend(cfg)
    if cfg.features.backend == "synthetic":  # tests and bench/features_store.py only: no model, made-up tensors
        return SyntheticBackend(cfg)
    return HttpBackend(cfg, decode_processes)
