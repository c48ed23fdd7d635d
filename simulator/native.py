"""POST /generate, SGLang's native API: text or input_ids, a list of them is a batch (JSON list back)."""

from __future__ import annotations

import time
import uuid
from typing import Any

import orjson
from aiohttp import web

from budgetq.simulator import hidden
from budgetq.simulator.model import RequestRecord, SimSettings
from budgetq.simulator.runner import (
    WAITING_ABORT,
    WEIGHT_VERSION,
    BadRequest,
    Runner,
    close_sse,
    drop_connection,
    error_json,
    finish_json,
    json_object,
    open_sse,
    opt_int,
    sse,
)
from budgetq.simulator.sampling import SamplingError, check_contract, verify

# Bodies of /generate errors, by where SGLang raises them (entrypoints/http_server.py):
# the JSON contract gate -> {"error": "<text>"}; a ValueError -> _create_error_response
# {"error": {"message"}}; an HTTPException (queue full: 503) -> the flat ErrorResponse with
# type str(status). Each is an ORJSONResponse: compact bytes, application/json (runner.error_json).


def native_error(exc: BadRequest) -> web.Response:
    if exc.kind == "contract":
        return error_json({"error": exc.message}, exc.status)
    if exc.kind == "overload":
        return error_json({"object": "error", "message": exc.message, "type": str(exc.status), "param": None,
                           "code": exc.status}, exc.status)
    return error_json({"error": {"message": exc.message}}, exc.status)


async def stream_error(request: web.Request, exc: BadRequest) -> web.StreamResponse:
    """A ValueError of a streamed /generate comes after the 200: one error event, then [DONE]."""
    resp = await open_sse(request)
    await resp.write(sse({"error": {"message": exc.message, "type": "invalid_request_error", "code": exc.status,
                                    "retryable": False}}))
    return await close_sse(resp)


async def stream_overload(request: web.Request, exc: BadRequest, rids: list, batch: bool) -> web.StreamResponse:
    """Queue full on a streamed /generate: SGLang has already answered 200, so the scheduler's abort
    (finish_reason with status_code 503) comes as the stream's one chunk, then [DONE]
    (tokenizer_manager ``_handle_abort_req`` builds its meta_info; ``_handle_abort_finish_reason``
    passes it through for a stream instead of raising; the finished path adds the sent time)."""
    resp = await open_sse(request)
    now = time.time()
    for i, rid in enumerate(rids):
        out: dict[str, Any] = {"text": "", "output_ids": [], "meta_info": {
            "id": rid or "", "finish_reason": {"type": "abort", "status_code": exc.status, "message": exc.message},
            "weight_version": WEIGHT_VERSION, "e2e_latency": 0.0, "completion_tokens": 0,
            "response_sent_to_client_ts": now}}
        if batch:
            out["index"] = i
        await resp.write(b"data: " + orjson.dumps(out) + b"\n\n")
    return await close_sse(resp)


def _inputs(body: dict) -> tuple[list[str | list[int]], bool]:
    """(inputs, is_batch) from ``input_ids`` (preferred, as SGLang tokenizes nothing then) or ``text``."""
    ids = body.get("input_ids")
    if ids is not None:
        if isinstance(ids, list) and ids and all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            return [ids], False
        if isinstance(ids, list) and ids and all(isinstance(x, list) and x and all(isinstance(t, int) for t in x)
                                                 for x in ids):
            return list(ids), True
        raise BadRequest("input_ids must be a non-empty list of token ids or a list of such lists")
    text = body.get("text")
    if isinstance(text, str):
        return [text], False
    if isinstance(text, list) and text and all(isinstance(t, str) for t in text):
        return list(text), True
    if text is None:
        raise BadRequest("Either text, input_ids or input_embeds should be provided.")
    raise BadRequest("text must be a string or a non-empty list of strings")


def _per_item(value: object, n: int, name: str, kind: type) -> list:
    """A per-request field of a batch: one value for all, or a list with one per input."""
    if isinstance(value, list):
        if len(value) != n:
            raise BadRequest(f"{name} has {len(value)} entries for a batch of {n}")
        values = value
    else:
        values = [value] * n
    for v in values:
        if v is not None and not isinstance(v, kind):
            raise BadRequest(f"{name} must be a {kind.__name__}, got {v!r}")
    return values


class NativeRoutes:
    def __init__(self, settings: SimSettings, runner: Runner) -> None:
        self.s = settings
        self.runner = runner

    async def generate(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await json_object(request)
            inputs, batch = _inputs(body)
            n = len(inputs)
            rids = _per_item(body.get("rid"), n, "rid", str)
            if not batch and isinstance(body.get("rid"), list):
                raise BadRequest("rid must be a string for a single input")
            sps = _per_item(body.get("sampling_params"), n, "sampling_params", dict)
            # The JSON contract gate decodes the body's fields in their order: the first violation wins.
            for key in body:
                if key == "sampling_params":
                    try:
                        for sp in sps:
                            check_contract(sp or {})
                    except SamplingError as exc:
                        raise BadRequest(str(exc), kind="contract") from exc
                elif key == "return_hidden_states":
                    hidden.check_contract(body[key])
            modes = hidden.request_modes(body, n, self.s.return_hidden_states_mode)
            parallel = _parallel_sample_num(sps)
            if (err := self.runner.injected_error()) is not None:
                raise err
        except BadRequest as exc:
            return native_error(exc)
        try:
            if parallel > 1:
                await self._prefill_once(inputs)
                # Expanded prompt-major, each with a fresh rid: the client's rid names none of them.
                inputs = [inp for inp in inputs for _ in range(parallel)]
                sps = [_child_params(sp or {}, j) for sp in sps for j in range(parallel)]
                rids = [uuid.uuid4().hex for _ in inputs]
                modes = [m for m in modes for _ in range(parallel)]
                batch = True
            items, caps = [], []
            for inp, rid, sp in zip(inputs, rids, sps, strict=True):
                sp = sp or {}
                cap = opt_int(sp, "max_new_tokens")
                cap = 128 if cap is None else cap
                item = self.runner.prompt_item(rid, inp, cap, "generate")
                try:
                    verify(sp)
                except SamplingError as exc:
                    raise BadRequest(str(exc), kind="sampling") from exc
                item.sampling = sp
                items.append(item)
                caps.append(cap)
            recs = await self.runner.start(items)
        except BadRequest as exc:
            if body.get("stream") and exc.kind == "overload":
                return await stream_overload(request, exc, rids, batch)
            if body.get("stream") and exc.status == 400:
                return await stream_error(request, exc)
            return native_error(exc)
        if body.get("stream"):
            return await self._stream(request, recs, caps, batch)
        await self.runner.wait_all(recs, request)
        outs = [_output(r, r.completion_tokens, cap, final=True) for r, cap in zip(recs, caps, strict=True)]
        if any(modes):
            return self._with_hidden_states(outs, inputs, modes, batch)
        return web.json_response(outs if batch else outs[0])

    async def _prefill_once(self, inputs: list[str | list[int]]) -> None:
        """SGLang's parallel sampling (tokenizer_manager ``_handle_batch_request``, n > 1) first sends each
        prompt once with max_new_tokens 0 and waits for it, so the radix cache holds the prompt before its n
        samples are sent: the samples' prefill is a cache hit, as N requests to one server would be."""
        warm = [self.runner.prompt_item(uuid.uuid4().hex, inp, 0, "generate") for inp in inputs]
        for rec in await self.runner.start(warm, drop=False):
            await self.runner.engine.wait(rec)

    def _with_hidden_states(self, outs: list[dict], inputs: list[str | list[int]], modes: list[str | None],
                            batch: bool) -> web.Response:
        """meta_info.hidden_states on the final answer (simulator/hidden.py says what SGLang returns); orjson
        writes the numpy rows, as SGLang's ORJSONResponse writes its lists (json.dumps would take seconds)."""
        for out, inp, mode in zip(outs, inputs, modes, strict=True):
            if mode is None:
                continue
            prompt = inp if isinstance(inp, list) else [0] * max(1, out["meta_info"].get("prompt_tokens", 1))
            out["meta_info"]["hidden_states"] = hidden.hidden_states(mode, prompt, out["output_ids"],
                                                                     self.s.hidden_size, self.s.aux_layers)
        body = orjson.dumps(outs if batch else outs[0], option=orjson.OPT_SERIALIZE_NUMPY)
        return web.Response(body=body, content_type="application/json")

    async def _stream(self, request: web.Request, recs: list[RequestRecord], caps: list[int],
                      batch: bool) -> web.StreamResponse:
        incremental = self.s.incremental_streaming_output
        sent = [0] * len(recs)   # tokens already sent per request (incremental output)
        try:
            with self.runner.aborting(recs, stream=True):
                resp = await open_sse(request)
                async for i, k, final in self.runner.progress_all(recs):
                    if final and (recs[i].cut or recs[i].finish == "drop"):
                        await drop_connection(request)
                    # Cumulative (SGLang's default): text and output_ids so far in every chunk. Incremental
                    # (--incremental-streaming-output): only what is new since the last chunk, the ones that
                    # piled up meanwhile joined (tokenizer_manager ``_coalesce_streaming_chunks``); meta_info's
                    # counts stay cumulative either way.
                    out = _output(recs[i], k, caps[i], final, since=sent[i] if incremental else 0)
                    sent[i] = k
                    if batch:
                        out["index"] = i
                    await resp.write(sse(out))
                return await close_sse(resp)
        except ConnectionResetError:
            # The client went away mid-stream (its requests aborted when SGLang would notice): nothing
            # more to write, and no error to log, as SGLang logs none.
            return web.Response(status=499)


def _parallel_sample_num(sps: list[dict | None]) -> int:
    """``n`` of a request (GenerateReqInput ``normalize_batch_and_arguments``): the same in every item."""
    ns = [(sp or {}).get("n", 1) for sp in sps]
    if any(v != ns[0] for v in ns):
        raise BadRequest("The parallel_sample_num should be the same for all samples in sample params.")
    return ns[0] if isinstance(ns[0], int) else 1


def _child_params(sp: dict, j: int) -> dict:
    """Sample j's parameters (tokenizer_manager ``_seed_for_parallel_sample``): a seeded request's sample j
    is seeded seed + j, so the n samples differ; an unseeded one stays unseeded."""
    child = {k: v for k, v in sp.items() if k != "n"}
    if isinstance(child.get("sampling_seed"), int):
        child["sampling_seed"] += j
    return child


def _output(rec: RequestRecord, tokens: int, cap: int, final: bool, since: int = 0) -> dict:
    """One /generate answer or stream chunk: the text and output_ids of tokens [since, tokens)."""
    # /generate returns the raw text, thinking inline, whatever the reasoning parser.
    now = time.time()
    end = rec.finished if final and rec.finished is not None else now
    script = rec.script
    assert script is not None
    text = script.inline(tokens)[len(script.inline(since)):] if since else script.inline(tokens)
    ids = script.output_ids(since, tokens)
    if final and rec.finish == "abort" and rec.abort_message == WAITING_ABORT:
        # tokenizer_manager._handle_abort_req builds this shorter meta_info.
        return {"text": text, "output_ids": ids,
                "meta_info": {"id": rec.rid, "finish_reason": finish_json(rec, cap), "weight_version": WEIGHT_VERSION,
                              "e2e_latency": end - rec.arrived, "completion_tokens": tokens}}
    # tokenizer_manager._handle_batch_output's keys, in its order. dp_rank is there with one DP rank
    # too: the scheduler's output (output_streamer.py ``to_payload``) carries [dp_rank] * n, a
    # non-empty list, so ``meta_info["dp_rank"]`` is set (0 here; hidden_states, when asked, come
    # before it on SGLang and after it here).
    meta: dict[str, Any] = {"id": rec.rid, "finish_reason": finish_json(rec, cap) if final else None,
            "prompt_tokens": rec.prompt_tokens, "weight_version": WEIGHT_VERSION, "num_retractions": 0,
            "reasoning_tokens": min(tokens, rec.reasoning_target), "completion_tokens": tokens,
            "cached_tokens": rec.cached_tokens, "dp_rank": 0}
    if final:
        meta["e2e_latency"] = end - rec.arrived
        meta["response_sent_to_client_ts"] = now
    return {"text": text, "output_ids": ids, "meta_info": meta}
