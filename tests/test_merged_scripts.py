"""Item scripts (reserve, commit, finish): calls of one dataset merged into one EVALSHA do exactly
what the same calls do one by one (shared/scripts.py), and a finished job whose result_ttl is 0
is deleted, as RQ's own worker deletes it (producer.result_ttl_s: 0)."""

from __future__ import annotations

import json
import random
import time

import pytest
from rq import Queue, SimpleWorker
from rq.job import Job, JobStatus
from rq.registry import CanceledJobRegistry, FailedJobRegistry, FinishedJobRegistry, StartedJobRegistry
from rq.serializers import JSONSerializer

from budgetq.shared import budget, jobs, keys
from budgetq.shared.budget import Admission, Outcome, register_dataset
from budgetq.shared.config import DatasetConfig
from budgetq.shared.jobs import JobEnd, ResultStatus, Skip
from budgetq.shared.scripts import run, run_many


def _register(conn, name: str, **kw) -> None:
    register_dataset(conn, DatasetConfig(name=name, path="x.jsonl", **kw))


def _state(conn, ds: str) -> dict:
    """Everything reserve and commit write for a dataset, comparable across two datasets."""
    rate = {k: int(v) for k, v in conn.hgetall(keys.budget_keys(ds)[8]).items()}
    return {
        "used": int(conn.get(keys.used_key(ds)) or 0),
        "reserved": int(conn.get(keys.reserved_key(ds)) or 0),
        "resv": conn.hgetall(keys.resv_key(ds)),
        "done": conn.smembers(keys.done_key(ds)),
        "stats": conn.hgetall(keys.stats_key(ds)),
        "hist": conn.hgetall(keys.budget_keys(ds)[7]),
        "rate_total": sum(rate.values()),
        "results": [fields for _id, fields in conn.xrange(keys.results_key(ds))],
    }


SETTINGS = [
    {"mode": "soft", "count": "completion", "keep": "all"},
    {"mode": "soft", "count": "total", "keep": "complete"},
    {"mode": "strict", "count": "completion", "keep": "all"},
    {"mode": "strict", "count": "total", "keep": "all"},
    {"mode": "drain", "count": "completion", "keep": "complete"},
]


@pytest.mark.parametrize("seed", range(10))
def test_merged_reserve_and_commit_write_what_one_call_at_a_time_writes(conn, seed):
    rnd = random.Random(seed)
    settings = SETTINGS[seed % len(SETTINGS)]
    conf = dict(budget=rnd.randint(200, 1500), prior_mean_tokens=rnd.randint(5, 60), sampling={"max_tokens": 80},
                end_margin_z=rnd.choice([0.0, 1.0]), **settings)
    _register(conn, "A", **conf)   # one call at a time
    _register(conn, "B", **conf)   # merged
    next_id = 0
    replies: dict[str, list] = {"A": [], "B": []}
    for _round in range(12):
        ids = [f"j{next_id + i}" for i in range(rnd.randint(1, 12))]
        next_id += len(ids)
        old = [f"j{rnd.randrange(next_id)}" for _ in range(rnd.randint(0, 3))]  # retries, done prompts
        asks = [(j, rnd.randint(0, 40), rnd.choice([1, 1, 1, 3])) for j in ids + old]

        def reserves(ds, asks=asks):
            return [budget.reserve(ds, j, 80, pt, requests=r) for j, pt, r in asks]

        replies["A"] += [run(conn, c) for c in reserves("A")]
        replies["B"] += run_many(conn, reserves("B"), merge=True)
        # results: admitted ones, some twice (a retry after a lost reply), some never admitted
        results = []
        for j, pt, r in asks:
            if rnd.random() < 0.8:
                lengths = [rnd.randint(0, 80) for _ in range(r)]
                results.append((j, pt, sum(lengths), rnd.choice(["stop", "stop", "length"]), lengths))
        results += rnd.sample(results, min(len(results), rnd.randint(0, 2)))

        def commits(ds, results=results):
            return [budget.commit(ds, j, pt, gen, fr, json.dumps({"id": j, "n": gen}), lengths=ls)
                    for j, pt, gen, fr, ls in results]

        replies["A"] += [run(conn, c) for c in commits("A")]
        replies["B"] += run_many(conn, commits("B"), merge=True)
    assert replies["A"] == replies["B"]
    assert _state(conn, "A") == _state(conn, "B")
    outcomes = {r for r in replies["A"] if isinstance(r, Outcome)}
    assert Outcome.COMMITTED in outcomes


def test_a_merged_commit_that_crosses_the_budget_rejects_the_rest_of_its_items(conn):
    _register(conn, "D", budget=100, prior_mean_tokens=10, sampling={"max_tokens": 80})
    got = run_many(conn, [budget.reserve("D", f"j{i}", 80) for i in range(6)], merge=True)
    assert [r.status for r in got] == [Admission.ADMIT] * 6
    outs = run_many(conn, [budget.commit("D", f"j{i}", 0, 40, "stop", "{}") for i in range(6)], merge=True)
    assert outs == [Outcome.COMMITTED, Outcome.COMMITTED, Outcome.CROSSED] + [Outcome.REJECTED] * 3
    st = budget.dataset_state(conn, "D")
    assert (st.used, st.reserved, st.in_flight) == (120, 0, 0)
    assert st.stats["withdrawn"] == 3 and st.stats["rejected"] == 3 and st.stats["wasted_tokens"] == 120


def test_an_unregistered_dataset_fails_every_item_of_a_merged_call(conn):
    got = run_many(conn, [budget.reserve("nope", f"j{i}", 80) for i in range(3)], merge=True)
    assert all(isinstance(r, Exception) and "not registered" in str(r) for r in got)
    assert not conn.exists(keys.resv_key("nope"))


def test_run_many_merges_only_when_asked_and_keeps_each_reply_in_place(conn):
    for ds in ("A", "B", "C"):
        _register(conn, ds, budget=10**6, prior_mean_tokens=10, sampling={"max_tokens": 80}, mode="strict")
    run(conn, budget.withdraw("A"))  # loaded: a script Redis lacks is sent again after the rest

    def calls(other):
        return [budget.reserve(other, "b1", 80), budget.reserve("A", "a1", 70), budget.withdraw(other),
                budget.reserve(other, "b2", 80)]

    # Not merged: in order, so the withdraw takes b1 only.
    assert [getattr(r, "tokens", r) for r in run_many(conn, calls("B"))] == [80, 70, 1, 80]
    # Merged: b2 went with b1, at b1's place, before the withdraw (merge is for independent calls).
    assert [getattr(r, "tokens", r) for r in run_many(conn, calls("C"), merge=True)] == [80, 70, 2, 80]
    assert budget.dataset_state(conn, "B").reserved == 80 and budget.dataset_state(conn, "C").reserved == 0


def _enqueue(conn, n: int, result_ttl: int) -> Queue:
    q = Queue(keys.queue_name("D"), connection=conn, serializer=JSONSerializer)
    for i in range(n):
        q.enqueue("budgetq.worker.job.run_prompt", {"id": f"p{i}"}, job_id=f"D-p{i}", result_ttl=result_ttl,
                  failure_ttl=jobs.KEEP_S)
    return q


def test_merged_finish_records_each_job_in_its_registry(conn):
    q = _enqueue(conn, 5, 500)
    c = run(conn, jobs.claim("D", 5, time.time() + 30, "w1"))
    assert [x.result_ttl for x in c] == [500] * 5
    conn.zrem(keys.rq_wip_key("D"), c[3].member)  # its lease ran out: no longer ours
    conn.sadd(keys.done_key("D"), c[0].job_id, c[3].job_id)  # their commits (finish.lua checks)
    # c[4] ends as committed, but this Redis has no commit (a failover lost it): back on the queue
    ends = [JobEnd.done(ResultStatus.COMMITTED, 7), JobEnd.failed("HTTP 400"), JobEnd.skip(Skip.EXHAUSTED),
            JobEnd.done(ResultStatus.COMMITTED, 7), JobEnd.done(ResultStatus.COMMITTED, 7)]
    got = run_many(conn, [jobs.finish("D", x, e, time.time(), "w1") for x, e in zip(c, ends, strict=True)],
                   merge=True)
    assert got == [jobs.Finished.RECORDED] * 3 + [jobs.Finished.NOT_OURS, jobs.Finished.LOST_COMMIT]
    assert conn.lrange(keys.rq_queue_key("D"), 0, -1) == [b"D-p4"]
    assert Job.fetch("D-p4", connection=conn, serializer=JSONSerializer).get_status() == JobStatus.QUEUED
    reg = {k: jobs.registry(k, "D", conn).get_job_ids(cleanup=False)
           for k in (FinishedJobRegistry, FailedJobRegistry, CanceledJobRegistry, StartedJobRegistry)}
    assert reg == {FinishedJobRegistry: ["D-p0"], FailedJobRegistry: ["D-p1"], CanceledJobRegistry: ["D-p2"],
                   StartedJobRegistry: []}
    assert Job.fetch("D-p0", connection=conn, serializer=JSONSerializer).latest_result().return_value == \
        {"status": "committed", "completion_tokens": 7}
    assert Job.fetch("D-p1", connection=conn, serializer=JSONSerializer).get_status() == JobStatus.FAILED
    st = conn.hgetall(keys.stats_key("D"))
    assert st == {b"failed": b"1", b"skipped": b"1", b"lost_commit": b"1"}
    assert q.count == 1


class _ReferenceWorker(SimpleWorker):
    """RQ's SimpleWorker without its command channel (pubsub), which what it does to a finished job
    does not involve: closing that channel can keep a burst worker up to a minute after its last
    job (its thread waits 60 s in a read that the unsubscribe does not always wake: rq/rq#2172)."""

    def subscribe(self) -> None:
        pass

    def unsubscribe(self) -> None:
        pass


def test_a_finished_job_with_result_ttl_0_is_deleted_as_rqs_worker_deletes_it(conn):
    # RQ's own worker on a job enqueued with result_ttl=0: what it leaves is the reference.
    ref = Queue("ref", connection=conn, serializer=JSONSerializer)
    ref_job = ref.enqueue("builtins.len", "abc", result_ttl=0)
    _ReferenceWorker([ref], connection=conn, serializer=JSONSerializer).work(burst=True)
    assert not Job.exists(ref_job.id, connection=conn)
    assert FinishedJobRegistry("ref", connection=conn).get_job_ids(cleanup=False) == []
    assert not conn.exists(keys.rq_results_key(ref_job.id))

    _enqueue(conn, 3, 0)
    c = run(conn, jobs.claim("D", 3, time.time() + 30, "w1"))
    assert [x.result_ttl for x in c] == [0] * 3
    conn.sadd(keys.done_key("D"), c[0].job_id, c[2].job_id)  # committed (finish.lua checks)
    ends = [JobEnd.done(ResultStatus.COMMITTED, 7), JobEnd.failed("HTTP 400"), JobEnd.done(ResultStatus.ALREADY_DONE)]
    assert run_many(conn, [jobs.finish("D", x, e, time.time(), "w1") for x, e in zip(c, ends, strict=True)],
                    merge=True) == [True] * 3
    for x in (c[0], c[2]):  # finished: gone, like RQ's
        assert not Job.exists(x.job_id, connection=conn) and not conn.exists(keys.rq_results_key(x.job_id))
    assert jobs.registry(FinishedJobRegistry, "D", conn).get_job_ids(cleanup=False) == []
    assert jobs.registry(StartedJobRegistry, "D", conn).get_job_ids(cleanup=False) == []
    # a failed job keeps its failure_ttl: retry-failed needs it
    assert jobs.registry(FailedJobRegistry, "D", conn).get_job_ids(cleanup=False) == ["D-p1"]
    assert 0 < conn.ttl(keys.rq_job_key("D-p1")) <= jobs.KEEP_S
    assert conn.hgetall(keys.stats_key("D")) == {b"failed": b"1", b"already_done": b"1"}


def test_the_same_call_twice_in_a_merge_gets_a_reply_each(conn):
    _register(conn, "D", budget=10**6, prior_mean_tokens=10, sampling={"max_tokens": 80})
    call = budget.reserve("D", "j1", 80)
    first, again = run_many(conn, [call, call], merge=True)
    assert first.status is again.status is Admission.ADMIT and first.tokens == again.tokens == 10
    assert budget.dataset_state(conn, "D").reserved == 10  # the second found it held: idempotent
