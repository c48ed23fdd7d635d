"""The RQ bookkeeping our concurrent worker needs, batched, so registries stay truthful.

Jobs are claimed by shared/lua/claim.lua (queue -> started registry, atomically). Here,
finished / failed / skipped jobs are recorded through RQ's own Job and registry code, many
jobs per pipeline round trip, so rq-dashboard shows them like any RQ worker's jobs.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

import redis
from rq import Queue, Worker
from rq.executions import Execution
from rq.job import Job, JobStatus
from rq.registry import CanceledJobRegistry
from rq.serializers import JSONSerializer
from rq.utils import now, utcformat

from shared import keys
from shared.jobs import Claimed

RESULT_TTL_S = 500
# Skipped (canceled) jobs stay as long as failed ones: a budget raised later requeues them.
KEEP_S = 7 * 86400


class End(enum.Enum):
    FINISHED = "finished"
    FAILED = "failed"
    SKIPPED = "skipped"   # RQ's canceled registry: skipped by budget, or admission withdrawn


@dataclass
class Ending:
    kind: End
    job: Job
    ds: str
    execution_id: str
    started_at: Any
    result: dict | None = None
    reason: str = ""


def restore(conn: redis.Redis, c: Claimed) -> Job:
    job = Job(c.job_id, connection=conn, serializer=JSONSerializer)
    job.restore(c.raw)
    return job


def register_worker(conn: redis.Redis, name: str) -> Worker:
    """Make this process visible in rq-dashboard's worker list."""
    w = Worker([Queue("bq-idle", connection=conn)], connection=conn, name=name, serializer=JSONSerializer)
    w.register_birth()
    return w


def record(conn: redis.Redis, endings: list[Ending], worker_name: str) -> int:
    """Write many job endings in two round trips; returns how many were written.

    An ending is dropped when this worker no longer holds the job (its lease ran out and
    the maintenance pass requeued it): the job's new holder records how it ends.
    """
    if not endings:
        return 0
    with conn.pipeline(transaction=False) as pipe:
        for e in endings:
            pipe.zscore(keys.rq_wip_key(e.ds), f"{e.job.id}:{e.execution_id}")
        held = pipe.execute()
    mine = [e for e, score in zip(endings, held, strict=True) if score is not None]
    with conn.pipeline(transaction=False) as pipe:
        for e in mine:
            _record_one(pipe, e, worker_name)
        pipe.execute()
    return len(mine)


def _record_one(pipe: redis.client.Pipeline, e: Ending, worker_name: str) -> None:
    job = e.job
    execution = Execution(id=e.execution_id, job_id=job.id, connection=job.connection, worker_name=worker_name)
    execution.created_at = e.started_at
    job.ended_at = now()
    execution.delete(job, pipeline=pipe)
    timing = {"worker_name": worker_name, "execution_id": e.execution_id,
              "execution_started_at": e.started_at, "execution_ended_at": job.ended_at}
    if e.kind is End.FINISHED:
        job._result = e.result
        job._handle_success(RESULT_TTL_S, pipeline=pipe, **timing)
    elif e.kind is End.FAILED:
        job.set_status(JobStatus.FAILED, pipeline=pipe)
        job._handle_failure(e.reason, pipeline=pipe, **timing)
    else:
        job.meta["skipped"] = e.reason
        job.set_status(JobStatus.CANCELED, pipeline=pipe)
        job.save(pipeline=pipe, include_meta=True, include_result=False)
        CanceledJobRegistry(job.origin, connection=job.connection, serializer=JSONSerializer).add(
            job, ttl=KEEP_S, pipeline=pipe)
        pipe.expire(job.key, KEEP_S)


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
