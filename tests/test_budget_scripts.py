"""The budget Lua scripts on a real Redis, including racing clients."""

import asyncio

from budgetq.shared import budget, keys
from budgetq.shared.budget import Admission, Outcome, dataset_state, register_dataset
from budgetq.shared.config import DatasetConfig
from budgetq.shared.redis_conn import aconnect
from budgetq.shared.scripts import arun, run


def _ds(conn, name="D", budget_=1000, mode="soft", prior=30, max_tokens=30, **extra):
    ds = DatasetConfig(name=name, path="x.jsonl", budget=budget_, mode=mode, prior_mean_tokens=prior,
                       sampling={"max_tokens": max_tokens}, **extra)
    register_dataset(conn, ds)
    return ds


def _commit(conn, job, completion, finish="stop", prompt=5, row=None):
    return run(conn, budget.commit("D", job, prompt, completion, finish, row or f'{{"id":"{job}"}}'))


def test_reserve_commit_release_semantics(conn):
    _ds(conn, budget_=100)
    r = run(conn, budget.reserve("D", "j1", 30))
    assert r.status is Admission.ADMIT and r.tokens == 30
    assert run(conn, budget.reserve("D", "j1", 30)).status is Admission.ADMIT  # idempotent for the same job
    assert dataset_state(conn, "D").reserved == 30
    assert _commit(conn, "j1", 42) is Outcome.COMMITTED
    st = dataset_state(conn, "D")
    assert (st.used, st.reserved, st.in_flight) == (42, 0, 0)
    assert _commit(conn, "j1", 42) is Outcome.DUPLICATE  # double commit counted once
    assert dataset_state(conn, "D").used == 42
    assert conn.xlen(keys.results_key("D")) == 1
    assert run(conn, budget.reserve("D", "j1", 30)).status is Admission.DONE
    assert run(conn, budget.reserve("D", "j2", 100)).status is Admission.ADMIT
    # the running mean (42) is above the prior (30)
    assert run(conn, budget.release("D", "j2", 7)) == budget.Release(budget.Released.RELEASED, 42)
    assert run(conn, budget.release("D", "j2")) == budget.Release(budget.Released.RELEASED, 0)
    st = dataset_state(conn, "D")
    # the duplicate's 42 tokens and the released request's 7 were generated for nothing
    assert st.reserved == 0 and st.stats["wasted_tokens"] == 42 + 7


def test_soft_mode_waits_then_exhausts(conn):
    _ds(conn, budget_=100, prior=40, max_tokens=100)
    assert run(conn, budget.reserve("D", "a", 100)).status is Admission.ADMIT
    assert run(conn, budget.reserve("D", "b", 100)).status is Admission.ADMIT
    assert run(conn, budget.reserve("D", "c", 100)).status is Admission.WAIT  # 80 + 40 > 100, may fit later
    assert _commit(conn, "a", 70) is Outcome.COMMITTED
    assert _commit(conn, "b", 40) is Outcome.CROSSED
    assert run(conn, budget.reserve("D", "c", 100)).status is Admission.EXHAUSTED


def test_crossing_a_soft_budget_withdraws_the_other_admissions(conn):
    _ds(conn, budget_=100, prior=30, max_tokens=100)
    for j in "abc":
        assert run(conn, budget.reserve("D", j, 100)).status is Admission.ADMIT
    assert _commit(conn, "a", 120) is Outcome.CROSSED  # one long answer crosses the budget
    st = dataset_state(conn, "D")
    assert st.used == 120 and st.reserved == 0 and st.in_flight == 0
    # the results still on their way are rejected: used stays below limit + max_tokens
    assert _commit(conn, "b", 50) is Outcome.REJECTED
    assert _commit(conn, "c", 20) is Outcome.REJECTED
    st = dataset_state(conn, "D")
    assert st.used == 120 and st.stats["rejected"] == 2 and st.stats["wasted_tokens"] == 70
    assert conn.xlen(keys.results_key("D")) == 1 and conn.scard(keys.done_key("D")) == 1


def test_soft_mode_always_admits_one_when_nothing_in_flight(conn):
    _ds(conn, budget_=100, prior=500, max_tokens=1000)
    assert run(conn, budget.reserve("D", "a", 1000)).status is Admission.ADMIT


def test_pause_blocks_admission(conn):
    _ds(conn)
    conn.hset(keys.conf_key("D"), "paused", "1")
    assert run(conn, budget.reserve("D", "a", 30)).status is Admission.PAUSED


def test_count_total_and_keep_complete(conn):
    _ds(conn, budget_=10_000, prior=50, max_tokens=100, count="total", keep="complete")
    assert run(conn, budget.reserve("D", "a", 100, prompt_tokens=20)).tokens == 70  # 50 + prompt 20
    assert _commit(conn, "a", 60, prompt=20) is Outcome.COMMITTED
    assert dataset_state(conn, "D").used == 80  # prompt + completion
    run(conn, budget.reserve("D", "b", 100, prompt_tokens=20))
    # cut by max_tokens: kept aside, done, not counted
    assert _commit(conn, "b", 100, finish="length", prompt=20) is Outcome.TRUNCATED
    st = dataset_state(conn, "D")
    assert st.used == 80 and st.stats["truncated"] == 1 and st.stats["truncated_tokens"] == 100
    kinds = [f[b"kind"] for _i, f in conn.xrange(keys.results_key("D"))]
    assert kinds == [b"row", b"truncated"]
    assert run(conn, budget.reserve("D", "b", 100)).status is Admission.DONE


def test_drain_mode_reserves_nothing_and_counts_everything(conn):
    _ds(conn, budget_=100, mode="drain", max_tokens=100)
    for j in "abcd":
        assert run(conn, budget.reserve("D", j, 100)).status is Admission.ADMIT
    assert dataset_state(conn, "D").reserved == 0
    for j in "abcd":
        assert _commit(conn, j, 60).kept
    assert dataset_state(conn, "D").used == 240  # the naive policy overshoots by what was in flight
    assert run(conn, budget.reserve("D", "e", 100)).status is Admission.EXHAUSTED


def test_adjust_raises_only_held_reservations_and_withdraw_cancels_all(conn):
    _ds(conn, budget_=1000, prior=30, max_tokens=100)
    run(conn, budget.reserve("D", "a", 100))
    run(conn, budget.reserve("D", "b", 100))
    assert run(conn, budget.adjust("D", {"a": 90, "zz": 50})) == 120  # zz holds nothing: ignored
    assert run(conn, budget.withdraw("D")) == 2
    st = dataset_state(conn, "D")
    assert st.reserved == 0 and st.in_flight == 0 and st.abort_epoch == 1
    assert _commit(conn, "a", 10) is Outcome.REJECTED


def test_adopt_counts_rows_once(conn):
    _ds(conn, budget_=1000)
    assert run(conn, budget.adopt("D", [("a", 10, 10), ("b", -1, 30)])) == (2, 10)
    assert run(conn, budget.adopt("D", [("a", 10, 10), ("c", 5, 5)])) == (1, 5)
    st = dataset_state(conn, "D")
    assert st.used == 15 and st.stats["committed"] == 2 and st.stats["truncated"] == 1
    assert conn.scard(keys.done_key("D")) == 3


def test_fifty_racing_clients_strict_never_passes_limit(redis_url, conn):
    _ds(conn, budget_=1000, mode="strict", max_tokens=30)

    async def race():
        client = aconnect(redis_url)
        res = await asyncio.gather(*[arun(client, budget.reserve("D", f"j{i}", 30)) for i in range(50)])
        for i, r in enumerate(res):
            if r.status is Admission.ADMIT:
                await arun(client, budget.commit("D", f"j{i}", 0, 30, "stop", "{}"))
        # the same jobs again (a retry storm) must not count twice
        again = await asyncio.gather(*[arun(client, budget.commit("D", f"j{i}", 0, 30, "stop", "{}"))
                                       for i, r in enumerate(res) if r.status is Admission.ADMIT])
        await client.aclose()
        return res, again

    res, again = asyncio.run(race())
    admitted = [r for r in res if r.status is Admission.ADMIT]
    assert len(admitted) == 33 and all(o is Outcome.DUPLICATE for o in again)
    st = dataset_state(conn, "D")
    assert st.used == 990 <= st.limit
    assert st.stats["committed"] == 33


def test_fifty_racing_clients_soft_counts_exactly(redis_url, conn):
    _ds(conn, budget_=1000, prior=30, max_tokens=100)

    async def race():
        client = aconnect(redis_url)
        res = await asyncio.gather(*[arun(client, budget.reserve("D", f"j{i}", 100)) for i in range(50)])
        await asyncio.gather(*[arun(client, budget.commit("D", f"j{i}", 0, 25, "stop", "{}"))
                               for i, r in enumerate(res) if r.status is Admission.ADMIT])
        await client.aclose()
        return res

    res = asyncio.run(race())
    n = sum(r.status is Admission.ADMIT for r in res)
    assert n == 33
    st = dataset_state(conn, "D")
    assert st.used == 25 * n and st.reserved == 0 and conn.scard(keys.done_key("D")) == n


def _lengths_seen(conn, lengths):
    """Commit finished requests of these lengths (their reservations taken and given back)."""
    for i, n in enumerate(lengths):
        assert run(conn, budget.reserve("D", f"seen{i}", 1000)).status is Admission.ADMIT
        assert _commit(conn, f"seen{i}", n) is Outcome.COMMITTED


def test_the_end_game_margin_keeps_sd_times_root_in_flight_free(conn):
    # 40 lengths of 50 or 150: mean 100, sd 50. Budget chosen so used + reserved + est fits.
    _ds(conn, budget_=4000 + 600 + 80, prior=100, max_tokens=1000, end_margin_z=1.0)
    _lengths_seen(conn, [50, 150] * 20)
    assert dataset_state(conn, "D").used == 4000
    for j in "abc":  # 3 in flight x 100 reserved
        assert run(conn, budget.reserve("D", j, 1000)).status is Admission.ADMIT
    # a 4th: 4000 + 300 + 100 = 4400 <= 4680, but the margin 1.0 x 50 x sqrt(3 + 1) = 100 more still fits
    assert run(conn, budget.reserve("D", "d", 1000)).status is Admission.ADMIT
    # a 5th: 4000 + 400 + 100 + 50 x sqrt(5) = 4611.8 <= 4680: fits; a 6th: 4600 + 50 x sqrt(6) = 4722 > 4680
    assert run(conn, budget.reserve("D", "e", 1000)).status is Admission.ADMIT
    assert run(conn, budget.reserve("D", "f", 1000)).status is Admission.WAIT
    st = dataset_state(conn, "D")
    assert st.stats["sum_sq_completion"] == 20 * (50 * 50 + 150 * 150)


def test_without_the_margin_admissions_run_to_the_plain_sum(conn):
    _ds(conn, budget_=4000 + 600 + 80, prior=100, max_tokens=1000, end_margin_z=0)
    _lengths_seen(conn, [50, 150] * 20)
    for j in "abcdef":  # 4000 + 6 x 100 = 4600 <= 4680
        assert run(conn, budget.reserve("D", j, 1000)).status is Admission.ADMIT
    assert run(conn, budget.reserve("D", "g", 1000)).status is Admission.WAIT  # 4600 + 100 > 4680


def test_the_margin_never_stops_the_tail_from_filling(conn):
    # nothing in flight and budget left: one request is always admitted, margin or not
    _ds(conn, budget_=4000 + 10, prior=100, max_tokens=1000, end_margin_z=5.0)
    _lengths_seen(conn, [50, 150] * 20)
    assert run(conn, budget.reserve("D", "a", 1000)).status is Admission.ADMIT
    assert run(conn, budget.reserve("D", "b", 1000)).status is Admission.WAIT
