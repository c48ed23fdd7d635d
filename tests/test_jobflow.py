"""The job flow on its own: a JobContext around a private Redis and a stand-in for the SGLang
client, so each ending (committed, failed, aborted in flight, requeued on shutdown) is checked
fast and without a worker process. RQ's own API reads the results back."""

from __future__ import annotations

import asyncio
import time

import pytest
import redis.asyncio as aredis
from rq import Queue
from rq.job import Job, JobStatus
from rq.registry import CanceledJobRegistry, FailedJobRegistry, FinishedJobRegistry
from rq.serializers import JSONSerializer

from budgetq.shared import budget, jobs, keys
from budgetq.shared.config import DatasetConfig
from budgetq.shared.errors import FatalRequestError
from budgetq.shared.jobs import Skip
from budgetq.shared.ledger import read_ledgers
from budgetq.shared.schema import JobPayload, Message, SamplingParams
from budgetq.shared.scripts import Batcher
from budgetq.worker.context import JobContext, Slots
from budgetq.worker.control import Control
from budgetq.worker.estimator import LengthModel
from budgetq.worker.jobflow import run_job
from budgetq.worker.recorder import Recorder
from budgetq.worker.sglang_wire import Completion
from budgetq.worker.tracked import Abort, Phase, Tracked


class FakeClient:
    """Answers like SGLangClient.complete: at once, after ``release`` is set, or with an error."""

    model = "fake"

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.release.set()
        self.fail: set[str] = set()

    async def complete(self, payload: JobPayload, job_id: str) -> Completion:
        await self.release.wait()
        if job_id in self.fail:
            raise FatalRequestError("HTTP 400: prompt too long")
        return Completion("answer", None, 5, 12, "stop", "http://fake", 0.01)


def _enqueue(conn, payloads: list[dict]) -> None:
    budget.register_dataset(conn, DatasetConfig(name="D", path="x", budget=10**6, sampling={"max_tokens": 64},
                                                prior_mean_tokens=10))
    q = Queue(keys.queue_name("D"), connection=conn, serializer=JSONSerializer)
    for i, p in enumerate(payloads):
        q.enqueue("budgetq.worker.job.run_prompt", p, job_id=f"D-p{i}")


def _payload(i: int) -> dict:
    return JobPayload(id=f"p{i}", dataset="D", messages=[Message(role="user", content=f"q{i}")],
                      sampling=SamplingParams(max_tokens=64)).model_dump(mode="json")


async def _flow(redis_url: str, n: int, client: FakeClient, act=None,
                wrap=None) -> tuple[Recorder, list[Tracked], dict]:
    """Claim n jobs and run each through run_job; ``act(tracked)`` runs while they are in flight;
    ``wrap(batcher, aconn)`` stands between the job flow and Redis."""
    aconn = aredis.from_url(redis_url)
    try:
        batch = Batcher(aconn) if wrap is None else wrap(Batcher(aconn), aconn)
        table: dict[str, Tracked] = {}
        wake = asyncio.Event()
        length = LengthModel()
        recorder = Recorder(batch, aconn, "w-test")
        control = Control(aconn, batch, length, table, wake, "censored")
        await control.tick()
        ctx = JobContext(batch=batch, client=client, slots=Slots(8), length=length,  # type: ignore[arg-type]
                         control=control, recorder=recorder, jobs=table, wake=wake)
        claimed = await batch(jobs.claim("D", n, time.time() + 60, "w-test"))
        tracked = [Tracked(c, "D") for c in claimed]
        for t in tracked:
            table[t.claimed.member] = t
            t.task = asyncio.create_task(run_job(ctx, t))
        if act is not None:
            await act(tracked)
        await asyncio.wait_for(asyncio.gather(*[t.task for t in tracked if t.task]), 10)
        return recorder, tracked, table
    finally:
        await aconn.aclose()


def _stats(conn) -> dict[str, int]:
    return {k.decode(): int(v) for k, v in conn.hgetall(keys.stats_key("D")).items()}


def test_each_job_ends_once_in_the_registry_its_ending_names(conn, redis_url):
    _enqueue(conn, [_payload(0), {"id": "p1", "bogus": True}, _payload(2)])
    client = FakeClient()
    client.fail.add("D-p2")
    recorder, _tracked, table = asyncio.run(_flow(redis_url, 3, client))

    assert recorder.processed == 3 and not table
    assert dict(recorder.outcomes) == {"committed": 1, "failed": 2}
    assert jobs.registry(FinishedJobRegistry, "D", conn).get_job_ids(cleanup=False) == ["D-p0"]
    assert sorted(jobs.registry(FailedJobRegistry, "D", conn).get_job_ids(cleanup=False)) == ["D-p1", "D-p2"]
    result = Job.fetch("D-p0", connection=conn, serializer=JSONSerializer).latest_result()
    assert result is not None and result.return_value == {"status": "committed", "completion_tokens": 12}
    stats = _stats(conn)
    assert stats["committed"] == 1 and stats["failed"] == 2
    assert conn.hlen(keys.resv_key("D")) == 0 and int(conn.get(keys.reserved_key("D")) or 0) == 0


@pytest.mark.parametrize("reason", [Abort.BUDGET, Abort.WITHDRAWN])
def test_a_request_aborted_in_flight_is_released_and_requeued(conn, redis_url, reason):
    _enqueue(conn, [_payload(0)])
    client = FakeClient()
    client.release.clear()  # the request stays at the "server"

    async def abort(tracked: list[Tracked]) -> None:
        (t,) = tracked
        while t.phase is not Phase.SENDING:
            await asyncio.sleep(0.005)
        assert conn.hexists(keys.resv_key("D"), "D-p0")  # admitted: it holds a reservation
        t.cancel(reason)

    recorder, _tracked, table = asyncio.run(_flow(redis_url, 1, client, abort))
    assert recorder.processed == 1 and not table
    job = Job.fetch("D-p0", connection=conn, serializer=JSONSerializer)
    # Nothing aborted is lost: back at the front of the queue, runs again once admitted.
    assert job.get_status() == JobStatus.QUEUED and conn.lrange(keys.rq_queue_key("D"), 0, -1) == [b"D-p0"]
    assert reason.skip in (Skip.ABORTED_BUDGET, Skip.ABORTED_WITHDRAWN) and reason.skip.aborted
    assert jobs.registry(CanceledJobRegistry, "D", conn).get_job_ids(cleanup=False) == []
    assert _stats(conn).get("aborted") == 1 and conn.hlen(keys.resv_key("D")) == 0
    assert conn.zcard(keys.rq_wip_key("D")) == 0


def test_a_job_cancelled_for_shutdown_goes_back_to_the_front_of_its_queue(conn, redis_url):
    _enqueue(conn, [_payload(0), _payload(1)])
    client = FakeClient()
    client.release.clear()

    async def stop(tracked: list[Tracked]) -> None:
        while not all(t.phase is Phase.SENDING for t in tracked):
            await asyncio.sleep(0.005)
        for t in tracked:
            t.cancel(Abort.SHUTDOWN)

    recorder, _tracked, table = asyncio.run(_flow(redis_url, 2, client, stop))
    assert recorder.processed == 0 and not table
    assert sorted(x.decode() for x in conn.lrange(keys.rq_queue_key("D"), 0, -1)) == ["D-p0", "D-p1"]
    assert conn.zcard(keys.rq_wip_key("D")) == 0 and conn.hlen(keys.resv_key("D")) == 0
    assert _stats(conn).get("requeued") == 2
    assert Job.fetch("D-p0", connection=conn, serializer=JSONSerializer).get_status() == JobStatus.QUEUED


@pytest.mark.parametrize("reason", [Abort.SHUTDOWN, Abort.WITHDRAWN])
def test_a_job_cancelled_before_its_task_first_ran_still_ends_and_leaves_the_table(conn, redis_url, reason):
    # The feeder claims, creates the tasks and, with no await between, may cancel them (every server
    # down; an abort): a task cancelled before its first step never enters run_job, so its finally
    # never took the job off the table, and a burst worker waited for it forever.
    _enqueue(conn, [_payload(0), _payload(1)])

    async def at_once(tracked: list[Tracked]) -> None:
        for t in tracked:
            t.cancel(reason)   # the tasks exist and have not run a step yet

    recorder, _tracked, table = asyncio.run(_flow(redis_url, 2, FakeClient(), at_once))
    assert not table, table
    # not admitted yet: nothing to release; back at the front of the queue either way
    assert sorted(conn.lrange(keys.rq_queue_key("D"), 0, -1)) == [b"D-p0", b"D-p1"]
    assert conn.zcard(keys.rq_wip_key("D")) == 0 and conn.hlen(keys.resv_key("D")) == 0


class LosesCommits:
    """Redis as a failover leaves it: each commit is acknowledged, then every key is put back as it was
    before it, which is what a replica that never received the commit holds once it is promoted (the
    master that acknowledged it having died). What the worker does next lands on that state."""

    def __init__(self, batch: Batcher, aconn) -> None:
        self.batch, self.aconn = batch, aconn
        self.lost: list[str] = []
        # One call at a time, so that putting the keys back undoes the commit and nothing else
        self.lock = asyncio.Lock()

    async def __call__(self, call):
        async with self.lock:
            if call.script != "commit":
                return await self.batch(call)
            before = {k: await self.aconn.dump(k) for k in await self.aconn.keys("*")}
            out = await self.batch(call)
            await self.aconn.flushdb()  # the test's private server
            for k, v in before.items():
                await self.aconn.restore(k, 0, v)
        self.lost.append(call.args[3])  # commit's first item: the job id
        return out


def test_a_commit_lost_in_a_failover_puts_its_job_back_rather_than_ending_it(conn, redis_url):
    """The job's commit was acknowledged (COMMITTED), then lost: the Redis its finish reaches has the job
    running, its reservation held, and no commit. Ending it there would leave the prompt in no state and,
    its row never collected, in no file (tests/test_sentinel.py's run once ended complete with 159 rows of
    160). finish.lua puts it back on the queue instead; run again, it commits on the Redis that is left."""
    _enqueue(conn, [_payload(0), _payload(1)])
    conn.hset(keys.stats_key("D"), "enqueued", 2)  # as the producer counts them: the ledger's entered
    wrapped: list[LosesCommits] = []

    def lose(batch, aconn):
        wrapped.append(LosesCommits(batch, aconn))
        return wrapped[0]

    recorder, _tracked, table = asyncio.run(_flow(redis_url, 2, FakeClient(), wrap=lose))
    assert sorted(wrapped[0].lost) == ["D-p0", "D-p1"] and not table
    assert recorder.processed == 0 and not recorder.outcomes   # nothing recorded as ended
    for i in (0, 1):
        assert Job.fetch(f"D-p{i}", connection=conn, serializer=JSONSerializer).get_status() == JobStatus.QUEUED
    assert sorted(conn.lrange(keys.rq_queue_key("D"), 0, -1)) == [b"D-p0", b"D-p1"]
    assert conn.zcard(keys.rq_wip_key("D")) == 0 and jobs.registry(FinishedJobRegistry, "D", conn).count == 0
    assert conn.hlen(keys.resv_key("D")) == 0 and int(conn.get(keys.reserved_key("D")) or 0) == 0
    assert _stats(conn)["lost_commit"] == 2
    ledger = read_ledgers(conn, ["D"])["D"]
    assert (ledger["queued"], ledger["rows"], ledger["unaccounted"]) == (2, 0, 0), ledger

    recorder, _tracked, _table = asyncio.run(_flow(redis_url, 2, FakeClient()))  # on the Redis that is left
    assert dict(recorder.outcomes) == {"committed": 2}
    ledger = read_ledgers(conn, ["D"])["D"]
    assert (ledger["queued"], ledger["rows"], ledger["unaccounted"]) == (0, 2, 0), ledger
    assert conn.xlen(keys.results_key("D")) == 2 and int(conn.get(keys.used_key("D"))) == 24
