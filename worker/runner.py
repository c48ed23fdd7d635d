"""The concurrent worker: up to N RQ jobs in flight in one asyncio process.

Blocking RQ bookkeeping runs in a small thread pool so it never stalls the
event loop; budget scripts use redis.asyncio; all requests share one aiohttp session.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import signal
import socket
import time
import traceback
import uuid
from concurrent.futures import ThreadPoolExecutor

import aiohttp
import redis
import redis.asyncio as aredis

from shared import keys
from shared.budget import AsyncBudget
from shared.config import Config
from shared.schema import JobPayload
from worker import rq_adapter
from worker.process import process_prompt
from worker.sglang_client import SGLangClient

log = logging.getLogger("budgetq.worker")
POP_TIMEOUT_S = 1
DATASETS_REFRESH_S = 1.0


class _Slots(asyncio.Semaphore):
    """The server-slot semaphore, also counting how many are held (and the peak)."""

    def __init__(self, n: int) -> None:
        super().__init__(n)
        self.held = 0
        self.peak = 0

    async def __aenter__(self) -> None:
        await self.acquire()
        self.held += 1
        self.peak = max(self.peak, self.held)

    async def __aexit__(self, *exc: object) -> None:
        self.held -= 1
        self.release()


class ConcurrentWorker:
    def __init__(self, cfg: Config, concurrency: int, burst: bool = False, grace_s: float = 30.0) -> None:
        self.cfg = cfg
        self.concurrency = concurrency
        self.burst = burst
        self.grace_s = grace_s
        self.name = f"budgetq-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.conn = redis.Redis.from_url(cfg.redis_url)
        self._stop = asyncio.Event()
        self._rotation = 0
        self._names: list[str] = []
        self._names_read_at = float("-inf")
        self.processed = 0
        # Jobs fetched and marked started ahead of a free server slot, so the slot refills at once.
        self.prefetch = concurrency // 4 + 4
        self._slots = _Slots(concurrency)
        self._running: dict[str, tuple] = {}  # job id -> (job, execution), for heartbeats
        # Blocking RQ/redis calls get their own threads: the default pool has only cpu+4.
        self._pool = ThreadPoolExecutor(max_workers=16, thread_name_prefix="bq-rq")

    @property
    def in_flight_peak(self) -> int:
        """Most requests this process had at the server at once."""
        return self._slots.peak

    async def _sync(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._pool, functools.partial(fn, *args))

    def _queue_keys(self) -> list[str]:
        # The dataset list changes rarely: re-read it once a second, not on every pop.
        if time.monotonic() - self._names_read_at > DATASETS_REFRESH_S:
            self._names = sorted(n.decode() for n in self.conn.smembers(keys.DATASETS))
            self._names_read_at = time.monotonic()
        names = self._names
        if not names:
            return []
        # Rotate the order each pop: BLPOP checks keys in order, so this gives round-robin.
        self._rotation = (self._rotation + 1) % len(names)
        names = names[self._rotation:] + names[: self._rotation]
        return [f"rq:queue:{keys.queue_name(n)}" for n in names]

    def _pop(self) -> str | None:
        qkeys = self._queue_keys()
        if not qkeys:
            return None
        if self.burst:
            for k in qkeys:
                if (job_id := self.conn.lpop(k)) is not None:
                    return job_id.decode()
            return None
        got = self.conn.blpop(qkeys, timeout=POP_TIMEOUT_S)
        return got[1].decode() if got else None

    async def _handle(self, job_id: str, budget: AsyncBudget, client: SGLangClient) -> None:
        job = await self._sync(rq_adapter.fetch, self.conn, job_id)
        if job is None:
            log.warning("job %s vanished before it ran; skipped", job_id)
            return
        execution = await self._sync(rq_adapter.mark_started, self.conn, job, self.name,
                                     self.cfg.worker.heartbeat_ttl_s)
        self._running[job.id] = (job, execution)
        try:
            payload = JobPayload.model_validate(job.args[0])
            result = await process_prompt(payload, job.id, budget, client, self._slots)
        except asyncio.CancelledError:
            await asyncio.shield(self._sync(rq_adapter.requeue, self.conn, job, execution))
            raise
        except Exception as exc:  # a bad payload or response fails this prompt only
            ds = job.origin.removeprefix(keys.QUEUE_PREFIX)
            log.warning("job %s failed: %s", job.id, exc)
            await self._sync(self._fail, job, execution, ds, traceback.format_exc())
            return
        finally:
            self._running.pop(job.id, None)
        ds = payload.dataset
        # committed/skipped/duplicate are counted inside the Lua scripts; these two here.
        if result["status"] == "already_done" or result.get("reason") == "paused":
            extra = "already_done" if result["status"] == "already_done" else "paused"
            await self._sync(self.conn.hincrby, keys.stats_key(ds), extra, 1)
        await self._sync(rq_adapter.mark_finished, self.conn, job, execution, result, self.name)
        self.processed += 1

    def _fail(self, job, execution, ds: str, exc_string: str) -> None:
        rq_adapter.mark_failed(self.conn, job, execution, exc_string, self.name)
        self.conn.hincrby(keys.stats_key(ds), "failed", 1)

    async def _heartbeats(self, rq_worker) -> None:
        ttl = self.cfg.worker.heartbeat_ttl_s
        while True:
            await asyncio.sleep(max(1.0, ttl / 3))
            try:
                await self._sync(rq_adapter.heartbeat, self.conn, rq_worker, list(self._running.values()), ttl)
            except redis.RedisError as exc:
                log.warning("worker %s: heartbeat failed: %s", self.name, exc)

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._stop.set)
        aconn = aredis.Redis(connection_pool=aredis.BlockingConnectionPool.from_url(
            self.cfg.redis_url, max_connections=max(16, self.concurrency // 4)))
        budget = AsyncBudget(aconn)
        rq_worker = await self._sync(rq_adapter.register_worker, self.conn, self.name, [])
        tasks: set[asyncio.Task] = set()
        beat = asyncio.create_task(self._heartbeats(rq_worker))
        connector = aiohttp.TCPConnector(limit=0)
        log.info("worker %s: %d in flight max, servers %s", self.name, self.concurrency, self.cfg.server.urls)
        try:
            async with aiohttp.ClientSession(connector=connector) as session:
                client = SGLangClient(session, self.cfg.server)
                while not self._stop.is_set():
                    if len(tasks) >= self.concurrency + self.prefetch:
                        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
                        continue
                    job_id = await self._sync(self._pop)
                    if job_id is None:
                        if self.burst and not tasks:
                            break
                        if self.burst:
                            await asyncio.wait(tasks, timeout=0.05)
                        continue
                    t = asyncio.create_task(self._handle(job_id, budget, client))
                    tasks.add(t)
                    t.add_done_callback(tasks.discard)
                if tasks:
                    log.info("worker %s: stopping, waiting up to %.0fs for %d jobs", self.name,
                             self.grace_s, len(tasks))
                    _done, pending = await asyncio.wait(tasks, timeout=self.grace_s)
                    for t in pending:
                        t.cancel()
                    await asyncio.gather(*pending, return_exceptions=True)
        finally:
            beat.cancel()
            await self._sync(rq_worker.register_death)
            await aconn.aclose()
            self._pool.shutdown(wait=False)
        log.info("worker %s: exited after %d jobs (peak %d in flight)", self.name, self.processed,
                 self.in_flight_peak)
        return 0
