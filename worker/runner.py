"""The concurrent worker: many RQ jobs in flight in one asyncio process. This module schedules;
what happens to a job is decided in worker/jobflow.py.

Jobs are claimed in batches (claim.lua: queue -> started registry, atomically), each job
runs as a task (worker/jobflow.py), and every script call of all tasks (reserve, commit,
release, finish in RQ's layout) is coalesced into pipelines (shared.scripts.Batcher).
The few blocking calls (RQ worker registration, lease heartbeats, maintenance) run in a small thread
pool. Background loops: control (budgets, pauses, aborts, reservations), status, leases, maintenance, stats.
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
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal, TypeVar

import aiohttp
import redis.asyncio as aredis
from rq import Worker

from budgetq.shared import jobs, keys, server_faults
from budgetq.shared.config import Config
from budgetq.shared.errors import BudgetqError
from budgetq.shared.maintenance import Maintenance
from budgetq.shared.redis_conn import aconnect, await_ready, connect, explain
from budgetq.shared.retry import REDIS_DOWN, retry_redis
from budgetq.shared.scripts import Batcher
from budgetq.shared.stats import Stat
from budgetq.worker import rq_adapter
from budgetq.worker.capacity import START, Capacity
from budgetq.worker.context import JobContext, Slots
from budgetq.worker.control import Control
from budgetq.worker.estimator import LengthModel
from budgetq.worker.jobflow import run_job
from budgetq.worker.loops import Loops
from budgetq.worker.recorder import Recorder
from budgetq.worker.sglang_client import SGLangClient
from budgetq.worker.tracked import Abort, JobTable, Phase, Tracked, report_long_held
from budgetq.worker.vllm_load import read_loads

log = logging.getLogger("budgetq.worker")
CLAIM_BATCH = 64
FLUSH_INTERVAL_S = 0.5
# Shutdown bounds, whatever Redis or the servers do: after the first signal the worker exits
# within grace_s + CLOSE_S (requeue, release, deregister), after a second one within FORCED_EXIT_S.
# What it could not clean up in time (Redis hung or down) comes back through the job leases.
CLOSE_S = 10.0
FORCED_EXIT_S = 5.0
T = TypeVar("T")


class ConcurrentWorker:
    def __init__(self, cfg: Config, concurrency: int | Literal["auto"], burst: bool = False,
                 grace_s: float | None = None) -> None:
        self.cfg = cfg
        # concurrency auto: sized from the servers by worker/capacity.py once running.
        self.auto = concurrency == "auto"
        self.burst = burst
        self.grace_s = cfg.worker.grace_s if grace_s is None else grace_s
        self.ttl = cfg.worker.heartbeat_ttl_s
        self.name = f"budgetq-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.conn = connect(cfg.redis_url)
        self.slots = Slots(START * len(cfg.server.urls) if concurrency == "auto" else concurrency)
        self.jobs: JobTable = {}
        self.length = LengthModel()
        # Redis round trips outside the batcher (heartbeats, status): part of bench/orchestration.py's cost.
        self.other_round_trips = 0
        self.stopping = asyncio.Event()
        self.forced = False
        self._stop_at: float | None = None     # monotonic time of the first / second signal
        self._forced_at: float | None = None
        # The exit deadline passed with calls blocked on Redis in threads: the CLI exits without joining them.
        self.abandoned = False
        self.rq_worker: Worker | None = None
        self.wake = asyncio.Event()
        self._rotation = 0
        # Blocking RQ/redis calls get their own threads: the default pool has only cpu+4.
        self._pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="bq-rq")

    # Built in run(), where there is an event loop: the connections, the HTTP session, and the
    # one JobContext every job gets (the only part of the worker a job can reach).
    aconn: aredis.Redis
    batch: Batcher
    session: aiohttp.ClientSession
    client: SGLangClient
    control: Control
    recorder: Recorder
    maintenance: Maintenance
    ctx: JobContext

    def _build(self) -> None:
        self.aconn = aconnect(self.cfg.redis_url, max_connections=max(8, self.concurrency // 8,
                                                                      32 if self.auto else 0))
        self.batch = Batcher(self.aconn)
        self.maintenance = Maintenance(self.conn, self.cfg.worker.maintenance_interval_s)
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, ttl_dns_cache=300))
        self.recorder = Recorder(self.batch, self.aconn, self.name)
        self.client = SGLangClient(self.session, self.cfg.server,
                                   on_retry=lambda ds: self.recorder.count(ds, Stat.RETRIED))
        self.control = Control(self.aconn, self.batch, self.length, self.jobs, self.wake,
                               self.cfg.worker.taper_estimate)
        self.capacity = Capacity(self.name, self.aconn, self.client.pool, self.slots, self.wake,
                                 self.cfg.worker.capacity_interval_s) if self.auto else None
        self.ctx = JobContext(batch=self.batch, client=self.client, slots=self.slots, length=self.length,
                              control=self.control, recorder=self.recorder, jobs=self.jobs, wake=self.wake)

    @property
    def round_trips(self) -> int:
        return (self.batch.round_trips + self.other_round_trips + self.control.round_trips
                + self.recorder.round_trips + (self.capacity.round_trips if self.capacity else 0))

    @property
    def concurrency(self) -> int:
        """Requests this process keeps in flight (changes live with concurrency: auto)."""
        return self.slots.limit

    @property
    def prefetch(self) -> int:
        """Jobs claimed ahead of a free server slot, so a slot refills at once."""
        return self.slots.limit // 4 + 4

    @property
    def processed(self) -> int:
        return self.recorder.processed if hasattr(self, "recorder") else 0

    @property
    def in_flight_peak(self) -> int:
        """Most requests this process had at the server at once."""
        return self.slots.peak

    async def sync(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, functools.partial(fn, *args))

    # -- signals -------------------------------------------------------------------------
    def _on_signal(self, signame: str) -> None:
        if not self.stopping.is_set():
            log.warning("worker %s: %s: finishing requests in flight (up to %.0f s), requeueing the rest; "
                        "send it again to stop at once", self.name, signame, self.grace_s)
            self._stop_at = time.monotonic()
            self.stopping.set()
        elif not self.forced:
            log.warning("worker %s: second %s: aborting requests in flight and requeueing them", self.name, signame)
            self._forced_at = time.monotonic()
            self.forced = True
        self.wake.set()

    # -- claiming ------------------------------------------------------------------------
    def _unparked(self) -> int:
        return sum(1 for t in self.jobs.values() if t.phase is not Phase.PARKED)

    async def _feed(self) -> None:
        idle = 0
        while not self.stopping.is_set():
            if not self.client.pool.any_healthy:
                if await self._servers_down():
                    return
                continue
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
                        t.task = asyncio.create_task(run_job(self.ctx, t))
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

    async def _servers_down(self) -> bool:
        """No server answers (our link cut, or all down): the jobs go back to the queue (commits are kept) for a
        worker that reaches one; claim nothing until one answers. True: a burst worker, which exits instead."""
        back = [t for t in self.jobs.values() if t.phase is not Phase.COMMITTING]
        log.warning("worker %s: all servers are down (%s): handing %d jobs back to the queue; %s", self.name,
                    ", ".join(self.cfg.server.urls), len(back), "exiting (--burst)" if self.burst else "waiting")
        for t in back:
            t.cancel(Abort.SHUTDOWN)
        if not self.burst:
            await self.client.pool.until_healthy(self.stopping)
        return self.burst

    async def _watch_servers(self) -> None:  # wake the feeder, which may be waiting for room
        if not self.client.pool.any_healthy:
            self.wake.set()

    # -- background loops ----------------------------------------------------------------
    async def _heartbeat(self) -> None:
        assert self.rq_worker is not None  # the loops start after registration
        leases = [(t.ds, t.claimed.member, t.claimed.job_id) for t in self.jobs.values()]
        self.other_round_trips += 1
        await self.sync(rq_adapter.heartbeat, self.conn, self.rq_worker, leases, self.ttl)

    async def _maintain(self) -> None:
        await self.sync(self.maintenance.run_once)

    async def _publish(self) -> None:
        """This worker's line in `budgetq status`: in flight, processed, endpoints' health; jobs held long."""
        report_long_held(self.jobs, log)
        fields: dict[Any, Any] = {"host": socket.gethostname(), "pid": os.getpid(), "started_at": self._started_at,
                  "concurrency": self.concurrency, "in_flight": self.slots.held, "claimed": len(self.jobs),
                  "processed": self.processed, "endpoints": json.dumps(self.client.pool.snapshot()),
                  "round_trips": self.round_trips,
                  # the hash's TTL, set below at every publish: a reader tells a silent worker from
                  # its remaining TTL, on Redis's clock (shared/status.py is_live)
                  "expire_s": self.ttl * 2, "publish_s": max(1.0, self.cfg.worker.control_interval_s)}
        self.other_round_trips += 1
        async with self.aconn.pipeline(transaction=False) as p:
            p.hset(keys.worker_key(self.name), mapping=fields)
            p.expire(keys.worker_key(self.name), self.ttl * 2)
            p.sadd(keys.WORKERS, self.name)
            server_faults.publish(p, self.name, self.client.pool.faults_snapshot(), self.ttl * 2)
            await p.execute()

    # -- shutdown ------------------------------------------------------------------------
    async def _drain(self) -> None:
        """Requeue what has not started, give requests in flight the grace period, requeue the rest."""
        for t in list(self.jobs.values()):
            if t.phase in (Phase.PENDING, Phase.PARKED):
                t.cancel(Abort.SHUTDOWN)
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
            t.cancel(Abort.SHUTDOWN, force=True)
        tasks = [t.task for t in self.jobs.values() if t.task is not None]
        if tasks:
            await asyncio.wait(tasks, timeout=CLOSE_S / 2)

    # -- main ----------------------------------------------------------------------------
    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_signal, sig.name)
        self._started_at = time.time()
        self._build()
        rc = await self._supervise(asyncio.create_task(self._main()))
        log.info("worker %s: exited after %d jobs (%s; peak %d in flight; %d redis round trips)", self.name,
                 self.processed, ", ".join(f"{k} {v}" for k, v in sorted(self.recorder.outcomes.items())) or "none",
                 self.in_flight_peak, self.round_trips)
        return rc

    def _exit_deadline(self) -> float | None:
        if self._forced_at is not None:
            return self._forced_at + FORCED_EXIT_S
        if self._stop_at is not None:
            return self._stop_at + self.grace_s + CLOSE_S
        return None

    async def _supervise(self, main: asyncio.Task[int]) -> int:
        """Wait for the worker's main task; past the exit deadline of a stop request, cut it short."""
        while True:
            done, _ = await asyncio.wait({main}, timeout=0.25)
            if done:
                return main.result()
            deadline = self._exit_deadline()
            if deadline is not None and time.monotonic() > deadline:
                log.error("worker %s: shutdown did not finish in time (Redis not answering?); exiting with %d jobs "
                          "held: their leases (%d s) expire and the maintenance pass requeues them", self.name,
                          len(self.jobs), self.ttl)
                main.cancel()
                await asyncio.wait({main}, timeout=1.0)
                self.abandoned = True
                await self._close_local()
                return 1

    async def _start(self) -> bool:
        """Wait for Redis (up to redis_wait_s), register with RQ, read the budgets, ask the servers what they
        are (worker/endpoints.py). False if stopped first."""
        what = f"worker {self.name}"
        wait_s = self.cfg.redis_wait_s
        try:
            if not await await_ready(self.aconn.ping, self.cfg.redis_url, wait_s, what, self.stopping):
                return False
            self.rq_worker = await retry_redis(lambda: self.sync(rq_adapter.register_worker, self.conn, self.name),
                                               "register", give_up_after_s=wait_s, stop=self.stopping)
            await retry_redis(self.control.tick, "read budgets", give_up_after_s=wait_s, stop=self.stopping)
            await self.client.pool.detect_all()  # what each server is; several models, no server.model: exit
        except REDIS_DOWN as exc:
            if self.stopping.is_set():
                return False
            raise BudgetqError(explain(exc, self.cfg.redis_url)) from None
        return not self.stopping.is_set()

    async def _main(self) -> int:
        try:
            if not await self._start():
                log.warning("worker %s: stopped before it started", self.name)
                return 0
            log.info("worker %s: up to %d requests in flight, servers %s", self.name, self.concurrency,
                     ", ".join(self.cfg.server.urls))
            loops = Loops(self.name)
            loops.every(self.cfg.worker.control_interval_s, self.control.tick, "control")
            loops.every(max(1.0, self.ttl / 3), self._heartbeat, "heartbeat")
            loops.every(self.cfg.worker.maintenance_interval_s, self._maintain, "maintenance")
            loops.every(FLUSH_INTERVAL_S, self.recorder.flush, "stats")
            loops.every(FLUSH_INTERVAL_S, self._watch_servers, "servers")
            loops.every(max(1.0, self.cfg.worker.control_interval_s), self._publish, "status")
            if self.capacity:
                loops.run(self.capacity.run(self.stopping), "capacity")
            else:   # a fixed concurrency sizes nothing, but `budgetq status` still shows vLLM's load
                unreadable: dict[str, str] = {}
                loops.every(self.cfg.worker.capacity_interval_s, lambda: read_loads(self.client.pool, unreadable),
                            "loads")
            try:
                await self._feed()
                await self._drain()
            finally:
                await loops.stop()
        finally:
            await self._close()
        return 0

    async def _close(self) -> None:
        """Write the last counters and deregister, within CLOSE_S even if Redis does not answer."""
        if self.rq_worker is None:  # never started: nothing in Redis to clean up
            await self._close_local()
            return
        deadline = time.monotonic() + CLOSE_S
        while self.recorder.pending and time.monotonic() < deadline:
            try:
                await asyncio.wait_for(self.recorder.flush(), timeout=max(0.1, deadline - time.monotonic()))
            except (*REDIS_DOWN, TimeoutError) as exc:
                if time.monotonic() + 0.5 >= deadline:
                    log.error("worker %s: could not record %d stats counters: %s", self.name,
                              sum(self.recorder.pending.values()), exc)
                    break
                await asyncio.sleep(0.5)
        try:
            async with asyncio.timeout(max(0.1, deadline - time.monotonic())):
                await self.sync(self.rq_worker.register_death)
                await self.aconn.delete(keys.worker_key(self.name))
                await self.aconn.srem(keys.WORKERS, self.name)
        except (*REDIS_DOWN, TimeoutError) as exc:
            log.warning("worker %s: could not deregister (its entry expires by itself): %s", self.name,
                        exc or "timed out")
        await self._close_local()

    async def _close_local(self) -> None:
        """Close what needs no Redis: HTTP sessions, the connection pools, the thread pool."""
        if getattr(self, "_closed", False):
            return
        self._closed = True
        try:
            await self.client.close()  # lets pending /abort_request calls finish (bounded)
            await self.session.close()
        finally:
            if self.abandoned:
                # wake threads blocked on a socket that never answers (redis-py shuts the sockets down)
                self.conn.connection_pool.disconnect()
            try:
                await asyncio.wait_for(self.aconn.aclose(), timeout=1.0)
            except (*REDIS_DOWN, TimeoutError):
                pass
            self._pool.shutdown(wait=False, cancel_futures=True)
