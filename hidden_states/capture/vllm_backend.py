"""The ``vllm`` capture backend: prefills on vLLM servers whose engine writes the hidden states to a file.

A sample is one prefill-only ``POST /v1/completions`` (the conversation's token ids as the prompt,
``max_tokens: 1``, greedy) naming, in ``kv_transfer_params.hidden_states_path``, a file under the dataset's
``incoming/`` directory in features.store. The server (started with ``budgetq features --server-flags``:
vllm_layout.py says what it writes) answers once the request is done, with that path in its
``kv_transfer_params``; the engine may still be writing the file then, and holds an exclusive flock on
``<file>.lock`` until it is written (``ExampleHiddenStatesConnector.wait_for_save`` takes it before the
answer can leave, ``_write_tensors`` releases it), so the worker waits for a shared lock on it.

Then the worker checks the file (its token ids are the request's, one row per token, the layers and hidden
size expected, every value finite), takes the aux layers as they are, applies the final norm to the last
layer for the target, and hands the worker the same tensors as the other backends (``hidden_state``
``[tokens, H]``, ``aux_hidden_state`` ``[tokens, 3H]``, features.dtype). The worker writes them as a shard
of the store and only then removes the engine's file (``Captured.raw_files``); a job that fails removes it
at once. Why not make the engine's file the shard: it holds the last layer before the norm, the layers
interleaved per token and no loss mask, so a shard would need every reader (export, check, SpecForge's
loader) to learn a second layout and the norm; rewriting it costs one read and one write of the sample.
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import logging
import os
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import aiohttp
import numpy as np

from budgetq.hidden_states.capture.captured import Captured, features_server
from budgetq.hidden_states.capture.decode import HiddenStatesError, to_dtype
from budgetq.hidden_states.capture.vllm_layout import FinalNorm, VllmLayout, as_f32, layout_for, load_final_norm
from budgetq.hidden_states.schema import FeaturesPayload, wire_dtype
from budgetq.hidden_states.store import fault_points
from budgetq.hidden_states.store.safetensors_io import ShardError, read_header, read_tensor
from budgetq.hidden_states.store.shards import INCOMING, features_dir, features_root
from budgetq.shared.config import Config, ServerConfig
from budgetq.shared.config_features import ENGINE_DIR
from budgetq.shared.identity import encode_id
from budgetq.worker.sglang_client import HiddenStatesClient

log = logging.getLogger("budgetq.features")
LOCK_POLL_S = 0.02
FLOAT_DTYPES = ("F32", "F16", "BF16")           # what vllm_layout.as_f32 reads
TOKEN_DTYPES = {"I64": "<i8", "I32": "<i4"}


def prefill_request(server: ServerConfig, input_ids: list[int], path: str) -> dict:
    """The body of the prefill: the token ids as the prompt, one greedy token, the file to write."""
    return {"model": server.model, "prompt": input_ids, "max_tokens": 1, "temperature": 0.0,
            "kv_transfer_params": {"hidden_states_path": path}}


async def wait_written(path: str, wait_s: float) -> None:
    """Until the engine has written ``path``: a shared flock on ``path.lock`` (the engine holds it exclusively
    while it writes); without a lock file, until the file is whole (its header's data end is its size)."""
    deadline = time.monotonic() + wait_s
    lock = path + ".lock"
    while True:
        if os.path.exists(lock):
            fd = os.open(lock, os.O_RDONLY)
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                pass
            except OSError:    # a volume without working locks (ENOLCK): whole by its size, then
                if _whole(path):
                    return
            finally:
                os.close(fd)   # releases a lock taken: the file is whole, nobody writes it again
        elif _whole(path):
            return
        if time.monotonic() > deadline:
            raise HiddenStatesError(f"the engine had not finished writing {path} after {wait_s:.0f} s "
                                    "(features.vllm.file_wait_s)")
        await asyncio.sleep(LOCK_POLL_S)


def _whole(path: str) -> bool:
    try:
        header, start = read_header(Path(path))
        end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
        return os.path.getsize(path) >= start + end
    except (ShardError, OSError, KeyError, TypeError, ValueError):
        return False


def read_engine_file(path: str, payload: FeaturesPayload, layout: VllmLayout, norm: FinalNorm) -> Captured:
    """The engine's file, checked, as the target (normed last layer) and the aux layers in features.dtype."""
    p = Path(path)
    try:
        header, start = read_header(p)
        hs = read_tensor(p, "hidden_states", header, start)
        tok = read_tensor(p, "token_ids", header, start)
    except ShardError as exc:
        raise HiddenStatesError(f"the engine's file is not readable: {exc}") from None
    n, want = len(payload.input_ids), [len(payload.input_ids), len(layout.layer_ids), layout.hidden]
    ids = token_ids(tok.dtype, tok.data)
    if ids.tolist() != payload.input_ids:
        raise HiddenStatesError(f"the engine's file holds {len(ids)} token ids that are not the request's {n} "
                                "(another request's file?)")
    if hs.shape != want:
        raise HiddenStatesError(f"the engine's file holds hidden_states {hs.shape}, expected {want} ([tokens, "
                                f"layers {layout.layer_ids}, hidden]): start the server with `budgetq features "
                                "--server-flags` for this model")
    # On the job's error path (HiddenStatesError): the job fails once, saying why, instead of going back to
    # its lease at every attempt with an exception no one catches.
    if hs.dtype not in FLOAT_DTYPES:
        raise HiddenStatesError(f"the engine's file holds hidden_states of dtype {hs.dtype}, not one of "
                                f"{', '.join(FLOAT_DTYPES)} (the server's --dtype)")
    x = as_f32(hs.dtype, hs.data, hs.shape)
    if not np.isfinite(x).all():
        raise HiddenStatesError("hidden states hold NaN or inf")
    dtype = wire_dtype(payload.dtype)
    target = norm(x[:, layout.position(layout.target_id), :])
    data = to_dtype(target, dtype)
    aux = aux_shape = None
    if layout.aux:
        cols = [x[:, layout.position(i), :] for i in layout.aux_ids]
        aux, aux_shape = to_dtype(np.concatenate(cols, axis=-1), dtype), [n, len(cols) * layout.hidden]
    return Captured(data, [n, layout.hidden], aux, aux_shape, raw_files=[path, path + ".lock"])


def token_ids(dtype: str, data: bytes | memoryview) -> np.ndarray:
    """An engine file's ``token_ids``; HiddenStatesError for a dtype that is not an integer one it writes."""
    if dtype not in TOKEN_DTYPES:
        raise HiddenStatesError(f"the engine's file holds token_ids of dtype {dtype}, not one of "
                                f"{', '.join(TOKEN_DTYPES)}")
    return np.frombuffer(data, TOKEN_DTYPES[dtype])


def generation_sample(path: str, payload: FeaturesPayload) -> FeaturesPayload:
    """The sample an engine file of a generation request holds: ``payload`` cut to the file's tokens.

    Its tokens are the prompt as the server rendered it and the answer's tokens as sampled, but the last one
    (it never went through the model). Re-rendering the row with the chat template gives ``payload.input_ids``:
    the same prompt, the answer's text re-tokenized, then the end-of-turn tokens. Where the file's tokens are a
    prefix of those and reach into the answer, the sample is that prefix, its loss span cut to it (what is cut
    is the end-of-turn marker, whose next token nothing trains on); otherwise (a template or a re-tokenization
    that differs) the file is refused, and the row is prefilled as usual."""
    try:
        header, start = read_header(Path(path))
        tok = read_tensor(Path(path), "token_ids", header, start)
    except ShardError as exc:
        raise HiddenStatesError(f"not readable: {exc}") from None
    ids = token_ids(tok.dtype, tok.data).tolist()
    want = payload.input_ids
    if len(ids) > len(want) or ids != want[: len(ids)]:
        at = next((i for i, (a, b) in enumerate(zip(ids, want, strict=False)) if a != b), min(len(ids), len(want)))
        raise HiddenStatesError(f"its {len(ids)} token ids differ from the chat template's {len(want)} at "
                                f"position {at}")
    if len(ids) <= payload.loss_start:
        raise HiddenStatesError(f"its {len(ids)} token ids end before the answer (token {payload.loss_start})")
    return payload.model_copy(update={"input_ids": ids, "loss_end": min(payload.loss_end, len(ids)),
                                      "engine_file": None})


def mid_request_trace() -> aiohttp.TraceConfig:
    """Tests only (``BUDGETQ_FAULT_POINT=vllm-mid-request``): the fault point between a prefill's body sent and
    its answer read. aiohttp tells a chunk *before* it writes it, so the point is reached at the event loop's
    next turn, once the body is in the socket (a write is tried at once) and before any answer can be read."""
    async def sent(_session: aiohttp.ClientSession, _ctx: object, params: aiohttp.TraceRequestChunkSentParams) -> None:
        if params.method == "POST" and params.url.path == "/v1/completions":
            asyncio.get_running_loop().call_soon(fault_points.reached, fault_points.VLLM_MID_REQUEST)

    trace = aiohttp.TraceConfig()
    trace.on_request_chunk_sent.append(sent)
    return trace


class VllmBackend:
    name = "vllm"

    def __init__(self, cfg: Config) -> None:
        assert cfg.features.model is not None and cfg.features.store is not None  # the config validator says so
        self.cfg = cfg
        self.model_dir = Path(cfg.features.model.path)
        self.root = features_root(cfg)

    async def start(self) -> None:
        self.layout = layout_for(self.model_dir, self.cfg.features.model.aux_layers if self.cfg.features.model
                                 else None)
        self.norm = await asyncio.to_thread(load_final_norm, self.model_dir, self.layout.hidden)
        self.server = features_server(self.cfg)
        traces = [mid_request_trace()] if os.environ.get(fault_points.ENV) else []
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), trace_configs=traces)
        self.client = HiddenStatesClient(self.session, self.server)
        log.info("features: vllm backend, layers %s of %s (aux %s, target %d normed here: %s), files in %s",
                 self.layout.layer_ids, self.model_dir, self.layout.aux_ids, self.layout.target_id, self.norm.kind,
                 self.root)

    def bytes_per_token(self) -> float:
        # the engine's file read as float32 (layers x hidden x 4), plus the bytes kept (2 a value)
        n = len(self.layout.layer_ids)
        return self.layout.hidden * (4.0 * n + 2.0 * (1 + len(self.layout.aux)))

    async def capture(self, payload: FeaturesPayload, job_id: str, hold: Callable[[int], None]) -> Captured:
        if payload.engine_file is not None:
            got = await self._from_generation(payload, payload.engine_file)
            if got is not None:
                return got
        incoming = features_dir(self.root, payload.dataset) / INCOMING
        path = str(incoming / f"{encode_id(payload.id)}.{uuid.uuid4().hex[:8]}.vllm.safetensors")
        written = [path]
        try:
            raw = await self.client.post_raw("/v1/completions", prefill_request(self.server, payload.input_ids, path),
                                             job_id)
            try:
                got_path = json.loads(raw.body)["kv_transfer_params"]["hidden_states_path"]
            except (ValueError, KeyError, TypeError):
                raise HiddenStatesError(f"{raw.endpoint}: the answer has no kv_transfer_params.hidden_states_path: "
                                        "start the server with `budgetq features --server-flags`") from None
            if got_path != path:
                written.append(str(got_path))
                log.warning("%s wrote %s, not the file asked for: start it with allow_custom_save_path (`budgetq "
                            "features --server-flags`)", raw.endpoint, got_path)
            await wait_written(str(got_path), self.cfg.features.vllm.file_wait_s)
            got = await asyncio.to_thread(read_engine_file, str(got_path), payload, self.layout, self.norm)
        except BaseException:
            for f in written:
                Captured(b"", [], raw_files=[f, f + ".lock"]).remove_raw_files()
            raise
        got.endpoint = raw.endpoint
        if got_path != path:
            got.raw_files += [path, path + ".lock"]
        return got

    async def _from_generation(self, payload: FeaturesPayload, path: str) -> Captured | None:
        """features.vllm.single_pass: the file the engine wrote during the row's generation request, as the sample;
        None (and the file removed) where it cannot be used, and the caller prefills as without single_pass.
        Only a file in the dataset's engine folder is read (or removed): a row names it, and rows can be edited."""
        engine = (features_dir(self.root, payload.dataset) / ENGINE_DIR).resolve()
        if Path(path).resolve().parent != engine:
            log.warning("features %s: row %r names %s, which is not in %s: prefilling it", payload.dataset,
                        payload.id, path, engine)
            return None
        try:
            await wait_written(path, self.cfg.features.vllm.file_wait_s)
            stored = await asyncio.to_thread(generation_sample, path, payload)
            got = await asyncio.to_thread(read_engine_file, path, stored, self.layout, self.norm)
        except (HiddenStatesError, OSError) as exc:
            log.info("features %s: row %r: its generation request's file is of no use (%s): prefilling it",
                     payload.dataset, payload.id, exc)
            Captured(b"", [], raw_files=[path, path + ".lock"]).remove_raw_files()
            return None
        got.payload, got.endpoint = stored, "generation"
        return got

    async def close(self) -> None:
        if hasattr(self, "client"):
            await self.client.close()
            await self.session.close()
