"""The path every generation request takes, whatever the endpoint: faults, checks, engine, disconnects."""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import orjson
from aiohttp import web

from budgetq.simulator.faults import ERROR_MESSAGES, FaultInjector
from budgetq.simulator.lengths import LengthModel, draw_key
from budgetq.simulator.model import DONE, Engine, RequestRecord, SimSettings
from budgetq.simulator.texts import Script, estimate_tokens, shape_of

MATCHED_STOP = 2   # the EOS id the simulated model "stops" on
WAITING_ABORT = "Abort in waiting queue"
WEIGHT_VERSION = "default"   # SGLang's --weight-version default


class BadRequest(Exception):
    """Invalid input: 400 (SGLang answers validation errors with 400, not 422)."""

    def __init__(self, message: str, status: int = 400, kind: str = "validation") -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind


async def json_object(request: web.Request) -> dict:
    """The request's JSON body, which must be an object (SGLang answers 400 otherwise)."""
    try:
        body = await request.json()
    except ValueError as exc:
        raise BadRequest(f"invalid JSON body: {exc}") from exc
    if not isinstance(body, dict):
        raise BadRequest(f"the body must be a JSON object, got {type(body).__name__}")
    return body


@dataclass
class Item:
    """One prompt to generate for (a /generate batch has several)."""

    rid: str | None
    prompt_tokens: int
    max_new_tokens: int | None     # None: up to the context length (chat without max_tokens)
    endpoint: str
    input_ids_head: list[int] | None = None
    thinking: bool = True           # chat_template_kwargs.enable_thinking=false turns it off
    sampling: dict | None = None    # the effective sampling parameters, recorded for /sim/requests
    prompt: str | list[int] | None = None   # what the prefix cache matches (text or ids); None: no cache


class Runner:
    """Checks, fault dice and engine calls shared by /generate and the OpenAI routes."""

    def __init__(self, settings: SimSettings, engine: Engine, faults: FaultInjector) -> None:
        self.s = settings
        self.engine = engine
        self.faults = faults
        self.lengths = LengthModel(settings.seed, settings.length_mean, settings.length_sigma, settings.length_means)
        self._ticker = Ticker(settings.stream_interval_s)

    def injected_error(self) -> BadRequest | None:
        code = self.faults.error_status()
        if code is None:
            return None
        return BadRequest(ERROR_MESSAGES.get(code, f"simulated error {code}"), status=code, kind="injected")

    def prompt_item(self, rid: str | None, prompt: str | list[int], cap: int | None, endpoint: str) -> Item:
        """An Item for a text prompt or a list of token ids, after SGLang's context checks."""
        if isinstance(prompt, list):
            item = Item(rid, len(prompt), cap, endpoint, input_ids_head=prompt[:8], prompt=prompt)
        else:
            item = Item(rid, estimate_tokens(prompt), cap, endpoint, prompt=prompt)
        self.check_context(item)
        return item

    def check_context(self, item: Item) -> None:
        """SGLang's two context checks, with its messages (tokenizer_manager._validate_one_request):
        input >= context, then input + max_new_tokens > context."""
        ctx = self.faults.faults.context_length
        n = item.prompt_tokens
        if n >= ctx:
            self.faults.count("context_length")
            raise BadRequest(f"The input ({n} tokens) is longer than the model's context length ({ctx} tokens).",
                             kind="context_length")
        m = item.max_new_tokens
        if m is not None and n + m > ctx:
            self.faults.count("context_length")
            raise BadRequest(
                f"Requested token count exceeds the model's maximum context length of {ctx} tokens. You requested "
                f"a total of {n + m} tokens: {n} tokens from the input messages and {m} tokens for the completion. "
                f"Please reduce the number of tokens in the input messages or the completion to fit within the "
                f"limit.", kind="context_length")

    async def start(self, items: list[Item], drop: bool = True) -> list[RequestRecord]:
        """Latency spike, overload check, then queue every item in the engine."""
        spike = self.faults.spike_s()
        if spike:
            await asyncio.sleep(spike)
        seen: set[str] = set()
        for item in items:
            # tokenizer_manager: a rid still in rid_to_state (or twice in one batch) is refused.
            if item.rid is not None and (item.rid in self.engine.live_rids or item.rid in seen):
                self.faults.count("duplicate_rid")
                raise BadRequest(f"Duplicate request ID detected: {item.rid}", kind="duplicate_rid")
            if item.rid is not None:
                seen.add(item.rid)
        limit = self.s.max_queued_requests
        if limit is not None and self.engine.queued + len(items) > limit:
            # scheduler._abort_on_queued_limit: finish_reason abort with status 503 -> HTTPException.
            self.faults.count("overload")
            raise BadRequest("The request queue is full.", status=503, kind="overload")
        recs = []
        for i, item in enumerate(items):
            cap = item.max_new_tokens
            if cap is None:
                cap = self.faults.faults.context_length - item.prompt_tokens
            wanted = self.lengths.draw(item.rid)
            target = min(wanted, cap)
            frac = self.s.reasoning_tokens_frac if item.thinking else 0.0
            rid = item.rid or uuid.uuid4().hex
            key = draw_key(rid) if item.rid else rid
            # Whether it degenerates also depends on the request's sampling seed: a prompt sent again with
            # another seed (retry_discarded) is another draw, as on a real model; its length is not.
            sampling_seed = (item.sampling or {}).get("sampling_seed")
            shape = shape_of(self.s.seed, key if sampling_seed is None else f"{key}\x00{sampling_seed}", target,
                             self.s.loop_fraction, self.s.empty_fraction, self.s.unclosed_fraction)
            if shape.kind == "loop":
                target = cap   # the cycle goes on until max_tokens
            script = Script(self.s.seed, key, target, round(frac * wanted), shape, self.s.loop_period)
            finish = "length" if wanted >= cap or shape.kind == "loop" else "stop"
            rec = RequestRecord(rid, item.prompt_tokens, script.tokens, finish, item.endpoint, item.input_ids_head,
                                script.think)
            rec.script, rec.shape = script, shape.kind
            if shape.kind == "loop":
                rec.loop_onset = shape.onset
            rec.sampling = item.sampling
            cache = self.engine.prefix_cache
            if cache is not None and item.prompt is not None:
                rec.cached_tokens = cache.match_insert(item.prompt, item.prompt_tokens)
            # One connection per HTTP request: a drop is rolled once and cuts the first item.
            drop_at = self.faults.drop_at(target) if drop and i == 0 else None
            recs.append(self.engine.submit(rec, drop_at))
        return recs

    @contextlib.contextmanager
    def aborting(self, recs: list[RequestRecord], stream: bool = False) -> Iterator[None]:
        """If the block fails (a client disconnect cancels the handler), the requests are aborted
        when SGLang would notice the disconnect (Engine.disconnect), not at once."""
        try:
            yield
        except BaseException:
            for rec in recs:
                self.engine.disconnect(rec, stream)
            raise

    async def wait_all(self, recs: list[RequestRecord], request: web.Request) -> None:
        """Until all are done. A disconnect cancels us and aborts them; a drop cuts the connection."""
        with self.aborting(recs):
            for rec in recs:
                await self.engine.wait(rec)
                if rec.cut or rec.finish == "drop":
                    await drop_connection(request)

    async def progress(self, rec: RequestRecord) -> AsyncIterator[tuple[int, bool]]:
        """(tokens, final) as ``rec`` grows, at most one every stream interval; the final one last."""
        last = -1
        loop = asyncio.get_running_loop()
        interval = stream_interval(rec.sampling, self.s.stream_interval)
        while rec.state != DONE and not rec.cut:
            rec.waiter = loop.create_future()   # resolved by the next tick, or by the engine when rec ends
            self._ticker.add(rec.waiter)
            await rec.waiter
            if rec.state == DONE or rec.cut:
                break
            k = sent_at(self.engine.tokens_now(rec), interval)
            if k and k != last:
                rec.max_chunk_tokens = max(rec.max_chunk_tokens, k - max(last, 0))
                last = k
                yield k, False
        # A cut (drop fault) request is still running: the handler closes the connection now.
        yield (rec.completion_tokens if rec.state == DONE else self.engine.tokens_now(rec)), True

    async def progress_all(self, recs: list[RequestRecord]) -> AsyncIterator[tuple[int, int, bool]]:
        """(index, tokens, final) over several requests (a streamed batch), as they come."""
        if len(recs) == 1:
            async for k, final in self.progress(recs[0]):
                yield 0, k, final
            return
        queue: asyncio.Queue[tuple[int, int, bool]] = asyncio.Queue()

        async def pump(i: int, rec: RequestRecord) -> None:
            async for k, final in self.progress(rec):
                queue.put_nowait((i, k, final))

        tasks = [asyncio.create_task(pump(i, rec)) for i, rec in enumerate(recs)]
        left = len(recs)
        try:
            while left:
                event = await queue.get()
                left -= event[2]
                yield event
        finally:
            for t in tasks:
                t.cancel()


def stream_interval(sampling: dict | None, server: int) -> int:
    """A request's stream interval in tokens: its own sampling_params.stream_interval, else the server's."""
    own = (sampling or {}).get("stream_interval")
    return own if isinstance(own, int) and not isinstance(own, bool) and own > 0 else max(1, server)


def sent_at(tokens: int, interval: int) -> int:
    """The newest output a running request has sent by ``tokens``: SGLang's scheduler streams the first
    token at once, then whenever ``interval`` tokens are unsent (at one token a step: tokens 1, 1 + interval,
    1 + 2 x interval, ...; every token with interval 1) (scheduler_components/output_streamer.py ``accept``)."""
    if interval <= 1 or tokens < 1:
        return tokens
    return tokens - (tokens - 1) % interval


class Ticker:
    """One timer for every stream: each interval it wakes all streams waiting for their next chunk."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self._waiters: list[asyncio.Future] = []
        self._handle: asyncio.TimerHandle | None = None

    def add(self, waiter: asyncio.Future) -> None:
        self._waiters.append(waiter)
        if self._handle is None:
            self._handle = asyncio.get_running_loop().call_later(self.interval_s, self._fire)

    def _fire(self) -> None:
        self._handle = None
        waiters, self._waiters = self._waiters, []
        for w in waiters:
            if not w.done():
                w.set_result(None)


async def drop_connection(request: web.Request) -> None:
    """Close the TCP connection without an HTTP response; the server then cancels this handler."""
    if request.transport is not None:
        request.transport.abort()
    await asyncio.sleep(60)
    raise ConnectionResetError("connection dropped by the simulator")


DONE_EVENT = b"data: [DONE]\n\n"


def sse(obj: Any) -> bytes:
    """One server-sent event carrying a JSON object."""
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


async def close_sse(resp: web.StreamResponse) -> web.StreamResponse:
    await resp.write(DONE_EVENT)
    await resp.write_eof()
    return resp


def error_json(body: Any, status: int) -> web.Response:
    """An error answer as SGLang 0.5.23 writes every one: fastapi's ``ORJSONResponse`` (compact
    orjson bytes, ``Content-Type: application/json`` without a charset), from
    entrypoints/http_server.py's exception handlers and serving_base ``create_error_response``."""
    return web.Response(body=orjson.dumps(body), status=status, content_type="application/json")


async def open_sse(request: web.Request) -> web.StreamResponse:
    # Starlette's StreamingResponse(media_type="text/event-stream") adds the charset to a text/ type.
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8",
                                       "Cache-Control": "no-cache"})
    await resp.prepare(request)
    return resp


def opt_int(body: dict, *names: str, minimum: int = 0) -> int | None:
    """The first of ``names`` that is set, checked to be an integer >= minimum; None if none is."""
    for name in names:
        value = body.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise BadRequest(f"{name} must be an integer >= {minimum}, got {value!r}")
        return value
    return None


def finish_json(rec: RequestRecord, max_new_tokens: int | None) -> dict:
    """/generate's finish_reason object."""
    if rec.finish == "abort":
        if rec.abort_message == WAITING_ABORT:
            # tokenizer_manager._handle_abort_req: the scheduler never ran it; no status or type.
            return {"type": "abort", "message": WAITING_ABORT}
        # schedule_batch.FINISH_ABORT().to_json() for a running request.
        return {"type": "abort", "message": rec.abort_message, "status_code": None, "err_type": None}
    if rec.finish == "length":
        return {"type": "length", "length": max_new_tokens if max_new_tokens is not None else rec.completion_tokens}
    return {"type": "stop", "matched": MATCHED_STOP}
