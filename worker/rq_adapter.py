"""The RQ bookkeeping that is not per job: this worker in RQ's worker list, and lease heartbeats.

How each job starts and ends is written by Lua scripts in RQ's own layout (shared/jobs.py).
"""

from __future__ import annotations

import redis
from rq import Queue, Worker
from rq.serializers import JSONSerializer
from rq.utils import now, utcformat

from budgetq.shared import keys


class _Worker(Worker):
    """RQ's Worker for registration and heartbeats only. Stock RQ raises the socket timeout of
    the connection it is given to ~415 s, for its BLPOP dequeue; we never dequeue through RQ,
    and with that timeout a hung Redis would block every heartbeat, maintenance pass and the
    deregistration at exit for 7 minutes. So the connection keeps shared.redis_conn's timeouts
    (rq is pinned to 3.0.x, whose Worker.__init__ calls this hook)."""

    def _set_connection(self, connection: redis.Redis) -> redis.Redis:
        return connection


def register_worker(conn: redis.Redis, name: str) -> Worker:
    """Make this process visible in rq-dashboard's worker list."""
    w = _Worker([Queue("bq-idle", connection=conn)], connection=conn, name=name, serializer=JSONSerializer)
    w.register_birth()
    return w


def heartbeat(conn: redis.Redis, worker: Worker, leases: list[tuple[str, str, str]], ttl_s: int) -> None:
    """Extend the leases of every job this worker holds (dataset, registry member, job id), one round trip.

    Without this a request longer than the lease (long generations often are) would look
    abandoned to the maintenance pass and be requeued while it is still running.
    """
    end = now().timestamp() + ttl_s
    stamp = utcformat(now())
    with conn.pipeline(transaction=False) as pipe:
        for ds, member, job_id in leases:
            pipe.zadd(keys.rq_wip_key(ds), {member: end}, xx=True)
            pipe.hset(keys.rq_job_key(job_id), "last_heartbeat", stamp)
        worker.heartbeat(ttl_s + 60, pipeline=pipe)
        pipe.execute()
