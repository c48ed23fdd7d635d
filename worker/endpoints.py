"""The SGLang endpoints a worker sends to: least in-flight or prefix-aware, eject on failure,
re-admit on health.

Routing (``server.routing``). ``least_loaded``: the healthy endpoint with the fewest requests
in flight. ``prefix``: requests whose routing key (the first ``prefix_chars`` characters of
the rendered messages, or the first ``prefix_chars // 4`` input ids) is the same go to the
same endpoint, so that server's radix cache holds their shared prefix and skips its prefill.
The endpoint is chosen by consistent hashing with bounded loads (after Mirrokni, Thorup and
Zadimoghaddam, 2018, with the bound taken against the least-loaded endpoint instead of the
mean, so that no server starves either): the healthy endpoints are ranked by a rendezvous hash
of (key, url) and the first whose in-flight count stays within ``prefix_balance`` x the
least-loaded one's (+2) takes the request; else the least loaded does.
A hot prefix thus spills over to its second-ranked endpoint (always the same one, which then
caches it too) instead of piling onto one server; a key's first choice changes only when an
endpoint leaves or joins. Each worker process balances its own requests; summed over workers
the loads stay within the same bound.

An endpoint that fails ``eject_after_failures`` times in a row is taken out; a probe then
asks its /health every ``health_interval_s`` and puts it back once it answers 200 (a server
with no /health, such as llama.cpp's OpenAI server, answers 404 there: then /v1/models
answering 200 is the sign of life). When
no endpoint is healthy, requests wait here (without spending their retry attempts) and
the worker logs it once, plainly, instead of failing every job.

Each endpoint also counts its faults by reason (shared/server_faults.py): the worker publishes
them, and ``budgetq status`` / ``produce`` say in one line why a fleet makes no progress.

What kind of server an endpoint is (``Endpoint.kind``: SGLang, vLLM or another OpenAI-style
server, shared/server_kind.py) is asked once: /server_info answers for SGLang, which alone gets
SGLang's own fields and defaults (rid, top_k -1, ...; worker/sglang_wire.py); for any other
server, /v1/models says whether it is vLLM (``owned_by: "vllm"``) and which model it serves,
the name its requests carry when ``server.model`` is not set (``Endpoint.model``).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import random
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import aiohttp

from budgetq.shared import server_faults, server_kind
from budgetq.shared.config import ServerConfig
from budgetq.shared.errors import ConfigError
from budgetq.shared.schema import JobPayload

log = logging.getLogger("budgetq.endpoints")
_SLACK = 2   # requests an endpoint may hold over prefix_balance x the least-loaded one's
_HOMES = 4096  # keys whose endpoint prefix routing remembers (for the later answers of a prompt)
_DETECT_TIMEOUT = aiohttp.ClientTimeout(total=5.0)
# While /server_info gives no answer (a 5xx, a timeout), it is asked again at most this often,
# not once per request; meanwhile requests carry only standard fields (sglang_client.py).
_DETECT_AGAIN_S = 30.0


@dataclass
class Endpoint:
    url: str
    in_flight: int = 0
    failures: int = 0           # consecutive
    healthy: bool = True
    ejected_since: float | None = None
    requests: int = 0
    errors: int = 0
    # Its share of this worker's requests (worker/capacity.py sets it from the server's size
    # under concurrency: auto); loads compare in_flight / weight. 1 for every endpoint otherwise.
    weight: float = 1.0
    prompt_tokens: int = 0      # of answered requests
    cached_tokens: int = 0      # of those, found in the server's prefix cache
    faults: server_faults.EndpointFaults = field(default_factory=server_faults.EndpointFaults)
    # None until asked (/server_info, /v1/models); server_kind.SGLANG (also for api: generate,
    # SGLang's own route), VLLM or OPENAI.
    kind: str | None = None
    model: str | None = None    # the model name its requests carry (server.model, else resolved)
    # The server's own load as last read (worker/capacity.py, concurrency: auto; vLLM's also with a fixed
    # concurrency, worker/vllm_load.py read_loads): running, waiting, kv_cache_use (vLLM), slots (the
    # running slots sized from; None when nothing is sized), read_at (unix s); None until read.
    load: dict | None = None
    asked_at: float = 0.0       # when its kind was last asked without an answer (monotonic)
    refused: str | None = None  # why its answer cannot be used (several models, no server.model)
    _probe: asyncio.Task | None = field(default=None, repr=False)
    _seed: bytes = field(default=b"", repr=False)

    @property
    def sglang(self) -> bool | None:
        """Whether it is SGLang; None until asked."""
        return None if self.kind is None else self.kind == server_kind.SGLANG

    def snapshot(self) -> dict:
        return {"healthy": self.healthy, "in_flight": self.in_flight, "failures": self.failures,
                "ejected_since": self.ejected_since, "requests": self.requests, "errors": self.errors,
                "prompt_tokens": self.prompt_tokens, "cached_tokens": self.cached_tokens,
                "kind": self.kind, "model": self.model, "load": self.load}


def _asked_lately(ep: Endpoint) -> bool:
    """/server_info was asked without an answer less than ``_DETECT_AGAIN_S`` ago."""
    return bool(ep.asked_at) and time.monotonic() - ep.asked_at < _DETECT_AGAIN_S


class RoutingKey(bytes):
    """A routing key, and how many requests over the load bound its endpoint may take for it
    (``siblings``): answer k of a prompt (samples: N) follows its k - 1 siblings, which hold the
    same prompt in flight on that endpoint, so a prompt's answers share one prefill instead of
    spilling to a second server. The bound grows by at most N - 1 requests an endpoint."""
    siblings: int = 0


def routing_key(payload: JobPayload, prefix_chars: int) -> RoutingKey:
    """What decides a request's endpoint under prefix routing: the start of what the server caches.

    Chat: the first ``prefix_chars`` characters of the messages, role and content, in order (the
    server's chat template puts them in that order, so equal starts mean a shared KV prefix).
    Generate: the first ``prefix_chars // 4`` input ids (about 4 characters a token). The answers
    of one prompt share it (their messages are the same) and carry their sibling allowance."""
    key = RoutingKey(_prefix(payload, prefix_chars))
    key.siblings = (payload.sample or 1) - 1
    return key


def _prefix(payload: JobPayload, prefix_chars: int) -> bytes:
    if payload.input_ids is not None:
        head = payload.input_ids[:max(1, prefix_chars // 4)]
        return b"ids:" + ",".join(map(str, head)).encode()
    parts: list[str] = []
    size = 0
    for m in payload.messages:
        parts.append(f"{m.role}\x00{m.content}\x01")
        size += len(parts[-1])
        if size >= prefix_chars:
            break
    return b"chat:" + "".join(parts)[:prefix_chars].encode("utf-8", "surrogatepass")


def _rank(key: bytes, ep: Endpoint) -> bytes:
    """Rendezvous (highest random weight) score of ``ep`` for ``key``."""
    return hashlib.blake2b(key, digest_size=8, key=ep._seed).digest()


def sglang_from_server_info(status: int, body: object) -> bool | None:
    """Whether a server is SGLang, from its /server_info answer; None when that says nothing yet.

    200 with SGLang's server args (``internal_states`` per DP rank, ``tp_size``): SGLang; a 404/405,
    or a 200 without them: another server; another 4xx (an admin key refused): SGLang's route, as
    before; a 5xx (a proxy's error page, a server still starting): ask again later."""
    if status in (404, 405):
        return False
    if status == 200:
        return isinstance(body, dict) and ("internal_states" in body or "tp_size" in body)
    return True if status < 500 else None


async def _get_json(session: aiohttp.ClientSession, url: str, headers: dict[str, str]) -> tuple[int, object]:
    async with session.get(url, headers=headers, timeout=_DETECT_TIMEOUT) as resp:
        try:
            return resp.status, await resp.json(content_type=None)
        except ValueError:
            return resp.status, None


async def ask_kind(session: aiohttp.ClientSession, url: str, headers: dict[str, str]) -> tuple[str, list[str]] | None:
    """(kind, model ids) of the server at ``url``, or None while it gives no answer (module docstring).
    The one detection: the worker's pool and ``budgetq check`` (sglang_client.probe_server) use it."""
    status, info = await _get_json(session, url + "/server_info", headers)
    sglang = sglang_from_server_info(status, info)
    if sglang is None:
        return None
    if sglang:
        return server_kind.SGLANG, []
    status, models = await _get_json(session, url + "/v1/models", headers)
    if status >= 500:
        return None
    return server_kind.kind_of_models(models if status == 200 else None)


class EndpointPool:
    def __init__(self, server: ServerConfig, session: aiohttp.ClientSession, headers: dict[str, str]) -> None:
        self._server = server
        self.session = session
        self.headers = headers
        self.endpoints = [Endpoint(u, _seed=hashlib.blake2b(u.encode(), digest_size=16).digest())
                          for u in server.urls]
        self._any_healthy = asyncio.Event()
        self._any_healthy.set()
        self._down_logged_at = 0.0
        # prefix routing: where each recent key went, so a prompt's later answers join its first
        # even when that one spilled past its first choice (bounded: the oldest keys are forgotten)
        self._homes: OrderedDict[bytes, Endpoint] = OrderedDict()
        self._detecting: dict[str, asyncio.Lock] = {}

    @property
    def any_healthy(self) -> bool:
        return self._any_healthy.is_set()

    async def until_healthy(self, stop: asyncio.Event) -> None:
        """Return once an endpoint is healthy (at once if one is), or ``stop`` is set."""
        waits = {asyncio.ensure_future(self._any_healthy.wait()), asyncio.ensure_future(stop.wait())}
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()

    def pick(self, key: bytes | None = None) -> Endpoint | None:
        """Where the next request goes: by ``key`` (prefix routing) within the load bound, else
        the healthy endpoint with the fewest requests in flight (ties broken at random)."""
        healthy = [e for e in self.endpoints if e.healthy]
        if not healthy:
            return None
        low = min(e.in_flight / e.weight for e in healthy)
        if key is not None and len(healthy) > 1:
            # Bounded loads: an endpoint takes a request only while it holds at most prefix_balance x
            # the least-loaded one's (+ a little slack, so a handful in flight does not scatter keys).
            balance = self._server.prefix_balance
            siblings = getattr(key, "siblings", 0)  # a prompt's later answers follow its first
            slack = _SLACK + siblings
            home = self._homes.get(key) if siblings else None
            ranked = sorted(healthy, key=lambda e: _rank(key, e), reverse=True)
            for e in ([home] if home is not None and home.healthy else []) + ranked:
                if e.in_flight + 1 - slack <= balance * low * e.weight:
                    return self._home(key, e)
        chosen = random.choice([e for e in healthy if e.in_flight / e.weight == low])
        return self._home(key, chosen) if key is not None else chosen

    def _home(self, key: bytes, ep: Endpoint) -> Endpoint:
        self._homes[key] = ep
        self._homes.move_to_end(key)
        if len(self._homes) > _HOMES:
            self._homes.popitem(last=False)
        return ep

    def served(self, ep: Endpoint, prompt_tokens: int, cached_tokens: int) -> None:
        """Count an answered request's prompt tokens and how many of them the server had cached."""
        ep.prompt_tokens += prompt_tokens
        ep.cached_tokens += cached_tokens

    async def wait_healthy(self) -> None:
        if not self._any_healthy.is_set() and time.monotonic() - self._down_logged_at > 30:
            self._down_logged_at = time.monotonic()
            log.error("all servers are down (%s); waiting for one to answer its health check",
                      ", ".join(f"{e.url}: {e.faults.last_reason or 'failing'}" for e in self.endpoints))
        await self._any_healthy.wait()

    def success(self, ep: Endpoint) -> None:
        ep.failures = 0

    def fault(self, ep: Endpoint, reason: str, message: str = "") -> None:
        """Count one failed answer (or none) from ``ep`` by reason; health is ``failure``'s business."""
        ep.faults.fault(reason, message)

    def answered(self, ep: Endpoint) -> None:
        """``ep`` gave a usable answer: its faults are history, not its present."""
        ep.faults.ok()

    async def is_sglang(self, ep: Endpoint) -> bool | None:
        """Whether ``ep`` is SGLang (``detect``); None while that is unknown."""
        kind = await self.detect(ep)
        return None if kind is None else kind == server_kind.SGLANG

    async def detect(self, ep: Endpoint) -> str | None:
        """``ep``'s kind, asked once (``ask_kind``), and the model its requests carry. Unknown (None)
        while it cannot be reached (asked again after ``_DETECT_AGAIN_S``); api: generate is SGLang's
        own route, so always SGLang there. ConfigError: it serves several models and server.model
        is not set."""
        if self._server.api == "generate" and ep.kind is None:
            ep.kind, ep.model = server_kind.SGLANG, self._server.model or server_kind.SGLANG_MODEL
        if ep.kind is not None:
            return ep.kind
        if _asked_lately(ep):
            if ep.refused is not None:
                raise ConfigError(ep.refused)
            return None
        # The first requests to an endpoint come together: one asks, the others wait for its answer.
        async with self._detecting.setdefault(ep.url, asyncio.Lock()):
            if ep.kind is not None or _asked_lately(ep):
                return await self.detect(ep)
            try:
                found = await ask_kind(self.session, ep.url, self.headers)
            except (aiohttp.ClientError, TimeoutError) as exc:
                log.debug("endpoint %s: cannot ask what it is yet: %s", ep.url, exc)
                found = None
            ep.asked_at, ep.refused = time.monotonic(), None
            if found is None:
                return None
            kind, ids = found
            try:
                model = server_kind.resolve_model(self._server.model, kind, ids, ep.url)
            except ConfigError as exc:   # several models, no server.model: said again until it is set
                ep.refused = str(exc)
                raise
            ep.kind, ep.model, ep.asked_at = kind, model, 0.0
        if kind != server_kind.SGLANG:
            how = "server.model" if self._server.model is not None else \
                ("its /v1/models" if ids else "none listed on /v1/models: as for SGLang")
            log.warning("endpoint %s is %s, not SGLang (no /server_info): sending only standard OpenAI fields and "
                        "the sampling values set in the config or the model's generation_config.json; model %r (%s)",
                        ep.url, server_kind.LABELS[kind], model, how)
        return kind

    async def detect_all(self) -> None:
        """Ask every endpoint what it is, together (the worker's start): a server that serves several
        models while server.model is not set stops the worker here, in one line (ConfigError)."""
        await asyncio.gather(*(self.detect(ep) for ep in self.endpoints))

    def failure(self, ep: Endpoint, reason: str) -> None:
        ep.failures += 1
        ep.errors += 1
        if ep.healthy and ep.failures >= self._server.eject_after_failures:
            ep.healthy = False
            ep.ejected_since = time.time()
            log.warning("endpoint %s taken out after %d failures in a row (last: %s)", ep.url, ep.failures, reason)
            if not any(e.healthy for e in self.endpoints):
                self._any_healthy.clear()
            ep._probe = asyncio.get_running_loop().create_task(self._probe_until_healthy(ep))

    async def _probe_until_healthy(self, ep: Endpoint) -> None:
        timeout = aiohttp.ClientTimeout(total=max(5.0, self._server.health_interval_s))
        while True:
            await asyncio.sleep(self._server.health_interval_s)
            try:
                async with self.session.get(ep.url + "/health", headers=self.headers, timeout=timeout) as resp:
                    status = resp.status
                    await resp.read()
                if status in (404, 405):  # no /health here (llama.cpp's server): is it serving models?
                    async with self.session.get(ep.url + "/v1/models", headers=self.headers, timeout=timeout) as resp:
                        status = resp.status
                        await resp.read()
                if status == 200:
                    break
            except (aiohttp.ClientError, TimeoutError):
                continue
        ep.healthy, ep.failures, ep.ejected_since, ep._probe = True, 0, None, None
        ep.faults.ok()  # it answers again: its faults are history until the next one
        self._any_healthy.set()
        log.warning("endpoint %s answers its health check again: back in rotation", ep.url)

    def faults_snapshot(self) -> dict[str, dict]:
        """What the worker publishes for shared/server_faults.py: url -> counts, health, last fault/success."""
        return {e.url: e.faults.to_json(e.healthy) for e in self.endpoints}

    def snapshot(self) -> dict[str, dict]:
        return {e.url: e.snapshot() for e in self.endpoints}

    async def close(self) -> None:
        for e in self.endpoints:
            if e._probe is not None:
                e._probe.cancel()
