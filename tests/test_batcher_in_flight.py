"""The Batcher keeps one pipeline in flight: calls made meanwhile wait for it and go together."""

from __future__ import annotations

import asyncio

import redis.asyncio as aredis

from budgetq.shared import budget
from budgetq.shared.budget import Admission
from budgetq.shared.config import DatasetConfig
from budgetq.shared.scripts import Batcher, run


def test_calls_made_while_a_pipeline_is_in_flight_go_together_after_it(conn, redis_url):
    budget.register_dataset(conn, DatasetConfig(name="D", path="x", budget=10**6, sampling={"max_tokens": 100},
                                                prior_mean_tokens=10))
    run(conn, budget.reserve("D", "warm", 100))  # script loaded: no NOSCRIPT round trip below

    async def main() -> tuple[list, int, int]:
        client = aredis.from_url(redis_url)
        try:
            b = Batcher(client)
            first = asyncio.ensure_future(b(budget.reserve("D", "j0", 100)))
            await asyncio.sleep(0)  # the first pipeline leaves
            later = []
            for turn in range(5):   # five more loop turns, each with calls, while it is out
                later += [asyncio.ensure_future(b(budget.reserve("D", f"j{turn}-{i}", 100))) for i in range(4)]
                await asyncio.sleep(0)
            got = await asyncio.gather(first, *later)
            return got, b.round_trips, b.calls
        finally:
            await client.aclose()

    got, round_trips, calls = asyncio.run(main())
    assert [r.status for r in got] == [Admission.ADMIT] * 21 and calls == 21
    assert round_trips < 6  # one per loop turn without the limit; here the 20 later calls share
