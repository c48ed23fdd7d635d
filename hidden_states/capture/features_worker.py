"""The features worker (``budgetq features-worker``): prefill requests that return hidden states.

A small asyncio loop of its own, apart from the generation worker (worker/runner.py): it claims
jobs of the ``bq-<ds>-features`` queues with the same claim/finish/requeue scripts
(shared/jobs.py, so rq-dashboard shows them), hands each job's token ids to its capture backend
(hidden_states/capture/backends.py: ``http`` prefills on SGLang servers and decodes their JSON;
``transformers`` runs the model in this process, transformers_backend.py) and XADDs the tensor bytes
to the dataset's features stream, where the producer-side collector (hidden_states/collect/features_pass.py) writes
shards: workers need no shared filesystem. With ``features.store`` (a volume the collector sees too) the worker
writes the sample's shard there itself and XADDs only an index message (``deliver``).

Memory is bounded twice: this process holds at most ``features.worker_max_mb`` of responses and
decoded tensors (claims wait; one job is always allowed), and it claims nothing for a dataset
whose stream already holds ``features.redis_max_mb`` not yet on disk.
A worker killed at any instant: its jobs' leases lapse and the collector requeues them; a
result already in the stream is recognised by id and written once.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import signal
import socket
import time
import uuid
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import Any

from rq import get_current_job

from budgetq.hidden_states.capture.backends import HttpBackend, features_server, make_backend
from budgetq.hidden_states.capture.captured import CaptureBackend, Captured
from budgetq.hidden_states.capture.decode import HiddenStatesError
from budgetq.hidden_states.schema import FeaturesMeta, FeaturesPayload
from budgetq.hidden_states.store import fault_points
from budgetq.hidden_states.store.shards import features_dir, features_root, write_sample_shard
from budgetq.shared import jobs, keys
from budgetq.shared.config import Config
from budgetq.shared.config_load import load_config
from budgetq.shared.errors import FatalRequestError, RetryableRequestError
from budgetq.shared.identity import job_id as job_id_of
from budgetq.shared.jobs import Claimed
from budgetq.shared.redis_conn import aconnect, connect, text
from budgetq.shared.retry import REDIS_DOWN
from budgetq.shared.scripts import arun
from budgetq.shared.stats import Stat
from budgetq.worker import rq_adapter

log = logging.getLogger("budgetq.features")
MB = 2**20
# Longest wait between polls of idle queues (a claim round trip per dataset each time).
IDLE_POLL_S = 0.1
# A features.store write failing with one of these (a full or flaky volume) is tried again, STORE_WRITE_TRIES
# times in all, STORE_RETRY_S apart, doubling; then the job goes back to its queue and this worker claims nothing
# for STORE_PAUSE_S (doubling up to STORE_PAUSE_MAX_S while the fault lasts). Others (EACCES, EROFS ...) are
# not a passing state of the volume: they fail the job, saying so.
STORE_TRANSIENT = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.ESTALE, errno.EAGAIN, errno.EINTR,
                             errno.ETIMEDOUT, errno.EBUSY, errno.ENOMEM, errno.ECONNRESET, errno.EHOSTDOWN})
STORE_WRITE_TRIES, STORE_RETRY_S, STORE_PAUSE_S, STORE_PAUSE_MAX_S = 4, 0.5, 5.0, 120.0


__all__ = ["FeaturesWorker", "StoreHealth", "features_server", "run_features_job"]


class StoreHealth:
    """features.store's write failures as the operator sees them: one line when writes start failing (not one a
    retry: a full volume would print thousands), one when a job is handed back and claims pause (FeaturesWorker),
    and an info line once a write succeeds again."""

    def __init__(self) -> None:
        self.failing_since: float | None = None   # time.monotonic() of the first failure since the last success
        self.failures = 0

    def failed(self, payload: FeaturesPayload, exc: OSError) -> None:
        self.failures += 1
        if self.failing_since is None:
            self.failing_since = time.monotonic()
            log.warning("features.store: writing the shard of %s/%s failed: %s; each write is tried %d times, then "
                        "its job goes back to its queue (no further line until the store takes a write again)",
                        payload.dataset, payload.id, exc, STORE_WRITE_TRIES)

    def ok(self) -> None:
        if self.failing_since is not None:
            log.info("features.store takes writes again: %d failed writes over %.1f s, each retried", self.failures,
                     time.monotonic() - self.failing_since)
            self.failing_since = None
            self.failures = 0


@dataclass
class _Held:
    ds: str
    claimed: Claimed
    started_at: float
    bytes: int
    task: asyncio.Task | None = None


class FeaturesWorker:
    def __init__(self, cfg: Config, concurrency: int | None = None, burst: bool = False) -> None:
        self.cfg = cfg
        self.f = cfg.features
        self.concurrency = concurrency or self.f.concurrency
        self.burst = burst
        self.ttl = cfg.worker.heartbeat_ttl_s
        self.name = f"budgetq-features-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.conn = connect(cfg.redis_url)
        self.held: dict[str, _Held] = {}
        self.held_bytes = 0
        self.backend: CaptureBackend = make_backend(cfg)
        self.processed = 0
        self.from_generation = 0  # features.vllm.single_pass: samples stored from their generation request
        self.failed = 0
        self.memory_waits = 0      # jobs that waited for features.worker_max_mb
        self.peak_held_jobs = 0    # most jobs holding response bytes at once
        self._paused: set[str] = set()
        self.store_pause_s = 0.0           # the last pause after features.store writes kept failing (0: none)
        self.store_paused_until = 0.0      # time.monotonic() before which nothing is claimed
        self.store_health = StoreHealth()
        self.stopping = asyncio.Event()
        self.wake = asyncio.Event()

    # -- admission -----------------------------------------------------------------------
    def _room_for(self, n_tokens: int) -> bool:
        """Whether a job of n tokens may send its request now: it fits under features.worker_max_mb
        with what the other jobs hold, or nothing is held at all (one job always runs)."""
        est = n_tokens * self.backend.bytes_per_token()
        return self.held_bytes == 0 or self.held_bytes + est <= self.f.worker_max_mb * MB

    async def _claimable(self) -> list[str]:
        members = await self.aconn.smembers(keys.FEATURES_DATASETS)
        names = sorted(text(n) for n in members)
        if not names:
            return []
        pending = await self.aconn.mget([keys.features_pending_key(ds) for ds in names])
        cap = self.f.redis_max_mb * MB
        out = []
        for ds, p in zip(names, pending, strict=True):
            if int(p or 0) < cap:
                self._paused.discard(ds)
                out.append(ds)
            elif ds not in self._paused:
                self._paused.add(ds)
                log.info("features worker %s: %s paused: %.1f MB wait in Redis for the collector "
                         "(features.redis_max_mb %g)", self.name, ds, int(p or 0) / MB, self.f.redis_max_mb)
        return out

    async def _feed(self) -> None:
        idle = 0
        while not self.stopping.is_set():
            got = 0
            store_ok = time.monotonic() >= self.store_paused_until
            if store_ok and len(self.held) < self.concurrency and (
                    not self.held or self.held_bytes < self.f.worker_max_mb * MB):
                try:
                    for ds in await self._claimable():
                        if len(self.held) >= self.concurrency:
                            break
                        lease_end = time.time() + self.ttl
                        for c in await arun(self.aconn, jobs.claim(keys.features_name(ds), 1, lease_end, self.name)):
                            self._start(ds, c)
                            got += 1
                except REDIS_DOWN as exc:
                    log.warning("features worker %s: cannot claim, redis unreachable: %s", self.name, exc)
                    await asyncio.sleep(1.0)
                    continue
            if got:
                idle = 0
                continue
            if self.burst and not self.held:
                return
            idle += 1
            self.wake.clear()
            try:
                await asyncio.wait_for(self.wake.wait(), timeout=min(IDLE_POLL_S, 0.005 * 2 ** min(idle, 7)))
            except TimeoutError:
                pass

    def _start(self, ds: str, c: Claimed) -> None:
        h = _Held(ds, c, time.time(), 0)
        self.held[c.member] = h
        h.task = asyncio.create_task(self._run(h))

    # -- one job -------------------------------------------------------------------------
    def _hold(self, h: _Held, n: int) -> None:
        self.held_bytes += n - h.bytes
        h.bytes = n

    async def _run(self, h: _Held) -> None:
        name = keys.features_name(h.ds)
        try:
            try:
                payload = FeaturesPayload.model_validate(h.claimed.payload())
            except Exception as exc:  # noqa: BLE001 - a payload we cannot read fails that job only
                await self._finish(h, jobs.JobEnd.failed(f"unreadable features payload: {exc}"))
                return
            n = len(payload.input_ids)
            waited = False
            while not self._room_for(n):  # the claim was optimistic: wait for memory, lease kept by heartbeats
                if not waited:
                    self.memory_waits += 1
                    waited = True
                self.wake.clear()
                await self.wake.wait()
            self._hold(h, int(n * self.backend.bytes_per_token()))  # no await since the check: nobody overtakes
            self.peak_held_jobs = max(self.peak_held_jobs, sum(1 for x in self.held.values() if x.bytes))
            try:
                got = await self.backend.capture(payload, h.claimed.job_id, lambda nbytes: self._hold(h, nbytes))
            except (FatalRequestError, RetryableRequestError, HiddenStatesError) as exc:
                log.warning("features job %s failed: %s", h.claimed.job_id, exc)
                await self._finish(h, jobs.JobEnd.failed(str(exc)))
                return
            self._hold(h, got.nbytes)
            try:
                await deliver(self.aconn, self.cfg, payload, got, self.store_health)
            except OSError as exc:
                got.remove_raw_files()
                if exc.errno in STORE_TRANSIENT:  # still full / unreachable after the retries: back to its queue
                    self._store_fault(h, exc)
                    await self._requeue(h, name)
                    return
                log.warning("features job %s failed: %s", h.claimed.job_id, exc)   # EACCES, EROFS ...
                await self._finish(h, jobs.JobEnd.failed(f"writing the shard to features.store failed: {exc}"))
                return
            self.store_pause_s = 0.0
            shape, single = got.shape, got.payload is not None
            del got
            # A kill here leaves the entry in the stream and the job started: its lease lapses, it
            # runs again, and the collector keeps the first copy of the id only.
            result = {"status": "captured", "shape": shape, "from_generation": single}
            if await self._finish(h, jobs.JobEnd(jobs.Ending.FINISHED, result, stat=Stat.CAPTURED)):
                self.from_generation += single
        except asyncio.CancelledError:
            await asyncio.shield(self._requeue(h, name))
            raise
        except BrokenProcessPool:
            # A decode process died (OOM killer?): a fresh pool, and the job goes back to its queue.
            log.error("features worker %s: a decode process died; restarting the pool, requeueing %s", self.name,
                      h.claimed.job_id)
            if isinstance(self.backend, HttpBackend):
                self.backend.new_decoders()
            await self._requeue(h, name)
        except Exception:  # noqa: BLE001 - Redis down mid-job, a bug: the job's lease lapses and it comes back
            log.exception("features job %s: left to its lease (requeued by `budgetq features`)", h.claimed.job_id)
        finally:
            self._hold(h, 0)
            self.held.pop(h.claimed.member, None)
            self.wake.set()

    def _store_fault(self, h: _Held, exc: OSError) -> None:
        """features.store failed every try of a job's write: the job goes back to its queue and this worker claims
        nothing for a while (doubling while the fault lasts), so a full or lost volume costs one line a pause (the
        other jobs in flight that fail meanwhile go back silently)."""
        if time.monotonic() < self.store_paused_until:
            return
        self.store_pause_s = min(STORE_PAUSE_MAX_S, max(STORE_PAUSE_S, 2 * self.store_pause_s))
        self.store_paused_until = time.monotonic() + self.store_pause_s
        log.error("features worker %s: features.store write failed %d times (%s): job %s handed back, no claims "
                  "for %.0f s", self.name, STORE_WRITE_TRIES, exc, h.claimed.job_id, self.store_pause_s)

    async def _finish(self, h: _Held, end: jobs.JobEnd) -> bool:
        """Whether this worker's lease still held the job (its ending counts)."""
        call = jobs.finish(keys.features_name(h.ds), h.claimed, end, h.started_at, self.name)
        if await arun(self.aconn, call) is not jobs.Finished.RECORDED:
            return False
        self.processed += end.ending is jobs.Ending.FINISHED
        self.failed += end.ending is jobs.Ending.FAILED
        return True

    async def _requeue(self, h: _Held, name: str) -> None:
        try:
            await arun(self.aconn, jobs.requeue(name, h.claimed.member, h.claimed.job_id))
        except Exception as exc:  # noqa: BLE001 - the lease brings it back anyway
            log.warning("features job %s: requeue failed (%s); its lease will bring it back", h.claimed.job_id, exc)

    # -- loops ---------------------------------------------------------------------------
    async def _heartbeats(self) -> None:
        while True:
            await asyncio.sleep(max(1.0, self.ttl / 3))
            leases = [(keys.features_name(h.ds), h.claimed.member, h.claimed.job_id) for h in self.held.values()]
            try:
                await asyncio.to_thread(rq_adapter.heartbeat, self.conn, self.rq_worker, leases, self.ttl)
            except REDIS_DOWN as exc:
                log.warning("features worker %s: heartbeat skipped, redis unreachable: %s", self.name, exc)

    def _on_signal(self, signame: str) -> None:
        log.warning("features worker %s: %s: requeueing %d jobs and stopping", self.name, signame, len(self.held))
        self.stopping.set()
        self.wake.set()

    def request_stop(self, why: str) -> None:
        """Stop as on a signal (requeue what is held): for a loop beside `budgetq worker`'s, which owns signals."""
        if not self.stopping.is_set():
            self._on_signal(why)

    async def run(self, handle_signals: bool = True) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT) if handle_signals else ():
            loop.add_signal_handler(sig, self._on_signal, sig.name)
        self.aconn = aconnect(self.cfg.redis_url, max_connections=16)
        # The backend first (a model may take minutes to load): no worker is registered, nothing claimed meanwhile.
        await self.backend.start()
        self.rq_worker = await asyncio.to_thread(rq_adapter.register_worker, self.conn, self.name)
        beats = asyncio.create_task(self._heartbeats())
        log.info("features worker %s: %s backend, %d in flight, up to %.0f MB held", self.name, self.backend.name,
                 self.concurrency, self.f.worker_max_mb)
        try:
            await self._feed()
            tasks = [h.task for h in self.held.values() if h.task is not None]
            if self.stopping.is_set():
                for t in tasks:
                    t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        finally:
            beats.cancel()
            await self.backend.close()
            try:
                await asyncio.to_thread(self.rq_worker.register_death)
            except Exception:  # noqa: BLE001 - the worker key expires anyway
                pass
            await self.aconn.aclose()
        log.info("features worker %s: exited after %d captured (%d from their generation request), %d failed (%d "
                 "waited for worker_max_mb, at most %d holding responses at once)", self.name, self.processed,
                 self.from_generation, self.failed, self.memory_waits,
                 self.peak_held_jobs)
        return 0


async def deliver(conn: Any, cfg: Config, payload: FeaturesPayload, got: Captured,
                  health: StoreHealth | None = None) -> None:
    """The sample to the collector. Without features.store: its bytes through the results stream. With it: its
    shard written in the store (tmp, fsync, rename), the engine's raw files removed, then an index message (a
    kill between the rename and the message leaves a shard the collector indexes, or removes as a second copy).
    A write failing with a STORE_TRANSIENT error is tried again (each try a fresh name, the failed one's .tmp
    removed), STORE_WRITE_TRIES times in all; then the OSError is raised (the worker hands the job back)."""
    stored = got.payload or payload
    meta = FeaturesMeta(**stored.model_dump(exclude={"engine_file"}), shape=got.shape, endpoint=got.endpoint,
                        aux_shape=got.aux_shape, from_generation=got.payload is not None)
    if cfg.features.store is None:
        await xadd_result(conn, meta, got)
        return
    d = features_dir(features_root(cfg), payload.dataset)
    health = health or StoreHealth()
    for attempt in range(1, STORE_WRITE_TRIES + 1):
        try:
            meta.shard, meta.shard_bytes = await asyncio.to_thread(write_sample_shard, d, meta, got.data, got.aux)
            break
        except OSError as exc:  # the failed write removed its .tmp (write_atomic)
            if exc.errno not in STORE_TRANSIENT:
                raise
            health.failed(payload, exc)
            if attempt == STORE_WRITE_TRIES:
                raise
            await asyncio.sleep(STORE_RETRY_S * 2 ** (attempt - 1))
    health.ok()
    got.remove_raw_files()
    fault_points.reached(fault_points.BEFORE_INDEX_MESSAGE)   # tests: the shard renamed, no index message
    await conn.xadd(keys.features_results_key(payload.dataset), {"id": payload.id, "meta": meta.model_dump_json()})


async def xadd_result(conn: Any, meta: FeaturesMeta, got: Captured) -> None:
    """The sample's bytes to its dataset's results stream, and its size to the pending counter, in one MULTI."""
    fields: dict = {"id": meta.id, "meta": meta.model_dump_json(), "data": got.data}
    if got.aux is not None:
        fields["aux"] = got.aux
    async with conn.pipeline(transaction=True) as p:
        p.xadd(keys.features_results_key(meta.dataset), fields)
        p.incrby(keys.features_pending_key(meta.dataset), got.nbytes)
        await p.execute()


def run_features_job(payload: dict) -> dict:
    """The RQ job function of a features job, for a plain ``rq worker`` (debugging, fallback): one capture
    through the configured backend (http: decoded in this process; transformers: the model is loaded for
    this job), the bytes XADDed to the collector's stream, as ``budgetq features-worker`` does with many at
    once. Set BUDGETQ_CONFIG (or BUDGETQ_* env vars)."""
    cfg = load_config(os.environ.get("BUDGETQ_CONFIG"))
    p = FeaturesPayload.model_validate(payload)
    job = get_current_job()
    job_id = job.id if job is not None else job_id_of(keys.features_name(p.dataset), p.id)

    async def main() -> dict:
        backend = make_backend(cfg, decode_processes=0)
        await backend.start()
        try:
            got = await backend.capture(p, job_id, lambda _n: None)
        finally:
            await backend.close()
        conn = aconnect(cfg.redis_url, max_connections=2)
        try:
            await deliver(conn, cfg, p, got)
        finally:
            await conn.aclose()
        return {"status": "captured", "shape": got.shape, "from_generation": got.payload is not None}

    return asyncio.run(main())
