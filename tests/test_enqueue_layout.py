"""shared.jobs.LeanQueue.enqueue_many writes what RQ's Queue.enqueue_many writes, in fewer commands."""

from __future__ import annotations

from rq import Queue
from rq.job import Job, JobStatus
from rq.serializers import JSONSerializer

from budgetq.shared.jobs import LeanQueue

_STAMPS = {b"created_at", b"enqueued_at"}  # times: differ between any two enqueues


def _items(prefix: str, **extra) -> list:
    return [Queue.prepare_data("budgetq.worker.job.run", args=({"id": i},), job_id=f"{prefix}{i}", timeout=-1,
                               result_ttl=500, failure_ttl=99, description=f"d{i}", **extra) for i in range(3)]


def _enqueue(q: Queue, items: list, conn) -> list[Job]:
    with conn.pipeline() as pipe:
        out = q.enqueue_many(items, pipeline=pipe)
        pipe.execute()
    return out


def test_same_hash_queue_and_ttl_as_rq(conn):
    rq_q = Queue("rq-side", connection=conn, serializer=JSONSerializer)
    our_q = LeanQueue("our-side", connection=conn, serializer=JSONSerializer)
    _enqueue(rq_q, _items("A"), conn)
    assert [j.id for j in _enqueue(our_q, _items("B"), conn)] == ["B0", "B1", "B2"]
    for i in range(3):
        a, b = conn.hgetall(f"rq:job:A{i}"), conn.hgetall(f"rq:job:B{i}")
        # RQ's fields, less the ones RQ writes as '' on a new job (it reads absent as '')
        assert {k for k, v in a.items() if v != b""} == b.keys() and _STAMPS <= b.keys() and len(b) < len(a)
        assert {k: v for k, v in a.items() if k not in _STAMPS | {b"origin"} and v != b""} == \
               {k: v for k, v in b.items() if k not in _STAMPS | {b"origin"}}
        # ... and RQ reads both as the same job
        ja = Job.fetch(f"A{i}", connection=conn, serializer=JSONSerializer).to_dict()
        jb = Job.fetch(f"B{i}", connection=conn, serializer=JSONSerializer).to_dict()
        assert {k: v for k, v in ja.items() if k not in {"created_at", "enqueued_at", "origin"}} == \
               {k: v for k, v in jb.items() if k not in {"created_at", "enqueued_at", "origin"}}
        assert b[b"origin"] == b"our-side" and conn.ttl(f"rq:job:B{i}") == conn.ttl(f"rq:job:A{i}") == -1
        job = Job.fetch(f"B{i}", connection=conn, serializer=JSONSerializer)  # what rq-dashboard reads
        assert job.get_status() == JobStatus.QUEUED and job.args == [{"id": i}] and job.origin == "our-side"
    assert our_q.job_ids == ["B0", "B1", "B2"] and rq_q.job_ids == ["A0", "A1", "A2"]
    assert {q.name for q in Queue.all(connection=conn)} >= {"rq-side", "our-side"}


def test_expiring_jobs_expire_like_rq(conn):
    _enqueue(LeanQueue("ttl-side", connection=conn, serializer=JSONSerializer), _items("T", ttl=300), conn)
    assert 0 < conn.ttl("rq:job:T0") <= 300


def test_what_it_does_not_shorten_goes_through_rq(conn):
    q = LeanQueue("front", connection=conn, serializer=JSONSerializer)
    _enqueue(q, _items("F"), conn)
    _enqueue(q, _items("G", at_front=True), conn)  # RQ's path: each pushed at the front
    assert q.job_ids == ["G2", "G1", "G0", "F0", "F1", "F2"]
    assert len(q.enqueue_many(_items("H"))) == 3 and q.job_ids[-1] == "H2"  # no pipeline: RQ's, executed
