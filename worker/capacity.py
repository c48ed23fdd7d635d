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

vLLM says neither its max_num_seqs nor a /v1/loads: step 1 reads its Prometheus ``/metrics``
instead (worker/vllm_load.py: running, waiting, KV cache use, preemptions, summed over its
engines) and estimates its running slots (``next_slots``, a slow start): the estimate doubles
while the server runs everything budgetq keeps there, queue included, with nothing waiting for
room and its KV cache under ``KV_HIGH``; it falls to what runs when more than the short queue
waits, the KV cache passes ``KV_HIGH`` or a request was preempted; otherwise it holds. At
max_num_seqs the server runs that many while the short queue waits, which neither doubles the
estimate (not all of it runs) nor lowers it (no more than the queue waits): the steady state.
Steps 2 and 3 are then the same as for SGLang.

This worker's limit is the sum of its shares over healthy endpoints; ``Capacity.apply`` resizes
the worker's slots (``Slots.resize``) to it and weights each endpoint by its share, so least-loaded
routing fills a large server more than a small one. An endpoint that cannot be read keeps its
last share (a fresh one gets ``START``) and says so once, as does another OpenAI-style server
(nothing to read); an ejected endpoint gets none. What was read is the endpoint's ``load``, which
the worker publishes for ``budgetq status``.
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

from budgetq.shared import keys, server_kind
from budgetq.shared.errors import ConfigError
from budgetq.shared.redis_conn import text
from budgetq.worker.context import Slots
from budgetq.worker.endpoints import Endpoint, EndpointPool
from budgetq.worker.vllm_load import VllmLoad, parse_metrics

log = logging.getLogger("budgetq.capacity")
START = 8                       # per endpoint, until its server has been read
KV_HIGH = 0.9                   # vLLM: KV cache use past which nothing is added (running requests grow into it)
# vLLM: its largest default max_num_seqs is 1024, doubled by --performance-mode throughput
# (vllm/engine/arg_utils.py get_batch_defaults): the slow start stops there, per engine.
MAX_PER_ENGINE = 2048
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


def next_slots(slots: int, load: VllmLoad, preempted: bool = False) -> int:
    """vLLM's running slots to size from next, given the estimate so far (module docstring).

    ``preempted``: vLLM preempted requests since the last read (its counter went up)."""
    q = queue_target(slots)
    if load.kv_cache_use >= KV_HIGH or preempted or load.waiting_capacity > q:
        return max(1, load.running)             # KV memory or the batch is the bound: what runs now
    if load.waiting_capacity == 0 and load.running >= slots + q:
        return min(2 * slots, MAX_PER_ENGINE * max(1, load.engines))   # all of it runs: room to grow
    return slots


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
        self.slots_estimate: dict[str, int] = {}   # vLLM: url -> its running slots as estimated (next_slots)
        self._preemptions: dict[str, int] = {}     # vLLM: url -> its preemption counter at the last read
        self._unreadable: dict[str, str] = {}      # url -> why it could not be read (said once)
        self.round_trips = 0                # Redis round trips, for the worker's count

    async def _get(self, ep: Endpoint, path: str) -> aiohttp.ClientResponse:
        resp = await self.pool.session.get(ep.url + path, headers=self.pool.headers, timeout=_READ_TIMEOUT)
        resp.raise_for_status()
        return resp

    async def _read(self, ep: Endpoint) -> ServerLoad:
        """SGLang: its /server_info (running slots) and /v1/loads."""
        async with await self._get(ep, "/server_info") as resp:
            max_running = parse_server_info(await resp.json(content_type=None))
        async with await self._get(ep, "/v1/loads") as resp:
            running, waiting = parse_loads(await resp.json(content_type=None))
        ep.load = {"running": running, "waiting": waiting, "kv_cache_use": None, "slots": max_running,
                   "read_at": round(time.time(), 3)}
        return ServerLoad(max_running, running, waiting)

    async def _read_vllm(self, ep: Endpoint) -> ServerLoad:
        """vLLM: its /metrics, and its running slots estimated from them (``next_slots``)."""
        async with await self._get(ep, "/metrics") as resp:
            load = parse_metrics(await resp.text())
        before = self._preemptions.get(ep.url)
        self._preemptions[ep.url] = load.preemptions
        slots = next_slots(self.slots_estimate.get(ep.url, START), load,
                           preempted=before is not None and load.preemptions > before)
        self.slots_estimate[ep.url] = slots
        ep.load = {"running": load.running, "waiting": load.waiting, "kv_cache_use": round(load.kv_cache_use, 4),
                   "slots": slots, "read_at": round(time.time(), 3)}
        return ServerLoad(slots, load.running, load.waiting)

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
            try:
                kind = await self.pool.detect(ep)
                if kind not in (server_kind.SGLANG, server_kind.VLLM):
                    # another OpenAI-style server (nothing to size from), or not known yet: a fixed share
                    self.shares.setdefault(ep.url, START)
                    continue
                load = await (self._read(ep) if kind == server_kind.SGLANG else self._read_vllm(ep))
            except (aiohttp.ClientError, TimeoutError, ValueError, KeyError, TypeError, ConfigError) as exc:
                self._cannot_read(ep, exc)
                continue
            if self._unreadable.pop(ep.url, None) is not None:
                log.info("capacity: %s read again", ep.url)
            live = await self._live_workers(ep)
            self.targets[ep.url] = next_target(load, sum(live.values()))
            self.shares[ep.url] = max(1, my_share(self.targets[ep.url], list(live), self.name))
        self.apply(max(1, sum(self.shares.values())))
        return self.slots.limit

    def _cannot_read(self, ep: Endpoint, exc: Exception) -> None:
        """Keep the endpoint's share; say why once (again only when the reason changes)."""
        self.shares.setdefault(ep.url, START)
        why = str(exc) or type(exc).__name__
        if self._unreadable.get(ep.url) != why:
            self._unreadable[ep.url] = why
            log.info("capacity: cannot read %s (%s); keeping its share %d", ep.url, why, self.shares[ep.url])

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
