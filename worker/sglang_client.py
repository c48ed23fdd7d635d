"""The one HTTP client for SGLang or any OpenAI-style server (aiohttp): chat or native /generate,
retries, several endpoints, faults counted by reason (shared/server_faults.py).

What goes over the wire (rids, bodies, reading a response) is worker/sglang_wire.py."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import TypeVar

import aiohttp

from budgetq.shared import server_faults, server_kind
from budgetq.shared.config import ServerConfig
from budgetq.shared.errors import (
    AbortedResponseError,
    BadResponseError,
    ConfigError,
    DuplicateRidError,
    FatalRequestError,
    RetryableRequestError,
)
from budgetq.shared.retry import backoff_s
from budgetq.shared.schema import JobPayload
from budgetq.worker.endpoints import Endpoint, EndpointPool, ask_kind, routing_key
from budgetq.worker.sglang_stream import WATCH, NoStreamUsage, SSEParser, StreamCut, StreamDecoder, verdict_details
from budgetq.worker.sglang_wire import (
    RETRYABLE_STATUS,
    Completion,
    RawResponse,
    attempt_rid,
    build_request,
    error_message,
    invalid_request,
    parse_response,
    prefill_body,
)

log = logging.getLogger("budgetq.worker")
# Datasets already warned that single_pass samples wrongly above temperature 0 on vLLM's CPU build (once each).
_WARNED_SAMPLING: set[str] = set()
T = TypeVar("T")
# SGLang keeps a request's rid until it notices the client left (a non-streaming request: at
# its next state-wait poll, ~4 s); a second request with that rid is a 400 with this text
# (managers/tokenizer_manager.py). Fresh rids per attempt avoid it; if it still happens (a
# nonce collision, a router replaying), the request is retried with a new rid.
_DUPLICATE_RID = "Duplicate request ID"
# /abort_request is best effort: a short timeout, and its failure changes nothing.
_ABORT_TIMEOUT = aiohttp.ClientTimeout(total=5.0)
# The servers that get the attempt's rid as X-Request-Id (``_post``).
_RID_HEADER_KINDS = (server_kind.SGLANG, server_kind.VLLM)
# The servers asked for the usage on every chunk (stream_options.continuous_usage_stats): exact tokens so
# far. Others may refuse an unknown field; they get the final usage chunk only (include_usage).
_CONTINUOUS_USAGE_KINDS = (server_kind.SGLANG, server_kind.VLLM)


class SGLangClient:
    """Sends one prompt to the least-busy healthy endpoint, retrying transient failures.

    Each attempt has its own rid (``attempt_rid``). When an attempt is given up while the
    server may still run it (the job was cancelled, the client timed out, the connection
    dropped), the client also POSTs ``/abort_request`` for that rid: SGLang notices a
    non-streaming client's disconnect only at its next ~4 s poll and generates until then.
    """

    def __init__(self, session: aiohttp.ClientSession, server: ServerConfig,
                 on_retry: Callable[[str], None] | None = None) -> None:
        self._session = session
        self._server = server
        self._headers = {"Content-Type": "application/json"}
        if server.api_key:
            self._headers["Authorization"] = f"Bearer {server.api_key}"
        self.pool = EndpointPool(server, session, self._headers)
        self._timeout = aiohttp.ClientTimeout(total=server.timeout_s, sock_connect=server.connect_timeout_s)
        self._on_retry = on_retry
        self._aborts: set[asyncio.Task] = set()
        self.aborts_sent = 0
        # Endpoints whose streams carry no token counts (llama-cpp-python's server ignores stream_options):
        # their requests go unstreamed, said once per endpoint.
        self._unstreamed: set[str] = set()

    @property
    def model(self) -> str:
        """The model name of a request to an endpoint not asked yet (each endpoint's own: ``Endpoint.model``)."""
        return self._server.model or server_kind.SGLANG_MODEL

    @property
    def server(self) -> ServerConfig:
        return self._server

    async def close(self) -> None:
        """Let pending /abort_request calls finish (bounded by their timeout), stop health probes."""
        if self._aborts:
            await asyncio.wait(list(self._aborts), timeout=_ABORT_TIMEOUT.total)
        await self.pool.close()

    def _abort_later(self, ep: Endpoint, rid: str, always: bool = False) -> None:
        """Ask the server to stop ``rid`` now, in the background (never blocks a cancellation).
        ``always``: also with ``abort_on_cancel`` off (a guard's cut: the answer is thrown away)."""
        if not (self._server.abort_on_cancel or always) or ep.sglang is False:  # /abort_request is SGLang's own
            return
        task = asyncio.get_running_loop().create_task(self._abort(ep, rid))
        self._aborts.add(task)
        task.add_done_callback(self._aborts.discard)

    async def _abort(self, ep: Endpoint, rid: str) -> None:
        try:
            async with self._session.post(ep.url + "/abort_request", json={"rid": rid}, headers=self._headers,
                                          timeout=_ABORT_TIMEOUT) as resp:
                await resp.read()
            self.aborts_sent += 1
        except (aiohttp.ClientError, TimeoutError) as exc:
            log.debug("abort of %s at %s failed: %s", rid, ep.url, exc)

    async def _post(self, ep: Endpoint, path: str, body: dict, rid: str,
                    read: Callable[[aiohttp.ClientResponse, float], Awaitable[T]]) -> T:
        """One POST to ``ep``, counted in its requests in flight, its answer read by ``read``.

        A transport failure is retryable; one that may have reached the server (a timeout, a
        dropped connection, a cancellation) also asks the server to abort ``rid``.

        ``rid`` also goes as ``X-Request-Id`` to vLLM, which makes it its request id (``chatcmpl-<rid>``
        in its log, its aborts and the answer's id: entrypoints/serve/engine/serving.py
        ``_base_request_id``), and to SGLang, which reads no such header (a router or proxy in front
        may log it). Not to another OpenAI-style server: llama-cpp-python's answers 400 to one that
        is not a UUID (starlette_context's RequestIdPlugin validates it), a gateway may do the same.
        """
        ep.in_flight += 1
        ep.requests += 1
        started = time.monotonic()
        headers = {**self._headers, "X-Request-Id": rid} if ep.kind in _RID_HEADER_KINDS or path == "/generate" \
            else self._headers   # /generate is SGLang's own route
        try:
            async with self._session.post(ep.url + path, json=body, headers=headers, timeout=self._timeout) as resp:
                return await read(resp, started)
        except aiohttp.ClientConnectorError as exc:  # never reached the server: nothing to abort
            self.pool.fault(ep, server_faults.transport_reason(exc), str(exc))
            raise RetryableRequestError(f"{ep.url}{path}: {type(exc).__name__}: {exc}") from exc
        except (TimeoutError, aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as exc:
            self.pool.fault(ep, server_faults.transport_reason(exc), str(exc))
            self._abort_later(ep, rid)
            raise RetryableRequestError(f"{ep.url}{path}: {type(exc).__name__}: {exc}") from exc
        except asyncio.CancelledError:
            self._abort_later(ep, rid)
            raise
        finally:
            ep.in_flight -= 1

    async def _once(self, ep: Endpoint, payload: JobPayload, rid: str) -> Completion:
        # Unknown (its /server_info gives no answer, e.g. a proxy's 5xx): only standard fields, as to
        # any OpenAI-style server; an SGLang-only value such a server refuses would fail the prompt.
        try:
            kind = await self.pool.detect(ep)
        except ConfigError as exc:  # several models and no server.model: no request can be right
            raise FatalRequestError(str(exc)) from None
        model = ep.model or self.model
        if payload.hidden_states_dir is not None and payload.dataset not in _WARNED_SAMPLING \
                and payload.sampling.temperature != 0:
            _WARNED_SAMPLING.add(payload.dataset)
            log.warning("dataset %s: features.vllm.single_pass at temperature %s: vLLM's CPU build samples garbage "
                        "with extract_hidden_states above 0 (docs/vllm.md); its GPU build samples right",
                        payload.dataset, payload.sampling.temperature)
        # features.vllm.single_pass reads kv_transfer_params off the one JSON answer: never streamed.
        stream = self._server.stream and payload.hidden_states_dir is None and ep.url not in self._unstreamed
        path, body = build_request(self._server, payload, rid, sglang=kind == server_kind.SGLANG, model=model,
                                   stream=stream, continuous_usage=kind in _CONTINUOUS_USAGE_KINDS)

        async def read(resp: aiohttp.ClientResponse, started: float) -> Completion:
            if stream and resp.status == 200 and (resp.content_type or "").startswith("text/event-stream"):
                return await self._read_stream(ep, path, resp, started, model, rid, kind == server_kind.SGLANG)
            # An error status, or a server that answered a stream request with one JSON body: read as such.
            try:
                data = await resp.json(content_type=None)
            except ValueError:
                data = await resp.text()
            return replace(self._read(ep, path, resp.status, data, started, resp.content_type), model=model)

        try:
            return await self._post(ep, path, body, rid, read)
        except NoStreamUsage:
            # The answer came whole but uncounted: the same request again, unstreamed, is counted exactly
            # (the server held no state for the finished stream). Its tokens are generated twice, once.
            self._unstreamed.add(ep.url)
            log.warning("%s streams answers without token counts (%s): its requests are no longer streamed (no loop "
                        "guard, no tokens so far for the end game); set server.stream: false for it", ep.url,
                        "no usage chunk for stream_options.include_usage")
            return await self._once(ep, payload, rid)

    async def _read_stream(self, ep: Endpoint, path: str, resp: aiohttp.ClientResponse, started: float,
                           model: str, rid: str, sglang: bool) -> Completion:
        """A streamed answer (worker/sglang_stream.py), chunk by chunk as the socket gives them.

        The job's ``Watch`` sees the tokens so far after every read and feeds its guard each chunk's
        new text; a verdict ends the request at the engine at once (SGLang: /abort_request for the rid,
        which stops it within a scheduler step; every server: the connection is dropped, which vLLM
        and llama.cpp take as an abort) and the answer so far comes back marked ``discard``.
        """
        watch = WATCH.get()
        guard = watch.guard() if watch is not None and watch.guard is not None else None
        progress = watch.on_progress if watch is not None else None
        dec = StreamDecoder(self._server.api, ep.url, started, model,
                            on_delta=guard.feed if guard is not None else None)
        parser = SSEParser()
        try:
            async for chunk in resp.content.iter_any():
                events = parser.feed(chunk)
                if not events:
                    continue
                dec.feed(events)
                if progress is not None:
                    progress(dec.tokens)
                if dec.cut is not None:
                    if sglang or ep.sglang:
                        self._abort_later(ep, rid, always=True)
                    resp.close()   # drop the connection: the server's disconnect handling aborts it too
                    return replace(dec.result(cut=True), discard=verdict_details(guard, dec.cut))
                if dec.done:
                    break
            out = dec.result()
        except (AbortedResponseError, DuplicateRidError, NoStreamUsage):  # the server answered: not a fault
            raise
        except (FatalRequestError, RetryableRequestError) as exc:  # an error chunk after the 200, or a cut
            self.pool.fault(ep, "truncated answer" if isinstance(exc, StreamCut) else "error in the stream",
                            str(exc))
            if isinstance(exc, RetryableRequestError):
                self._abort_later(ep, rid)
            raise
        except BadResponseError as exc:   # not JSON, or no token counts at all: this server cannot stream
            self.pool.fault(ep, "unexpected JSON answer", str(exc))
            raise
        self.pool.answered(ep)
        return out

    def _read(self, ep: Endpoint, path: str, status: int, data: object, started: float,
              content_type: str | None = None) -> Completion:
        """The answer's verdict: a result, or the error that says what to do with the prompt.

        Every failed answer is counted by reason for its endpoint (shared/server_faults.py). One
        whose body says the request itself is invalid (a validation error, even one a server
        sends as a 500) fails the prompt with the server's message instead of being retried."""
        message = " ".join(error_message(data).split())  # one line: it becomes the prompt's failure reason
        if status == 400 and _DUPLICATE_RID in message:
            raise DuplicateRidError(f"{ep.url}{path}: HTTP 400: {message}")
        if status >= 400:
            invalid = invalid_request(status, data)
            self.pool.fault(ep, server_faults.http_reason(status, content_type, invalid), message)
            if status in RETRYABLE_STATUS and not invalid:
                raise RetryableRequestError(f"{ep.url}{path}: HTTP {status}: {message}")
            what = "the server refused the request as invalid" if invalid and status >= 500 else f"HTTP {status}"
            raise FatalRequestError(f"{ep.url}{path}: {what}: {message}")
        if not isinstance(data, dict):
            # A proxy's login or error page with status 200: transient as far as we can tell, and
            # counted, so a fleet that only gets those says so instead of failing every prompt.
            self.pool.fault(ep, server_faults.unreadable_reason(content_type), message)
            raise RetryableRequestError(f"{ep.url}{path}: HTTP {status} answer is not a JSON object "
                                        f"({server_faults.content_kind(content_type)}): {message[:300]}")
        try:
            out = parse_response(self._server.api, data, ep.url, started)
        except BadResponseError as exc:
            self.pool.fault(ep, "unexpected JSON answer", str(exc))
            raise
        self.pool.answered(ep)
        return out

    async def complete(self, payload: JobPayload, job_id: str, turn: int = 1) -> Completion:
        """Send with retries (exponential backoff + jitter) on transient failures only.

        ``turn``: which request of a regenerate: all conversation this is (its rid says so).

        Waiting for an endpoint to come back does not spend attempts: when every endpoint is
        down the job waits instead of failing. A server that answered (a duplicate rid, an
        aborted response, a 4xx) does not count against its endpoint's health.
        """
        key = routing_key(payload, self._server.prefix_chars) if self._server.routing == "prefix" else None
        ep, out = await self._attempts(job_id, lambda ep: self._once(ep, payload, attempt_rid(job_id, turn)),
                                       key, payload.dataset)
        self.pool.served(ep, out.prompt_tokens, out.cached_tokens)
        return out

    async def _attempts(self, job_id: str, once: Callable[[Endpoint], Awaitable[T]], key: bytes | None = None,
                        dataset: str | None = None) -> tuple[Endpoint, T]:
        """``once`` on a picked endpoint until it succeeds, fails for good, or max_attempts is spent.

        Waiting for an endpoint to come back does not spend attempts. A server that answered (a
        duplicate rid, an aborted response, a 4xx) does not count against its endpoint's health.
        """
        attempt = 0
        while True:
            ep = self.pool.pick(key)
            if ep is None:
                await self.pool.wait_healthy()
                continue
            attempt += 1
            try:
                out = await once(ep)
            except RetryableRequestError as exc:
                answered = isinstance(exc, DuplicateRidError | AbortedResponseError)
                if answered:
                    self.pool.success(ep)
                else:
                    self.pool.failure(ep, str(exc))
                if attempt >= self._server.max_attempts:
                    raise RetryableRequestError(f"gave up after {attempt} attempts: {exc}") from exc
                log.info("job %s: attempt %d failed (%s): retrying with a new rid", job_id, attempt, exc)
                if self._on_retry is not None and dataset is not None:
                    self._on_retry(dataset)
                if not isinstance(exc, DuplicateRidError):  # a fresh rid is the whole fix: no wait
                    await asyncio.sleep(backoff_s(attempt, self._server.backoff_base_s, self._server.backoff_max_s))
                continue
            except FatalRequestError:
                self.pool.success(ep)  # the server answered: the endpoint itself is fine
                raise
            self.pool.success(ep)
            return ep, out


@dataclass(frozen=True)
class ServerInfo:
    """What a server says it serves (``budgetq check``): /v1/models ids and /model_info's model_path."""

    url: str
    models: list[str]
    model_path: str | None
    error: str | None = None
    max_model_len: int | None = None   # the context length /v1/models reports (SGLang, vLLM do)
    kind: str | None = None            # shared/server_kind.py, asked as the worker asks (endpoints.ask_kind)


async def _get_json(session: aiohttp.ClientSession, url: str, headers: dict[str, str]) -> tuple[int, object]:
    async with session.get(url, headers=headers) as resp:
        try:
            return resp.status, await resp.json(content_type=None)
        except ValueError:
            return resp.status, await resp.text()


async def probe_server(server: ServerConfig, url: str, timeout_s: float = 5.0) -> ServerInfo:
    """Ask one endpoint what it serves, with a short timeout and no retries (a check, not a run)."""
    headers = {"Authorization": f"Bearer {server.api_key}"} if server.api_key else {}
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    try:
        async with aiohttp.ClientSession(timeout=timeout) as session:
            status, body = await _get_json(session, url + "/v1/models", headers)
            if status != 200 or not isinstance(body, dict):
                return ServerInfo(url, [], None, f"GET /v1/models: HTTP {status}: {error_message(body)}")
            ids = [str(m.get("id")) for m in body.get("data") or [] if isinstance(m, dict)]
            lens = [m.get("max_model_len") for m in body.get("data") or [] if isinstance(m, dict)]
            ctx = next((v for v in lens if isinstance(v, int) and not isinstance(v, bool) and v > 0), None)
            status, info = await _get_json(session, url + "/model_info", headers)
            if status == 404:  # older servers only have the old name
                status, info = await _get_json(session, url + "/get_model_info", headers)
            path = info.get("model_path") if status == 200 and isinstance(info, dict) else None
            found = await ask_kind(session, url, headers)
            return ServerInfo(url, ids, str(path) if path else None, max_model_len=ctx,
                              kind=found[0] if found else None)
    except (TimeoutError, aiohttp.ClientError) as exc:
        return ServerInfo(url, [], None, f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__)


# ---------------------------------------------------------------------------------------------
# Hidden states: one prefill-only /generate per sample, through the same pool, retries
# and aborts. Kept apart from the generation path above; hidden_states/capture/features_worker.py is its only caller.
# ---------------------------------------------------------------------------------------------
class HiddenStatesClient(SGLangClient):
    """The same client (endpoint pool, retries, rids, aborts) with one more request kind."""

    async def _raw_once(self, ep: Endpoint, path: str, body: dict, rid: str) -> RawResponse:
        async def read(resp: aiohttp.ClientResponse, started: float) -> RawResponse:
            data = await resp.read()
            if resp.status != 200:
                try:
                    detail: object = json.loads(data)
                except ValueError:
                    detail = data.decode(errors="replace")
                self._read(ep, path, resp.status, detail, started, resp.content_type)  # raises on >= 400
                raise BadResponseError(f"{ep.url}{path}: HTTP {resp.status}")
            self.pool.answered(ep)
            return RawResponse(data, ep.url, time.monotonic() - started)

        return await self._post(ep, path, body, rid, read)

    async def prefill_hidden_states(self, input_ids: list[int], job_id: str) -> RawResponse:
        """POST the prefill with retries on transient failures (as ``complete``); the body stays raw."""
        def once(ep: Endpoint) -> Awaitable[RawResponse]:
            rid = attempt_rid(job_id)
            return self._raw_once(ep, "/generate", prefill_body(input_ids, rid), rid)

        _ep, out = await self._attempts(job_id, once)
        return out

    async def post_raw(self, path: str, body: dict, job_id: str) -> RawResponse:
        """POST ``body`` to ``path`` (the vllm capture backend's /v1/completions prefill) with the same retries."""
        _ep, out = await self._attempts(job_id, lambda ep: self._raw_once(ep, path, body, attempt_rid(job_id)))
        return out
