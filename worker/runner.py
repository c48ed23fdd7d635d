"""The concurrent worker: many RQ jobs in flight in one asyncio process.

Jobs are claimed in batches (claim.lua: queue -> started registry, atomically), each job
runs as a task (worker/jobflow.py), and every script call of all tasks (reserve, commit,
release, finish in RQ's layout) is coalesced into pipelines (shared.scripts.Batcher).
The few blocking calls (RQ worker registration, lease heartbeats, maintenance) run in a
small thread pool. Background loops: control (budgets, pauses, aborts, reservation
refresh), this worker's status, lease heartbeats, maintenance, and stats counters.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import os
import signal
import socket
import time
import uuid
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import aiohttp

from shared import jobs, keys
from shared.config import Config
from shared.maintenance import Maintenance
from shared.redis_conn import aconnect, connect
from shared.retry import REDIS_DOWN, retry_redis
from shared.scripts import Batcher
from worker import rq_adapter
from worker.control import Control
from worker.estimator import LengthModel
from worker.jobflow import Phase, Tracked, run_job
from worker.sglang_client import SGLangClient

log = logging.getLogger("budgetq.worker")
CLAIM_BATCH = 64
FLUSH_INTERVAL_S = 0.5


class _Slots(asyncio.Semaphore):
    """The server-slot semaphore, also counting how many are held (and the peak)."""

    def __init__(self, n: int) -> None:
        super().__init__(n)
        self.held = 0
        self.peak = 0

    async def acquire(self) -> bool:
        await super().acquire()
        self.held += 1
        self.peak = max(self.peak, self.held)
        return True

    def release(self) -> None:
        self.held -= 1
        super().release()


class ConcurrentWorker:
    def __init__(self, cfg: Config, concurrency: int, burst: bool = False, grace_s: float | None = None) -> None:
        self.cfg = cfg
        self.concurrency = concurrency
        self.burst = burst
        self.grace_s = cfg.worker.grace_s if grace_s is None else grace_s
        self.ttl = cfg.worker.heartbeat_ttl_s
        self.name = f"budgetq-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.conn = connect(cfg.redis_url)
        # Jobs claimed ahead of a free server slot, so a slot refills at once.
        self.prefetch = concurrency // 4 + 4
        self.slots = _Slots(concurrency)
        self.jobs: dict[str, Tracked] = {}     # registry member -> job being handled
        self.length = LengthModel()
        self.control = Control(self)
        self.processed = 0
        # Redis round trips outside the batcher (bookkeeping, heartbeats, control, status);
        # with batcher.round_trips, the orchestration cost per prompt (bench/orchestration.py).
        self.other_round_trips = 0
        self.outcomes: Counter[str] = Counter()
        self.stat_incr: Counter[tuple[str, str]] = Counter()
        self.stopping = asyncio.Event()
        self.forced = False
        self.wake = asyncio.Event()
        self._rotation = 0
        # Blocking RQ/redis calls get their own threads: the default pool has only cpu+4.
        self._pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="bq-rq")

    @property
    def round_trips(self) -> int:
        return self.batch.round_trips + self.other_round_trips + self.control.round_trips

    @property
    def in_flight_peak(self) -> int:
        """Most requests this process had at the server at once."""
        return self.slots.peak

    async def sync(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._pool, functools.partial(fn, *args))

    def count(self, ds: str, field: str, by: int = 1) -> None:
        self.stat_incr[(ds, field)] += by

    async def end(self, t: Tracked, status: str, result: dict | None = None, *, error: str = "",
                  skipped: str = "", stat: str = "") -> bool:
        """Record how a job ended (RQ status finished, failed or canceled) and count it; one
        script call, coalesced with the others of this loop turn. False if we no longer hold
        the job (its lease ran out and it was requeued): its new holder records it."""
        call = jobs.finish(t.ds, t.claimed, status, t.started_at, self.name, result=result, error=error,
                           skipped=skipped, stat=stat)
        recorded = await retry_redis(lambda: self.batch(call), f"finish {t.claimed.job_id}", give_up_after_s=60)
        if recorded:
            self.processed += 1
            self.outcomes[(result or {}).get("status", status)] += 1
        return recorded

    # -- signals -------------------------------------------------------------------------
    def _on_signal(self, signame: str) -> None:
        if not self.stopping.is_set():
            log.warning("worker %s: %s: finishing requests in flight (up to %.0f s), requeueing the rest; "
                        "send it again to stop at once", self.name, signame, self.grace_s)
            self.stopping.set()
        else:
            log.warning("worker %s: second %s: aborting requests in flight and requeueing them", self.name, signame)
            self.forced = True
        self.wake.set()

    # -- claiming ------------------------------------------------------------------------
    def _unparked(self) -> int:
        return sum(1 for t in self.jobs.values() if t.phase is not Phase.PARKED)

    async def _feed(self) -> None:
        idle = 0
        while not self.stopping.is_set():
            room = self.concurrency + self.prefetch - self._unparked()
            if room <= 0:
                self.wake.clear()
                await self.wake.wait()
                continue
            names = self.control.claimable()
            got = 0
            if names:
                self._rotation = (self._rotation + 1) % len(names)
                names = names[self._rotation:] + names[: self._rotation]
                share = max(1, min(CLAIM_BATCH, room // len(names)))
                lease_end = time.time() + self.ttl
                try:
                    batches = await asyncio.gather(*[self.batch(jobs.claim(ds, share, lease_end, self.name))
                                                     for ds in names])
                except REDIS_DOWN as exc:
                    log.warning("worker %s: cannot claim jobs, redis unreachable: %s", self.name, exc)
                    await asyncio.sleep(1.0)
                    continue
                for ds, claimed in zip(names, batches, strict=True):
                    for c in claimed:
                        t = Tracked(c, ds)
                        self.jobs[c.member] = t
                        t.task = asyncio.create_task(run_job(self, t))
                        got += 1
            if got:
                idle = 0
                continue
            if self.burst and not self.jobs:
                return
            idle += 1
            self.wake.clear()
            try:
                await asyncio.wait_for(self.wake.wait(), timeout=min(0.2, 0.002 * 2 ** min(idle, 7)))
            except TimeoutError:
                pass

    # -- background loops ----------------------------------------------------------------
    async def _every(self, interval_s: float, fn, what: str) -> None:
        while True:
            await asyncio.sleep(interval_s)
            try:
                await fn()
            except REDIS_DOWN as exc:
                log.warning("worker %s: %s skipped, redis unreachable: %s", self.name, what, exc)
            except Exception:  # a bug in a background loop must not kill the worker silently
                log.exception("worker %s: %s failed", self.name, what)

    async def _heartbeat(self) -> None:
        leases = [(t.ds, t.claimed.member, t.claimed.job_id) for t in self.jobs.values()]
        self.other_round_trips += 1
        await self.sync(rq_adapter.heartbeat, self.conn, self.rq_worker, leases, self.ttl)

    async def _maintain(self) -> None:
        await self.sync(self.maintenance.run_once)

    async def flush(self) -> None:
        """Write the stats counters gathered outside job endings (retries)."""
        if not self.stat_incr:
            return
        incr, self.stat_incr = self.stat_incr, Counter()
        try:
            async with self.aconn.pipeline(transaction=False) as p:
                for (ds, field), n in incr.items():
                    p.hincrby(keys.stats_key(ds), field, n)
                await p.execute()
            self.other_round_trips += 1
        except BaseException:
            self.stat_incr.update(incr)  # keep them for the next try
            raise

    async def _publish(self) -> None:
        """This worker's line in `budgetq status`: in flight, processed, endpoints' health."""
        fields = {"host": socket.gethostname(), "pid": os.getpid(), "started_at": self._started_at,
                  "concurrency": self.concurrency, "in_flight": self.slots.held, "claimed": len(self.jobs),
                  "processed": self.processed, "endpoints": json.dumps(self.client.pool.snapshot()),
                  "round_trips": self.round_trips}
        self.other_round_trips += 1
        async with self.aconn.pipeline(transaction=False) as p:
            p.hset(keys.worker_key(self.name), mapping=fields)
            p.expire(keys.worker_key(self.name), self.ttl * 2)
            p.sadd(keys.WORKERS, self.name)
            await p.execute()

    # -- shutdown ------------------------------------------------------------------------
    async def _drain(self) -> None:
        """Requeue what has not started, give requests in flight the grace period, requeue the rest."""
        for t in list(self.jobs.values()):
            if t.phase in (Phase.PENDING, Phase.PARKED):
                t.cancel("shutdown")
        deadline = time.monotonic() + self.grace_s
        while self.jobs and not self.forced and time.monotonic() < deadline:
            self.wake.clear()
            try:
                await asyncio.wait_for(self.wake.wait(), timeout=min(0.5, max(0.01, deadline - time.monotonic())))
            except TimeoutError:
                pass
        if self.jobs:
            log.warning("worker %s: requeueing %d jobs still in flight", self.name, len(self.jobs))
        for t in list(self.jobs.values()):
            t.cancel("shutdown", force=True)
        tasks = [t.task for t in self.jobs.values() if t.task is not None]
        if tasks:
            await asyncio.wait(tasks, timeout=15)

    # -- main ----------------------------------------------------------------------------
    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_signal, sig.name)
        self._started_at = time.time()
        self.aconn = aconnect(self.cfg.redis_url, max_connections=max(8, self.concurrency // 8))
        self.batch = Batcher(self.aconn)
        self.maintenance = Maintenance(self.conn, self.cfg.worker.maintenance_interval_s)
        self.rq_worker = await self.sync(rq_adapter.register_worker, self.conn, self.name)
        session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, ttl_dns_cache=300))
        self.client = SGLangClient(session, self.cfg.server, on_retry=lambda ds: self.count(ds, "retried"))
        await self.control.tick()
        log.info("worker %s: up to %d requests in flight, servers %s", self.name, self.concurrency,
                 ", ".join(self.cfg.server.urls))
        loops = [asyncio.create_task(c) for c in (
            self._every(self.cfg.worker.control_interval_s, self.control.tick, "control"),
            self._every(max(1.0, self.ttl / 3), self._heartbeat, "heartbeat"),
            self._every(self.cfg.worker.maintenance_interval_s, self._maintain, "maintenance"),
            self._every(FLUSH_INTERVAL_S, self.flush, "stats"),
            self._every(max(1.0, self.cfg.worker.control_interval_s), self._publish, "status"),
        )]
        try:
            await self._feed()
            await self._drain()
        finally:
            for t in loops:
                t.cancel()
            await asyncio.gather(*loops, return_exceptions=True)
            await self._close(session)
        log.info("worker %s: exited after %d jobs (%s; peak %d in flight; %d redis round trips)", self.name,
                 self.processed, ", ".join(f"{k} {v}" for k, v in sorted(self.outcomes.items())) or "none",
                 self.in_flight_peak, self.round_trips)
        return 0

    async def _close(self, session: aiohttp.ClientSession) -> None:
        for attempt in range(20):
            try:
                await self.flush()
                break
            except REDIS_DOWN as exc:
                if attempt == 19:
                    log.error("worker %s: could not record %d stats counters: %s", self.name,
                              sum(self.stat_incr.values()), exc)
                await asyncio.sleep(0.5)
        try:
            await self.sync(self.rq_worker.register_death)
            await self.aconn.delete(keys.worker_key(self.name))
            await self.aconn.srem(keys.WORKERS, self.name)
        except REDIS_DOWN as exc:
            log.warning("worker %s: could not deregister: %s", self.name, exc)
        await self.client.close()
        await session.close()
        await self.aconn.aclose()
        self._pool.shutdown(wait=False)

