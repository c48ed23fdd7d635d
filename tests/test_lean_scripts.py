"""The paths the command-saving rewrites of claim, finish and commit (bench/ceiling.py) took
over from removed commands: a vanished or data-less job hash, and a held-but-done commit."""

from __future__ import annotations

import time

from rq import Queue
from rq.job import Job, JobStatus
from rq.registry import FinishedJobRegistry, StartedJobRegistry
from rq.serializers import JSONSerializer

from budgetq.shared import budget, keys
from budgetq.shared.budget import Outcome, dataset_state, register_dataset
from budgetq.shared.config import DatasetConfig
from budgetq.shared.jobs import JobEnd, ResultStatus, claim, finish
from budgetq.shared.scripts import run


def _queue(conn, n: int) -> Queue:
    q = Queue(keys.queue_name("D"), connection=conn, serializer=JSONSerializer)
    for i in range(n):
        q.enqueue("budgetq.worker.job.run_prompt", {"id": f"p{i}"}, job_id=f"D-p{i}")
    return q


def test_claim_skips_a_deleted_job_and_hands_over_one_without_data(conn):
    q = _queue(conn, 3)
    conn.delete(keys.rq_job_key("D-p0"))          # an operator deleted it
    conn.hdel(keys.rq_job_key("D-p1"), "data")    # a damaged hash: claimed, fails as unreadable
    got = run(conn, claim("D", 3, time.time() + 30, "w1"))
    assert [(c.job_id, c.data) for c in got[:1]] == [("D-p1", b"")] and got[1].job_id == "D-p2"
    started = StartedJobRegistry(q.name, connection=conn, serializer=JSONSerializer)
    assert sorted(started.get_job_ids(cleanup=False)) == ["D-p1", "D-p2"]
    assert not conn.exists(keys.rq_job_key("D-p0"))  # not recreated by the claim's HSET


def test_finish_of_a_deleted_job_hash_writes_no_hash_and_no_registry_entry(conn):
    q = _queue(conn, 2)
    c0, c1 = run(conn, claim("D", 2, time.time() + 30, "w1"))
    conn.delete(keys.rq_job_key(c0.job_id))
    conn.sadd(keys.done_key("D"), c0.job_id, c1.job_id)  # committed: finish.lua checks
    assert run(conn, finish("D", c0, JobEnd.done(ResultStatus.COMMITTED), time.time(), "w1"))
    assert run(conn, finish("D", c1, JobEnd.done(ResultStatus.COMMITTED), time.time(), "w1"))
    assert not conn.exists(keys.rq_job_key(c0.job_id))
    assert FinishedJobRegistry(q.name, connection=conn).get_job_ids(cleanup=False) == [c1.job_id]
    job = Job.fetch(c1.job_id, connection=conn, serializer=JSONSerializer)
    assert job.get_status() == JobStatus.FINISHED and 0 < conn.ttl(keys.rq_job_key(c1.job_id)) <= 500
    assert job.latest_result().return_value == {"status": "committed"}


def test_commit_of_a_held_admission_for_a_done_prompt_is_a_duplicate(conn):
    register_dataset(conn, DatasetConfig(name="D", path="x.jsonl", budget=1000, prior_mean_tokens=30,
                                         sampling={"max_tokens": 30}))
    assert run(conn, budget.reserve("D", "j1", 30)).tokens == 30
    conn.sadd(keys.done_key("D"), "j1")  # another copy of it was committed meanwhile
    assert run(conn, budget.commit("D", "j1", 5, 20, "stop", '{"id": "j1"}')) is Outcome.DUPLICATE
    st = dataset_state(conn, "D")
    assert (st.used, st.reserved, st.in_flight) == (0, 0, 0)
    assert st.stats["duplicate_result"] == 1 and st.stats["wasted_tokens"] == 20 and "committed" not in st.stats
    assert conn.xlen(keys.results_key("D")) == 0
