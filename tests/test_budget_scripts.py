"""The budget Lua scripts on a real Redis, including 50 racing clients."""

import asyncio

import redis.asyncio as aredis

from shared import keys
from shared.budget import Admission, AsyncBudget, SyncBudget, dataset_state, register_dataset
from shared.config import DatasetConfig


def _ds(conn, name="D", budget=1000, mode="soft", prior=30, max_tokens=30):
    ds = DatasetConfig(name=name, path="x.jsonl", budget=budget, mode=mode, prior_mean_tokens=prior,
                       sampling={"max_tokens": max_tokens})
    register_dataset(conn, ds)
    return ds


def test_reserve_commit_release_semantics(conn):
    _ds(conn, budget=100)
    b = SyncBudget(conn)
    r = b.reserve("D", "j1", 30)
    assert r.status is Admission.ADMIT and r.tokens == 30
    assert b.reserve("D", "j1", 30).status is Admission.ADMIT  # idempotent for the same job
    assert dataset_state(conn, "D").reserved == 30
    assert b.commit("D", "j1", 42, '{"id":"1"}') is True
    st = dataset_state(conn, "D")
    assert (st.used, st.reserved, st.in_flight) == (42, 0, 0)
    assert b.commit("D", "j1", 42, '{"id":"1"}') is False  # double commit counted once
    assert dataset_state(conn, "D").used == 42
    assert conn.xlen(keys.results_key("D")) == 1
    assert b.reserve("D", "j1", 30).status is Admission.DONE
    assert b.reserve("D", "j2", 100).status is Admission.ADMIT
    assert b.release("D", "j2") == 42  # running mean (42) > prior (30) was reserved
    assert b.release("D", "j2") == 0
    assert dataset_state(conn, "D").reserved == 0


def test_soft_mode_waits_then_exhausts(conn):
    _ds(conn, budget=100, prior=40)
    b = SyncBudget(conn)
    assert b.reserve("D", "a", 100).status is Admission.ADMIT
    assert b.reserve("D", "b", 100).status is Admission.ADMIT
    assert b.reserve("D", "c", 100).status is Admission.WAIT  # 80 + 40 > 100, may fit later
    b.commit("D", "a", 70, "{}")
    b.commit("D", "b", 40, "{}")
    assert b.reserve("D", "c", 100).status is Admission.EXHAUSTED
    assert dataset_state(conn, "D").stats["skipped"] == 1


def test_soft_mode_always_admits_one_when_nothing_in_flight(conn):
    _ds(conn, budget=100, prior=500, max_tokens=1000)
    assert SyncBudget(conn).reserve("D", "a", 1000).status is Admission.ADMIT


def test_pause_blocks_admission(conn):
    _ds(conn)
    conn.hset(keys.conf_key("D"), "paused", "1")
    assert SyncBudget(conn).reserve("D", "a", 30).status is Admission.PAUSED


def test_fifty_racing_clients_strict_never_passes_limit(redis_url, conn):
    _ds(conn, budget=1000, mode="strict", max_tokens=30)

    async def race():
        client = aredis.Redis.from_url(redis_url)
        b = AsyncBudget(client)
        res = await asyncio.gather(*[b.reserve("D", f"j{i}", 30) for i in range(50)])
        for i, r in enumerate(res):
            if r.status is Admission.ADMIT:
                await b.commit("D", f"j{i}", 30, "{}")
        # the same jobs again (a retry storm) must not count twice
        await asyncio.gather(*[b.commit("D", f"j{i}", 30, "{}") for i, r in enumerate(res)
                               if r.status is Admission.ADMIT])
        await client.aclose()
        return res

    res = asyncio.run(race())
    admitted = [r for r in res if r.status is Admission.ADMIT]
    assert len(admitted) == 33
    st = dataset_state(conn, "D")
    assert st.used == 990 <= st.limit
    assert st.stats["committed"] == 33


def test_fifty_racing_clients_soft_counts_exactly(redis_url, conn):
    _ds(conn, budget=1000, prior=30)

    async def race():
        client = aredis.Redis.from_url(redis_url)
        b = AsyncBudget(client)
        res = await asyncio.gather(*[b.reserve("D", f"j{i}", 100) for i in range(50)])
        await asyncio.gather(*[b.commit("D", f"j{i}", 25, "{}") for i, r in enumerate(res)
                               if r.status is Admission.ADMIT])
        await client.aclose()
        return res

    res = asyncio.run(race())
    n = sum(r.status is Admission.ADMIT for r in res)
    assert n == 33
    st = dataset_state(conn, "D")
    assert st.used == 25 * n and st.reserved == 0 and conn.scard(keys.done_key("D")) == n
