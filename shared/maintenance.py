"""The maintenance pass: requeue jobs of dead workers, release leaked reservations.

Any worker (and the producer) runs it every ``worker.maintenance_interval_s`` under a Redis
lock, so exactly one process does it at a time and a run never depends on an operator.
A job whose lease (started-registry score, extended by its worker's heartbeats) has ended
is put back at the front of its queue and its reservation released (requeue.lua), so a
worker killed with SIGKILL at any instant loses nothing: a result it had already committed
is recognised by the done set when the job runs again, and is never counted twice.
"""

from __future__ import annotations

import logging
import os
import socket
import time
import uuid
import zlib
from dataclasses import dataclass, field
from typing import cast

import redis
from rq.registry import FailedJobRegistry

from budgetq.shared import budget, jobs, keys
from budgetq.shared.redis_conn import dataset_names
from budgetq.shared.scripts import run_many
from budgetq.shared.stats import Stat

log = logging.getLogger("budgetq.maintenance")


def job_id_of(member: str | bytes) -> str:
    text = member.decode() if isinstance(member, bytes) else member
    return text.rsplit(":", 1)[0]


@dataclass
class Report:
    recovered: int = 0
    abandoned_requeued: int = 0
    leaks_released: int = 0
    workers_pruned: int = 0


@dataclass
class Maintenance:
    """One per process: remembers what the previous pass saw (leak candidates, failed cursor)."""

    conn: redis.Redis
    interval_s: float
    owner: str = field(default_factory=lambda: f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}")
    _leak_candidates: dict[str, set[str]] = field(default_factory=dict)
    _failed_seen: dict[str, float] = field(default_factory=dict)

    def run_once(self) -> Report | None:
        """One pass, if no other process holds the lock; returns what it did (None: not our turn)."""
        if not self.conn.set(keys.MAINTENANCE_LOCK, self.owner, nx=True, px=int(self.interval_s * 3000)):
            return None
        report = Report()
        try:
            for ds in dataset_names(self.conn):
                self._recover_expired(ds, report)
                self._requeue_abandoned(ds, report)
                self._release_leaks(ds, report)
            self._prune_workers(report)
        finally:
            if self.conn.get(keys.MAINTENANCE_LOCK) == self.owner.encode():
                self.conn.delete(keys.MAINTENANCE_LOCK)
        if report.recovered or report.abandoned_requeued or report.leaks_released:
            log.warning("maintenance: requeued %d jobs of dead workers, %d abandoned jobs from failed, "
                        "released %d leaked reservations", report.recovered, report.abandoned_requeued,
                        report.leaks_released)
        return report

    def _recover_expired(self, ds: str, report: Report) -> None:
        now = time.time()
        members = cast(list[bytes], self.conn.zrangebyscore(keys.rq_wip_key(ds), "-inf", now))
        calls = [jobs.requeue(ds, m.decode(), job_id_of(m), Stat.RECOVERED, only_if_expired_before=now)
                 for m in members]
        report.recovered += sum(1 for r in run_many(self.conn, calls) if r is True)

    def _requeue_abandoned(self, ds: str, report: Report) -> None:
        """A stock RQ worker's cleanup may move our expired jobs to failed as AbandonedJobError."""
        registry = jobs.registry(FailedJobRegistry, ds, self.conn)
        since = self._failed_seen.get(ds, float("-inf"))
        entries = cast(list[tuple[bytes, float]],
                       self.conn.zrangebyscore(registry.key, f"({since}" if since != float("-inf") else "-inf",
                                               "+inf", withscores=True))
        for member, score in entries:
            self._failed_seen[ds] = max(self._failed_seen.get(ds, float("-inf")), score)
            job_id = member.decode()
            exc = cast(bytes | None, self.conn.hget(keys.rq_job_key(job_id), "exc_info")) or b""
            try:
                exc = zlib.decompress(exc)
            except Exception:  # noqa: BLE001 - stored uncompressed by some RQ versions
                pass
            if b"AbandonedJobError" in exc:
                run_many(self.conn, [budget.release(ds, job_id)])
                registry.requeue(job_id, at_front=True)
                self.conn.hincrby(keys.stats_key(ds), Stat.RECOVERED, 1)
                report.abandoned_requeued += 1

    def _release_leaks(self, ds: str, report: Report) -> None:
        """A reservation whose job is in no started registry, two passes in a row, is leaked."""
        held = {k.decode() for k in cast(list[bytes], self.conn.hkeys(keys.resv_key(ds)))}
        if not held:
            self._leak_candidates.pop(ds, None)
            return
        live = {job_id_of(m) for m in cast(list[bytes], self.conn.zrange(keys.rq_wip_key(ds), 0, -1))}
        leaked = held - live
        confirmed = leaked & self._leak_candidates.get(ds, set())
        self._leak_candidates[ds] = leaked - confirmed
        if confirmed:
            released = run_many(self.conn, [budget.release(ds, j) for j in sorted(confirmed)])
            report.leaks_released += sum(1 for r in released
                                         if isinstance(r, budget.Release) and r.status is budget.Released.RELEASED)

    def _prune_workers(self, report: Report) -> None:
        for name in cast(set[bytes], self.conn.smembers(keys.WORKERS)):
            if not self.conn.exists(keys.worker_key(name.decode())):
                self.conn.srem(keys.WORKERS, name)
                report.workers_pruned += 1
