"""The few RQ bookkeeping steps our concurrent worker needs, so registries stay truthful.

RQ's Worker runs one job at a time; instead of subclassing its large classes we reuse its
Job/Execution/registry primitives to record started, finished and failed jobs.
"""

from __future__ import annotations

import redis
from rq import Queue, Worker
from rq.executions import Execution
from rq.job import Job, JobStatus
from rq.serializers import JSONSerializer
from rq.utils import now

RESULT_TTL_S = 500


def queues_for(conn: redis.Redis, names: list[str]) -> list[Queue]:
    return [Queue(n, connection=conn, serializer=JSONSerializer) for n in names]


def register_worker(conn: redis.Redis, name: str, queues: list[Queue]) -> Worker:
    """Make this process visible in rq-dashboard's worker list."""
    w = Worker(queues or [Queue("bq-idle", connection=conn)], connection=conn, name=name,
               serializer=JSONSerializer)
    w.register_birth()
    return w


def fetch(conn: redis.Redis, job_id: str) -> Job | None:
    try:
        return Job.fetch(job_id, connection=conn, serializer=JSONSerializer)
    except Exception:  # noqa: BLE001 - a missing or unreadable job is skipped, not fatal
        return None


def mark_started(conn: redis.Redis, job: Job, worker_name: str, ttl_s: int) -> Execution:
    with conn.pipeline() as pipe:
        execution = Execution.create(job, ttl_s, pipeline=pipe, worker_name=worker_name)
        job.heartbeat(now(), ttl_s, pipeline=pipe)
        job.prepare_for_execution(worker_name, pipeline=pipe)
        pipe.persist(job.key)
        pipe.execute()
    return execution


def mark_finished(conn: redis.Redis, job: Job, execution: Execution, result: dict, worker_name: str) -> None:
    job._result = result
    job.ended_at = now()
    with conn.pipeline() as pipe:
        execution.delete(job, pipeline=pipe)
        job._handle_success(RESULT_TTL_S, pipeline=pipe, worker_name=worker_name,
                            execution_id=execution.id, execution_started_at=execution.created_at,
                            execution_ended_at=job.ended_at)
        pipe.execute()


def mark_failed(conn: redis.Redis, job: Job, execution: Execution, exc_string: str, worker_name: str) -> None:
    job.ended_at = now()
    with conn.pipeline() as pipe:
        job.set_status(JobStatus.FAILED, pipeline=pipe)
        execution.delete(job, pipeline=pipe)
        job._handle_failure(exc_string, pipeline=pipe, worker_name=worker_name,
                            execution_id=execution.id, execution_started_at=execution.created_at,
                            execution_ended_at=job.ended_at)
        pipe.execute()


def requeue(conn: redis.Redis, job: Job, execution: Execution) -> None:
    """Put a job back at the front of its queue (graceful shutdown), not into failed."""
    with conn.pipeline() as pipe:
        execution.delete(job, pipeline=pipe)
        job.set_status(JobStatus.QUEUED, pipeline=pipe)
        pipe.lpush(Queue(job.origin, connection=conn).key, job.id)
        pipe.execute()


def heartbeat(conn: redis.Redis, worker: Worker, in_flight: list[tuple[Job, Execution]], ttl_s: int) -> None:
    """Extend the leases of every job in flight and of the worker itself, in one round trip.

    Without this a request longer than the lease (long generations often are) would look
    abandoned to RQ's maintenance and be failed while it is still running.
    """
    with conn.pipeline() as pipe:
        for job, execution in in_flight:
            execution.heartbeat(job.started_job_registry, ttl_s, pipe)
            job.heartbeat(now(), ttl_s, pipeline=pipe, xx=True)
        worker.heartbeat(ttl_s + 60, pipeline=pipe)
        pipe.execute()
