"""Worker behaviour: N in flight in one process, and a stock `rq worker` runs the same job."""

from __future__ import annotations

import asyncio
import json
import urllib.request
from pathlib import Path

import yaml
from rq import Queue
from rq.serializers import JSONSerializer

from budgetq.shared import keys
from budgetq.shared.budget import dataset_state, register_dataset
from budgetq.shared.config import DatasetConfig
from budgetq.shared.config_load import load_config
from budgetq.shared.schema import JobPayload, Message, SamplingParams
from budgetq.worker.runner import ConcurrentWorker
from tests.helpers import stock_rq_worker

ROOT = Path(__file__).resolve().parent.parent


def _enqueue(conn, n: int, ds: str = "D", budget: int = 10**9) -> None:
    register_dataset(conn, DatasetConfig(name=ds, path="x", budget=budget, sampling={"max_tokens": 4000},
                                         prior_mean_tokens=10))
    q = Queue(keys.queue_name(ds), connection=conn, serializer=JSONSerializer)
    for i in range(n):
        p = JobPayload(id=f"p{i}", dataset=ds, messages=[Message(role="user", content=f"q{i}")],
                       sampling=SamplingParams(max_tokens=4000))
        q.enqueue("budgetq.worker.job.run_prompt", p.model_dump(mode="json"), job_id=f"{ds}-p{i}")


def _cfg(tmp_path, redis_url, sim, **extra) -> Path:
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump({"redis_url": redis_url, "server": {"urls": [sim]}, **extra}))
    return path


def test_one_worker_process_holds_concurrency_in_flight(tmp_path, redis_url, conn, sim_factory):
    # Long responses so that requests overlap; the simulator reports how many run at once.
    # Each request lasts ~2 s, so 64 in flight need ~32 job starts/s from this process.
    sim = sim_factory("--speedup", "4", "--length-mean", "2000", "--length-sigma", "0.1",
                      "--max-running-requests", "512")
    _enqueue(conn, 200)
    w = ConcurrentWorker(load_config(_cfg(tmp_path, redis_url, sim), env={}), concurrency=64, burst=True)
    samples: list[int] = []

    async def sample() -> None:
        while True:
            await asyncio.sleep(0.05)
            stats = await asyncio.to_thread(lambda: json.loads(urllib.request.urlopen(sim + "/sim/stats").read()))
            samples.append(stats["running"])

    async def main() -> None:
        s = asyncio.create_task(sample())
        await w.run()
        s.cancel()

    asyncio.run(main())
    assert w.processed == 200 and w.in_flight_peak == 64
    print("in-flight samples", samples)
    assert max(samples) == 64
    # steady state: from the first time all 64 were in flight until the queue ran dry
    first, last = samples.index(64), len(samples) - 1 - samples[::-1].index(64)
    steady = sorted(samples[first:last + 1])
    assert steady[len(steady) // 2] >= 62, steady
    st = dataset_state(conn, "D")
    assert st.stats["committed"] == 200 and st.reserved == 0


def test_stock_rq_worker_runs_the_same_job_function(tmp_path, redis_url, conn, sim_factory):
    sim = sim_factory("--speedup", "500", "--length-mean", "20")
    _enqueue(conn, 3)
    stock_rq_worker(redis_url, keys.queue_name("D"), _cfg(tmp_path, redis_url, sim), tmp_path / "rq-worker.log",
                    "--worker-class", "rq.SimpleWorker")
    st = dataset_state(conn, "D")
    assert st.stats["committed"] == 3 and conn.xlen(keys.results_key("D")) == 3
    assert st.used == st.stats["sum_tokens"] > 0


def test_leases_of_long_requests_are_extended_while_they_run(tmp_path, redis_url, conn, sim_factory):
    # 3 jobs of ~5 s each against a 3 s lease: without heartbeats RQ would see them abandoned.
    sim = sim_factory("--speedup", "1", "--length-mean", "3000", "--length-sigma", "0.01",
                      "--peak-tok-s", "20000")
    _enqueue(conn, 3)
    path = _cfg(tmp_path, redis_url, sim, worker={"heartbeat_ttl_s": 3})
    w = ConcurrentWorker(load_config(path, env={}), concurrency=8, burst=True)
    q = Queue(keys.queue_name("D"), connection=conn, serializer=JSONSerializer)
    expired: list[int] = []

    async def watch() -> None:
        import time
        while True:
            await asyncio.sleep(0.5)
            entries = await asyncio.to_thread(conn.zrange, q.started_job_registry.key, 0, -1, withscores=True)
            expired.extend(1 for _m, score in entries if score < time.time())

    async def main() -> None:
        t = asyncio.create_task(watch())
        await w.run()
        t.cancel()

    asyncio.run(main())
    assert w.processed == 3 and not expired
    assert q.finished_job_registry.get_job_count(cleanup=False) == 3
