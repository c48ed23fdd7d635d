"""The one HTTP client for SGLang (aiohttp): chat or native /generate, several endpoints."""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass

import aiohttp

from shared.config import ServerConfig
from shared.errors import BadResponseError, FatalRequestError, RetryableRequestError
from shared.schema import JobPayload

_RETRYABLE_STATUS = {408, 429, 500, 502, 503, 504}


@dataclass(frozen=True)
class Completion:
    text: str
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
        return str(err)
    return str(body)[:500]


class SGLangClient:
    """Sends one prompt, picking the endpoint with the fewest requests in flight."""

    def __init__(self, session: aiohttp.ClientSession, server: ServerConfig, attempts: int = 5) -> None:
        self._session = session
        self._server = server
        self._attempts = attempts
        self._in_flight = {url: 0 for url in server.urls}
        self._headers = {"Content-Type": "application/json"}
        if server.api_key:
            self._headers["Authorization"] = f"Bearer {server.api_key}"

    @property
    def model(self) -> str:
        return self._server.model

    def _pick(self) -> str:
        low = min(self._in_flight.values())
        return random.choice([u for u, n in self._in_flight.items() if n == low])

    def _request(self, payload: JobPayload, rid: str) -> tuple[str, dict]:
        sp = payload.sampling
        msgs = [m.model_dump() for m in payload.messages]
        if self._server.api == "chat":
            return "/v1/chat/completions", {
                "model": self._server.model, "messages": msgs, "max_tokens": sp.max_tokens,
                "temperature": sp.temperature, "top_p": sp.top_p, "rid": rid, "stream": False,
            }
        # generate without a tokenizer: a plain-text transcript (tokenizer chat templates: issue 7).
        text = "".join(f"{m['role']}: {m['content']}\n" for m in msgs) + "assistant: "
        return "/generate", {"text": text, "rid": rid, "sampling_params": {
            "max_new_tokens": sp.max_tokens, "temperature": sp.temperature, "top_p": sp.top_p}}

    def _parse(self, body: dict, url: str, started: float) -> Completion:
        try:
            if self._server.api == "chat":
                choice = body["choices"][0]
                usage = body["usage"]
                return Completion(choice["message"].get("content") or "", int(usage["prompt_tokens"]),
                                  int(usage["completion_tokens"]), str(choice["finish_reason"]),
                                  url, time.monotonic() - started)
            meta = body["meta_info"]
            fr = meta["finish_reason"]
            return Completion(body["text"], int(meta["prompt_tokens"]), int(meta["completion_tokens"]),
                              str(fr.get("type") if isinstance(fr, dict) else fr), url,
                              time.monotonic() - started)
        except (KeyError, IndexError, TypeError, ValueError, AttributeError) as exc:
            raise BadResponseError(f"unexpected response from {url}: {exc!r}: {str(body)[:300]}") from exc

    async def _once(self, payload: JobPayload, rid: str) -> Completion:
        url = self._pick()
        path, body = self._request(payload, rid)
        self._in_flight[url] += 1
        started = time.monotonic()
        try:
            timeout = aiohttp.ClientTimeout(total=self._server.timeout_s)
            async with self._session.post(url + path, json=body, headers=self._headers, timeout=timeout) as resp:
                try:
                    data = await resp.json(content_type=None)
                except ValueError:
                    data = await resp.text()
                if resp.status in _RETRYABLE_STATUS:
                    raise RetryableRequestError(f"{url}{path}: HTTP {resp.status}: {_error_message(data)}")
                if resp.status >= 400:
                    raise FatalRequestError(f"{url}{path}: HTTP {resp.status}: {_error_message(data)}")
                if not isinstance(data, dict):
                    raise BadResponseError(f"{url}{path}: response is not a JSON object: {str(data)[:300]}")
                return self._parse(data, url, started)
        except (TimeoutError, aiohttp.ClientConnectionError) as exc:
            raise RetryableRequestError(f"{url}{path}: {type(exc).__name__}: {exc}") from exc
        finally:
            self._in_flight[url] -= 1

    async def complete(self, payload: JobPayload, rid: str) -> Completion:
        """Send with retries (exponential backoff + jitter) on transient failures only."""
        for attempt in range(1, self._attempts + 1):
            try:
                return await self._once(payload, rid)
            except RetryableRequestError:
                if attempt == self._attempts:
                    raise
                await asyncio.sleep(min(10.0, 0.1 * 2 ** attempt) * random.uniform(0.5, 1.5))
        raise AssertionError("unreachable")
