"""``worker.concurrency: auto``: size this worker's requests in flight from what the servers say.

Per endpoint, every ``capacity_interval_s``:

1. read the server's capacity and load: ``/server_info`` (SGLang 0.5.x http_server.server_info:
   ``internal_states[]`` has one entry per DP rank with ``effective_max_running_requests_per_dp``,
   the scheduler's real max_running_requests after memory sizing) and ``/v1/loads``
   (entrypoints/v1_loads.get_loads: ``loads[]``, one LoadSnapshot per DP rank, with
   ``num_running_reqs`` and ``num_waiting_reqs``);
2. set the endpoint's target for all budgetq workers together: its running slots plus a short
   waiting queue (``max(2, 5%)`` of the slots: non-empty, so a finished request is replaced
   inside the server without a round trip; short, so few requests wait when a budget is
   crossed), less what other clients hold there (running + waiting - budgetq's own in flight),
   and capped at what the server actually runs when it admits fewer than max_running (KV
   memory full) while requests wait;
3. split the target among the live workers sending to that endpoint, through Redis
   (``keys.capacity_key(url)``: worker name -> "<last seen time> <its in flight there>"), so 8
   workers on one server take an eighth each, not all of it.

This worker's limit is the sum of its shares over healthy endpoints; ``Capacity.apply`` resizes
the worker's slots (``Slots.resize``) to it and weights each endpoint by its share, so least-loaded
routing fills a large server more than a small one. An endpoint that cannot be read keeps its
last share (a fresh one gets ``START``), as does one that is not SGLang; an ejected endpoint gets none.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass
from typing import Any

import aiohttp
import redis.asyncio as aredis

from budgetq.shared import keys
from budgetq.shared.redis_conn import text
from budgetq.worker.context import Slots
from budgetq.worker.endpoints import Endpoint, EndpointPool

log = logging.getLogger("budgetq.capacity")
START = 8                       # per endpoint, until its server has been read
_READ_TIMEOUT = aiohttp.ClientTimeout(total=5)


@dataclass
class ServerLoad:
    max_running: int            # summed over DP ranks
    running: int
    waiting: int


def parse_server_info(info: dict[str, Any]) -> int:
    """Running slots of a server from /server_info: the sum over DP ranks of the effective limit."""
    states = info.get("internal_states") or []
    per_rank = [int(s["effective_max_running_requests_per_dp"]) for s in states
                if isinstance(s, dict) and s.get("effective_max_running_requests_per_dp")]
    if per_rank:
        return sum(per_rank)
    value = info.get("max_running_requests")     # server args: the configured value
    if isinstance(value, int) and value > 0:
        return value
    raise ValueError("no effective_max_running_requests_per_dp or max_running_requests in /server_info")


def parse_loads(body: dict[str, Any]) -> tuple[int, int]:
    """(running, waiting) summed over DP ranks from /v1/loads."""
    loads = [x for x in body.get("loads") or [] if isinstance(x, dict)]
    if not loads:
        raise ValueError("no loads[] in /v1/loads")
    return sum(int(x.get("num_running_reqs", 0)) for x in loads), sum(int(x.get("num_waiting_reqs", 0)) for x in loads)


def queue_target(max_running: int) -> int:
    """Waiting requests to keep at a server: short but never empty."""
    return max(2, math.ceil(0.05 * max_running))


def next_target(load: ServerLoad, ours: int) -> int:
    """All budgetq workers' requests for one server (``ours``: what they hold there now)."""
    want_waiting = queue_target(load.max_running)
    others = max(0, load.running + load.waiting - ours)
    slots = load.max_running
    if load.waiting > want_waiting and load.running < load.max_running:
        slots = load.running        # the server admits fewer than max_running (KV memory): go by what runs
    return max(want_waiting, slots + want_waiting - others)


def my_share(total: int, live: list[str], me: str) -> int:
    """This worker's part of ``total`` among ``live`` workers: equal, the remainder to the first names."""
    names = sorted(set(live) | {me})
    n = len(names)
    return total // n + (1 if names.index(me) < total % n else 0)


class Capacity:
    """The live per-process limit of a worker with ``concurrency: auto`` (see the module docstring).

    Narrow inputs: this worker's name, its Redis connection (the shares), its endpoint pool (the
    servers and their weights), its slots (resized) and the event that wakes its claim loop."""

    def __init__(self, name: str, aconn: aredis.Redis, pool: EndpointPool, slots: Slots,
                 wake: asyncio.Event, interval_s: float = 5.0) -> None:
        self.name = name
        self.aconn = aconn
        self.pool = pool
        self.slots = slots
        self.wake = wake
        self.interval_s = interval_s
        self.targets: dict[str, int] = {}   # url -> all budgetq workers' requests there
        self.shares: dict[str, int] = {}
        self.round_trips = 0                # Redis round trips, for the worker's count

    async def _read(self, ep: Endpoint) -> ServerLoad:
        async with self.pool.session.get(ep.url + "/server_info", headers=self.pool.headers,
                                         timeout=_READ_TIMEOUT) as resp:
            resp.raise_for_status()
            max_running = parse_server_info(await resp.json(content_type=None))
        async with self.pool.session.get(ep.url + "/v1/loads", headers=self.pool.headers,
                                         timeout=_READ_TIMEOUT) as resp:
            resp.raise_for_status()
            running, waiting = parse_loads(await resp.json(content_type=None))
        return ServerLoad(max_running, running, waiting)

    async def _live_workers(self, ep: Endpoint) -> dict[str, int]:
        """Register this worker at ``ep`` (with its in flight there); the workers seen there recently."""
        key, now = keys.capacity_key(ep.url), time.time()
        async with self.aconn.pipeline(transaction=False) as p:
            p.hset(key, self.name, f"{now:.3f} {ep.in_flight}")
            p.expire(key, int(6 * self.interval_s) + 10)
            p.hgetall(key)
            _, _, seen = await p.execute()
        self.round_trips += 1
        live: dict[str, int] = {}
        stale = []
        for k, v in seen.items():
            ts, n = text(v).split()
            if float(ts) < now - 3 * self.interval_s:
                stale.append(text(k))
            else:
                live[text(k)] = int(n)
        if stale:
            await self.aconn.hdel(key, *stale)
            self.round_trips += 1
        return live

    async def refresh(self) -> int:
        """Re-read every endpoint, re-split, apply; returns the new limit."""
        for ep in self.pool.endpoints:
            if not ep.healthy:
                self.shares[ep.url] = 0
                continue
            if ep.sglang is False:  # no /server_info or /v1/loads to size from: a fixed share
                self.shares.setdefault(ep.url, START)
                continue
            try:
                load = await self._read(ep)
            except (aiohttp.ClientError, TimeoutError, ValueError, KeyError, TypeError) as exc:
                log.info("capacity: cannot read %s (%s); keeping its share", ep.url, exc)
                self.shares.setdefault(ep.url, START)
                continue
            live = await self._live_workers(ep)
            self.targets[ep.url] = next_target(load, sum(live.values()))
            self.shares[ep.url] = max(1, my_share(self.targets[ep.url], list(live), self.name))
        self.apply(max(1, sum(self.shares.values())))
        return self.slots.limit

    def apply(self, limit: int) -> None:
        """Make ``limit`` the worker's requests in flight: resize its slots, weight endpoints."""
        for ep in self.pool.endpoints:
            ep.weight = float(max(1, self.shares.get(ep.url, START)))
        old = self.slots.limit
        if limit == old:
            return
        self.slots.resize(limit)
        if limit > old:
            self.wake.set()     # the claim loop may take more jobs now
        log.info("capacity: %d requests in flight (was %d): %s", limit, old,
                 ", ".join(f"{u} {s}" for u, s in sorted(self.shares.items())))

    async def run(self, stopping: asyncio.Event) -> None:
        while not stopping.is_set():
            try:
                await self.refresh()
            except Exception as exc:  # noqa: BLE001 - never let sizing stop the worker
                log.warning("capacity: refresh failed (%s); keeping %d in flight", exc, self.slots.limit)
            try:
                await asyncio.wait_for(stopping.wait(), self.interval_s)
            except TimeoutError:
                pass
        # Leaving: the others may take this worker's shares at their next refresh (best effort;
        # otherwise the entry goes stale after 3 intervals).
        try:
            async with self.aconn.pipeline(transaction=False) as p:
                for url in self.shares:
                    p.hdel(keys.capacity_key(url), self.name)
                await p.execute()
        except Exception as exc:  # noqa: BLE001 - shutting down anyway
            log.debug("capacity: could not deregister: %s", exc)
