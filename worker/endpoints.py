"""The SGLang endpoints a worker sends to: least in-flight first, eject on failure, re-admit on health.

An endpoint that fails ``eject_after_failures`` times in a row is taken out; a probe then
asks its /health every ``health_interval_s`` and puts it back once it answers 200. When
no endpoint is healthy, requests wait here (without spending their retry attempts) and
the worker logs it once, plainly, instead of failing every job.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from dataclasses import dataclass, field

import aiohttp

from shared.config import ServerConfig

log = logging.getLogger("budgetq.endpoints")


@dataclass
class Endpoint:
    url: str
    in_flight: int = 0
    failures: int = 0           # consecutive
    healthy: bool = True
    ejected_since: float | None = None
    requests: int = 0
    errors: int = 0
    _probe: asyncio.Task | None = field(default=None, repr=False)

    def snapshot(self) -> dict:
        return {"healthy": self.healthy, "in_flight": self.in_flight, "failures": self.failures,
                "ejected_since": self.ejected_since, "requests": self.requests, "errors": self.errors}


class EndpointPool:
    def __init__(self, server: ServerConfig, session: aiohttp.ClientSession, headers: dict[str, str]) -> None:
        self._server = server
        self._session = session
        self._headers = headers
        self.endpoints = [Endpoint(u) for u in server.urls]
        self._any_healthy = asyncio.Event()
        self._any_healthy.set()
        self._down_logged_at = 0.0

    def pick(self) -> Endpoint | None:
        """The healthy endpoint with the fewest requests in flight (ties broken at random)."""
        healthy = [e for e in self.endpoints if e.healthy]
        if not healthy:
            return None
        low = min(e.in_flight for e in healthy)
        return random.choice([e for e in healthy if e.in_flight == low])

    async def wait_healthy(self) -> None:
        if not self._any_healthy.is_set() and time.monotonic() - self._down_logged_at > 30:
            self._down_logged_at = time.monotonic()
            log.error("all SGLang endpoints are down (%s); waiting for one to answer /health",
                      ", ".join(e.url for e in self.endpoints))
        await self._any_healthy.wait()

    def success(self, ep: Endpoint) -> None:
        ep.failures = 0

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
                async with self._session.get(ep.url + "/health", headers=self._headers, timeout=timeout) as resp:
                    if resp.status == 200:
                        break
            except (aiohttp.ClientError, TimeoutError):
                continue
        ep.healthy, ep.failures, ep.ejected_since, ep._probe = True, 0, None, None
        self._any_healthy.set()
        log.warning("endpoint %s answers /health again: back in rotation", ep.url)

    def snapshot(self) -> dict[str, dict]:
        return {e.url: e.snapshot() for e in self.endpoints}

    async def close(self) -> None:
        for e in self.endpoints:
            if e._probe is not None:
                e._probe.cancel()
