"""The one HTTP client for SGLang (aiohttp): chat or native /generate, retries, several endpoints."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp

from shared.config import ServerConfig
from shared.errors import BadResponseError, FatalRequestError, RetryableRequestError
from shared.retry import backoff_s
from shared.schema import JobPayload
from worker.endpoints import Endpoint, EndpointPool

_RETRYABLE_STATUS = {408, 429, 500, 502, 503, 504}


@dataclass(frozen=True)
class Completion:
    text: str
    reasoning: str | None
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str
    endpoint: str
    latency_s: float


def _error_message(body: object) -> str:
    if isinstance(body, dict):
        err = body.get("error", body)
        if isinstance(err, dict):
            return str(err.get("message", err))
        if isinstance(body.get("message"), str):
            return body["message"]
        return str(err)
    return str(body)[:500]


def build_request(server: ServerConfig, payload: JobPayload, rid: str) -> tuple[str, dict]:
    """Path and JSON body of one request, in SGLang's terms."""
    sp = payload.sampling
    optional = {k: v for k, v in (("top_k", sp.top_k), ("min_p", sp.min_p), ("stop", sp.stop)) if v is not None}
    if server.api == "chat":
        body = {"model": server.model, "messages": [m.model_dump() for m in payload.messages],
                "max_tokens": sp.max_tokens, "temperature": sp.temperature, "top_p": sp.top_p,
                "rid": rid, "stream": False, **optional}
        if sp.seed is not None:
            body["seed"] = sp.seed
        if payload.chat_template_kwargs:
            body["chat_template_kwargs"] = payload.chat_template_kwargs
        body.update(sp.extra)
        return "/v1/chat/completions", body
    params = {"max_new_tokens": sp.max_tokens, "temperature": sp.temperature, "top_p": sp.top_p, **optional}
    if sp.seed is not None:
        params["sampling_seed"] = sp.seed
    params.update(sp.extra)
    if payload.input_ids is not None:
        return "/generate", {"input_ids": payload.input_ids, "rid": rid, "sampling_params": params}
    # No tokenizer (a job enqueued by hand): a plain-text transcript.
    text = "".join(f"{m.role}: {m.content}\n" for m in payload.messages) + "assistant: "
    return "/generate", {"text": text, "rid": rid, "sampling_params": params}


def parse_response(api: str, body: dict, url: str, started: float) -> Completion:
    try:
        if api == "chat":
            choice = body["choices"][0]
            usage = body["usage"]
            msg = choice["message"]
            return Completion(msg.get("content") or "", msg.get("reasoning_content"), int(usage["prompt_tokens"]),
                              int(usage["completion_tokens"]), str(choice["finish_reason"]), url,
                              time.monotonic() - started)
        meta = body["meta_info"]
        fr = meta["finish_reason"]
        return Completion(body["text"], None, int(meta["prompt_tokens"]), int(meta["completion_tokens"]),
                          str(fr.get("type") if isinstance(fr, dict) else fr), url, time.monotonic() - started)
    except (KeyError, IndexError, TypeError, ValueError, AttributeError) as exc:
        raise BadResponseError(f"unexpected response from {url}: {exc!r}: {str(body)[:300]}") from exc


class SGLangClient:
    """Sends one prompt to the least-busy healthy endpoint, retrying transient failures."""

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

    @property
    def model(self) -> str:
        return self._server.model

    async def _once(self, ep: Endpoint, payload: JobPayload, rid: str) -> Completion:
        path, body = build_request(self._server, payload, rid)
        ep.in_flight += 1
        ep.requests += 1
        started = time.monotonic()
        try:
            async with self._session.post(ep.url + path, json=body, headers=self._headers,
                                          timeout=self._timeout) as resp:
                try:
                    data = await resp.json(content_type=None)
                except ValueError:
                    data = await resp.text()
                if resp.status in _RETRYABLE_STATUS:
                    raise RetryableRequestError(f"{ep.url}{path}: HTTP {resp.status}: {_error_message(data)}")
                if resp.status >= 400:
                    raise FatalRequestError(f"{ep.url}{path}: HTTP {resp.status}: {_error_message(data)}")
                if not isinstance(data, dict):
                    raise BadResponseError(f"{ep.url}{path}: response is not a JSON object: {str(data)[:300]}")
                return parse_response(self._server.api, data, ep.url, started)
        except (TimeoutError, aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as exc:
            raise RetryableRequestError(f"{ep.url}{path}: {type(exc).__name__}: {exc}") from exc
        finally:
            ep.in_flight -= 1

    async def complete(self, payload: JobPayload, rid: str) -> Completion:
        """Send with retries (exponential backoff + jitter) on transient failures only.

        Waiting for an endpoint to come back does not spend attempts: when every endpoint is
        down the job waits instead of failing.
        """
        attempt = 0
        while True:
            ep = self.pool.pick()
            if ep is None:
                await self.pool.wait_healthy()
                continue
            attempt += 1
            try:
                out = await self._once(ep, payload, rid)
            except RetryableRequestError as exc:
                self.pool.failure(ep, str(exc))
                if attempt >= self._server.max_attempts:
                    raise RetryableRequestError(f"gave up after {attempt} attempts: {exc}") from exc
                if self._on_retry is not None:
                    self._on_retry(payload.dataset)
                await asyncio.sleep(backoff_s(attempt, self._server.backoff_base_s, self._server.backoff_max_s))
                continue
            except FatalRequestError:
                self.pool.success(ep)  # the server answered: the endpoint itself is fine
                raise
            self.pool.success(ep)
            return out


@dataclass(frozen=True)
class ServerInfo:
    """What a server says it serves (``budgetq check``): /v1/models ids and /model_info's model_path."""

    url: str
    models: list[str]
    model_path: str | None
    error: str | None = None


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
                return ServerInfo(url, [], None, f"GET /v1/models: HTTP {status}: {_error_message(body)}")
            ids = [str(m.get("id")) for m in body.get("data") or [] if isinstance(m, dict)]
            status, info = await _get_json(session, url + "/model_info", headers)
            if status == 404:  # older servers only have the old name
                status, info = await _get_json(session, url + "/get_model_info", headers)
            path = info.get("model_path") if status == 200 and isinstance(info, dict) else None
            return ServerInfo(url, ids, str(path) if path else None)
    except (TimeoutError, aiohttp.ClientError) as exc:
        return ServerInfo(url, [], None, f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__)
