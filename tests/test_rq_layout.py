"""Our Lua scripts write RQ's own layout: RQ's API (what rq-dashboard uses) reads every step back."""

from __future__ import annotations

import time

from rq import Queue
from rq.job import Job, JobStatus
from rq.registry import CanceledJobRegistry, FailedJobRegistry, FinishedJobRegistry, StartedJobRegistry
from rq.serializers import JSONSerializer

from budgetq.shared import jobs, keys
from budgetq.shared.jobs import JobEnd, ResultStatus, Skip
from budgetq.shared.scripts import run
from budgetq.shared.stats import Stat


def _setup(conn, n=3):
    q = Queue(keys.queue_name("D"), connection=conn, serializer=JSONSerializer)
    for i in range(n):
        q.enqueue("budgetq.worker.job.run_prompt", {"id": f"p{i}", "n": i}, job_id=f"D-p{i}")
    return q


def _fetch(conn, job_id: str) -> Job:
    return Job.fetch(job_id, connection=conn, serializer=JSONSerializer)


def test_claim_moves_jobs_to_started_and_returns_their_payloads(conn):
    q = _setup(conn)
    claimed = run(conn, jobs.claim("D", 2, time.time() + 30, "w1"))
    assert [c.job_id for c in claimed] == ["D-p0", "D-p1"]
    assert claimed[1].payload() == {"id": "p1", "n": 1}
    started = StartedJobRegistry(q.name, connection=conn, serializer=JSONSerializer)
    assert sorted(started.get_job_ids(cleanup=False)) == ["D-p0", "D-p1"]
    job = _fetch(conn, "D-p0")
    assert job.get_status() == JobStatus.STARTED and job.worker_name == "w1" and job.started_at is not None
    assert q.count == 1


def test_finish_records_finished_failed_and_skipped_jobs_as_rq_does(conn):
    q = _setup(conn)
    c0, c1, c2 = run(conn, jobs.claim("D", 3, time.time() + 30, "w1"))
    conn.sadd(keys.done_key("D"), c0.job_id)  # its commit (finish.lua checks that a committed job has one)
    t0 = time.time()
    assert run(conn, jobs.finish("D", c0, JobEnd.done(ResultStatus.COMMITTED), t0, "w1"))
    assert run(conn, jobs.finish("D", c1, JobEnd.failed("HTTP 400: too long"), t0, "w1"))
    assert run(conn, jobs.finish("D", c2, JobEnd.skip(Skip.EXHAUSTED), t0, "w1"))
    name = q.name
    assert StartedJobRegistry(name, connection=conn).get_job_count(cleanup=False) == 0
    assert FinishedJobRegistry(name, connection=conn).get_job_ids(cleanup=False) == ["D-p0"]
    assert FailedJobRegistry(name, connection=conn).get_job_ids(cleanup=False) == ["D-p1"]
    assert CanceledJobRegistry(name, connection=conn).get_job_ids(cleanup=False) == ["D-p2"]
    j0, j1, j2 = (_fetch(conn, f"D-p{i}") for i in range(3))
    assert j0.get_status() == JobStatus.FINISHED and j0.ended_at is not None
    assert j0.latest_result().return_value == {"status": "committed"}
    assert j0.latest_result().worker_name == "w1"
    assert j1.get_status() == JobStatus.FAILED and j1.latest_result().exc_string == "HTTP 400: too long"
    assert j2.get_status() == JobStatus.CANCELED and j2.get_meta()["skipped"] == "budget exhausted"
    assert conn.ttl(keys.rq_job_key("D-p0")) <= jobs.RESULT_TTL_S
    stats = {k.decode(): int(v) for k, v in conn.hgetall(keys.stats_key("D")).items()}
    assert stats == {"failed": 1, "skipped": 1}
    # RQ's own requeue works on what we recorded (retry-failed, a raised budget)
    jobs.registry(FailedJobRegistry, "D", conn).requeue("D-p1")
    jobs.registry(CanceledJobRegistry, "D", conn).requeue("D-p2")
    assert q.get_job_ids() == ["D-p1", "D-p2"]
    assert _fetch(conn, "D-p1").get_status() == JobStatus.QUEUED


def test_only_the_holder_records_an_ending_and_requeue_puts_a_job_back_in_front(conn):
    q = _setup(conn)
    (c0,) = run(conn, jobs.claim("D", 1, time.time() + 30, "w1"))
    assert run(conn, jobs.requeue("D", c0.member, c0.job_id, Stat.RECOVERED))
    assert q.get_job_ids()[0] == "D-p0" and _fetch(conn, "D-p0").get_status() == JobStatus.QUEUED
    # the old holder's lease is gone: its late ending writes nothing
    assert not run(conn, jobs.finish("D", c0, JobEnd.done(ResultStatus.COMMITTED), time.time(), "w1"))
    assert FinishedJobRegistry(q.name, connection=conn).get_job_count(cleanup=False) == 0
    assert not run(conn, jobs.requeue("D", c0.member, c0.job_id))  # nothing to requeue twice
    assert q.count == 3
