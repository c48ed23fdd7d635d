"""bench/ceiling.py's busy-Redis run: the Redis calls of a fleet made as fast as Python can make them
(bench/ceiling.py's docstring says what is measured and why)."""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass

import _common as c

from budgetq.shared import keys
from budgetq.shared.identity import job_id

DS = "C1"


def enqueue_prompts(conn, n: int, result_ttl: int, batch: int) -> None:
    """The producer's work for n prompts, in batches as it refills a queue: its look-up of what
    Redis knows of them, then ``jobs.LeanQueue.enqueue_many`` in one pipeline per batch."""
    from rq import Queue
    from rq.serializers import JSONSerializer

    from budgetq.shared import jobs

    queue = jobs.LeanQueue(keys.queue_name(DS), connection=conn, serializer=JSONSerializer)
    q = "q" * 120
    for i in range(0, n, batch):
        items = [Queue.prepare_data("budgetq.worker.job.run", args=({"id": f"p{j}", "dataset": DS, "prompt_tokens": 30,
                                                             "messages": [{"role": "user", "content": q}]},),
                                    job_id=job_id(DS, f"p{j}"), timeout=-1, result_ttl=result_ttl,
                                    failure_ttl=jobs.KEEP_S, description=f"{DS}:p{j}")
                 for j in range(i, min(n, i + batch))]
        known = conn.pipeline(transaction=False)  # the producer's look before it enqueues
        known.smismember(keys.done_key(DS), [it.job_id for it in items])
        for it in items:
            known.hmget(keys.rq_job_key(it.job_id), ["status", "origin"])
        known.execute()
        with conn.pipeline() as pipe:
            queue.enqueue_many(items, pipeline=pipe)
            pipe.execute()


@dataclass
class Saturated:
    prompts: int
    virtual_workers: int
    seconds: float
    enqueue_us: float    # Redis CPU per prompt of the producer's enqueue (batches of 256)
    worker_us: float     # ... of the workers' calls and the collector, while Redis was busy
    busy: float          # Redis CPU seconds per wall second during the worker phase (1.0 = one core)
    evalsha_per_prompt: float

    @property
    def cpu_us(self) -> float:
        return self.enqueue_us + self.worker_us

    @property
    def projected(self) -> float:
        return 1e6 / self.cpu_us


def saturate(stack: c.Stack, n: int, virtual_workers: int, result_ttl: int, processes: int = 2) -> Saturated:
    """Redis under the load it would carry at its ceiling, which the worker processes cannot make on
    this machine (each spends ~1 ms of Python per prompt; two cores hold them, the producer, the
    simulator and Redis). A Redis that is mostly idle pays a wake-up, a read and a write for nearly
    every round trip and gets small batches; a busy one serves many clients per wake-up and the
    Batchers' queues grow while their pipeline is out, so their calls merge more: its CPU per
    prompt is lower, and that is what sets how many prompts one core carries.

    Here ``virtual_workers`` asyncio tasks, spread over ``processes`` processes, make exactly a
    worker's Redis calls -- claim, reserve, commit, finish, each through its own connection and its
    own ``shared.scripts.Batcher``, the worker's -- without the HTTP request and the worker's
    Python bookkeeping in between, while a thread runs the real ``Collector``. The producer's
    enqueue (``jobs.LeanQueue``, batches of 256, as it refills a queue) is measured before, on its
    own. The prompts/s is measured, not projected: what went through this Redis, at the busy
    fraction reported."""
    import asyncio
    import multiprocessing
    import threading

    import redis.asyncio as aredis

    from budgetq.producer.run.collector import Collector
    from budgetq.shared import budget, jobs
    from budgetq.shared.config import DatasetConfig
    from budgetq.shared.scripts import Batcher

    stack.flush()
    conn = stack.conn()
    budget.register_dataset(conn, DatasetConfig(name=DS, path="-", budget=10**12, max_tokens=64))
    cpu = lambda: sum(float(conn.info("cpu")[k]) for k in ("used_cpu_user", "used_cpu_sys"))  # noqa: E731
    q = "q" * 120
    c0 = cpu()
    enqueue_prompts(conn, n, result_ttl, 256)
    enqueue_us = 1e6 * (cpu() - c0) / n

    # the row of a prompt (the collector keeps one row per id)
    row = json.dumps({"id": "{}", "dataset": DS, "messages": [{"role": "user", "content": q}],
                      "completion": "a" * 80, "finish_reason": "stop", "completion_tokens": 16}).replace("{}", "%s")
    done = jobs.JobEnd.done(jobs.ResultStatus.COMMITTED, 16)
    stop = threading.Event()
    out = stack.dir / "saturate-out"
    shutil.rmtree(out, ignore_errors=True)
    collector = Collector(stack.conn(), out, [DS])

    def collect() -> None:
        while not stop.is_set():
            if not collector.drain():
                time.sleep(0.05)  # the producer's poll_interval_s
        collector.drain()

    async def one(batch: Batcher, cl: jobs.Claimed) -> None:
        await batch(budget.reserve(DS, cl.job_id, 64, 30))
        await batch(budget.commit(DS, cl.job_id, 30, 16, "stop", row % cl.job_id))
        await batch(jobs.finish(DS, cl, done, time.time(), "v"))

    async def worker(name: str) -> int:
        client = aredis.Redis.from_url(stack.url)
        batch = Batcher(client)
        try:
            while True:
                claimed = await batch(jobs.claim(DS, 64, time.time() + 600, name))
                if not claimed:
                    return batch.evalshas
                await asyncio.gather(*(one(batch, cl) for cl in claimed))
        finally:
            await client.aclose()

    async def main(names: list[str]) -> int:
        return sum(await asyncio.gather(*(worker(name) for name in names)))

    def driver(names: list[str], runs) -> None:  # one process's share of the virtual workers
        runs.put(asyncio.run(main(names)))

    # The virtual workers in `processes` processes (forked: they share these closures), so that
    # Python is less of the limit and Redis gets busier.
    ctx = multiprocessing.get_context("fork")
    runs = ctx.Queue()
    names = [f"v{i}" for i in range(virtual_workers)]
    procs = [ctx.Process(target=driver, args=(names[i::processes], runs)) for i in range(processes)]
    thread = threading.Thread(target=collect)
    c0, t0 = cpu(), time.monotonic()
    thread.start()
    for proc in procs:
        proc.start()
    evalshas = sum(runs.get(timeout=3600) for _ in procs)
    for proc in procs:
        proc.join()
    stop.set()
    thread.join()
    used, seconds = cpu() - c0, time.monotonic() - t0
    committed = int(conn.hget(keys.stats_key(DS), "committed") or 0)
    if committed != n or collector.written.get(DS, 0) != n:
        raise RuntimeError(f"saturate: {committed} committed, {collector.written.get(DS)} collected of {n}")
    return Saturated(n, virtual_workers, seconds, enqueue_us, 1e6 * used / n, used / seconds, evalshas / n)
