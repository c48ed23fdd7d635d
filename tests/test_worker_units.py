"""Fast unit tests of the pieces most likely to break: the script Batcher, the endpoint pool,
reading SGLang's responses, and the maintenance pass's leak detection. No subprocess; a
private Redis (tests/conftest.py) where Redis is involved, an in-process HTTP server for /health.
"""

from __future__ import annotations

import asyncio
import logging
import time

import aiohttp
import pytest
import redis.asyncio as aredis
from aiohttp import web

from budgetq.shared import budget, keys
from budgetq.shared.budget import Admission, Released
from budgetq.shared.config import DatasetConfig, ServerConfig
from budgetq.shared.errors import AbortedResponseError, BadResponseError, FatalRequestError
from budgetq.shared.maintenance import Maintenance, Report
from budgetq.shared.scripts import Batcher, ScriptCall, run
from budgetq.simulator.local import free_port
from budgetq.worker.endpoints import EndpointPool
from budgetq.worker.sglang_wire import parse_response


def _register(conn, ds: str = "D", limit: int = 10**6) -> None:
    budget.register_dataset(conn, DatasetConfig(name=ds, path="x", budget=limit, sampling={"max_tokens": 100},
                                                prior_mean_tokens=10))


# -- Batcher -------------------------------------------------------------------------------

def test_calls_made_in_one_loop_turn_share_one_round_trip_and_one_script_run(conn, redis_url):
    _register(conn)
    run(conn, budget.reserve("D", "warm", 100))  # script loaded: no NOSCRIPT round trip below

    async def main() -> tuple[list, int, int, int]:
        client = aredis.from_url(redis_url)
        try:
            b = Batcher(client)
            got = await asyncio.gather(*[b(budget.reserve("D", f"j{i}", 100)) for i in range(50)])
            return got, b.round_trips, b.calls, b.evalshas
        finally:
            await client.aclose()

    got, round_trips, calls, evalshas = asyncio.run(main())
    assert [r.status for r in got] == [Admission.ADMIT] * 50
    # one dataset's reservations: merged into one EVALSHA (shared/scripts.py, item scripts)
    assert round_trips == 1 and calls == 50 and evalshas == 1
    assert int(conn.get(keys.reserved_key("D"))) == sum(r.tokens for r in got) + 10  # + "warm"


def test_max_batch_splits_a_burst_into_several_pipelines(conn, redis_url):
    _register(conn)
    run(conn, budget.reserve("D", "warm", 100))

    async def main() -> int:
        client = aredis.from_url(redis_url)
        try:
            b = Batcher(client, max_batch=8)
            await asyncio.gather(*[b(budget.reserve("D", f"j{i}", 100)) for i in range(20)])
            return b.round_trips
        finally:
            await client.aclose()

    assert asyncio.run(main()) == 3  # 8 + 8 + 4


def test_scripts_flushed_from_redis_are_loaded_again(conn, redis_url):
    _register(conn)
    run(conn, budget.reserve("D", "warm", 100))  # the script is cached ...
    conn.script_flush()                           # ... and then lost (a Redis restart)

    async def main() -> tuple[list, int]:
        client = aredis.from_url(redis_url)
        try:
            b = Batcher(client)
            got = await asyncio.gather(b(budget.reserve("D", "a", 100)), b(budget.release("D", "warm")))
            return got, b.round_trips
        finally:
            await client.aclose()

    (res, rel), round_trips = asyncio.run(main())
    assert res.status is Admission.ADMIT and rel.status is Released.RELEASED
    assert round_trips == 2  # NOSCRIPT, then the same calls again after SCRIPT LOAD
    assert conn.hexists(keys.resv_key("D"), "a") and not conn.hexists(keys.resv_key("D"), "warm")


def test_an_error_reaches_only_the_caller_whose_call_failed(conn, redis_url):
    _register(conn)

    def unreadable(_raw: object) -> int:
        raise ValueError("cannot read this reply")

    async def main() -> list:
        client = aredis.from_url(redis_url)
        try:
            b = Batcher(client)
            calls = [
                b(budget.reserve("D", "ok1", 100)),
                b(budget.reserve("nope", "x", 100)),  # a Lua error_reply: dataset not registered
                b(ScriptCall("withdraw", keys.budget_keys("E"), [], unreadable)),  # a reply we cannot parse
                b(budget.reserve("D", "ok2", 100)),
            ]
            return await asyncio.gather(*calls, return_exceptions=True)
        finally:
            await client.aclose()

    ok1, missing, bad, ok2 = asyncio.run(main())
    assert ok1.status is Admission.ADMIT and ok2.status is Admission.ADMIT
    assert "dataset not registered" in str(missing)
    assert isinstance(bad, ValueError) and "cannot read" in str(bad)


def test_a_lost_connection_fails_every_caller_of_the_batch(redis_url):
    async def main() -> list:
        client = aredis.from_url(f"redis://127.0.0.1:{free_port()}/0", socket_connect_timeout=0.5)
        try:
            b = Batcher(client)
            return await asyncio.gather(*[b(budget.reserve("D", f"j{i}", 100)) for i in range(3)],
                                        return_exceptions=True)
        finally:
            await client.aclose()

    got = asyncio.run(main())
    assert len(got) == 3 and all(isinstance(e, Exception) for e in got), got


# -- EndpointPool ------------------------------------------------------------------------------

def test_pick_prefers_the_endpoint_with_fewest_requests_in_flight():
    async def main() -> None:
        async with aiohttp.ClientSession() as session:
            pool = EndpointPool(ServerConfig(urls=["http://a:1", "http://b:1", "http://c:1"]), session, {})
            a, b, c = pool.endpoints
            a.in_flight, b.in_flight, c.in_flight = 3, 1, 2
            assert {pool.pick().url for _ in range(20)} == {b.url}
            b.in_flight = 2
            assert {pool.pick().url for _ in range(50)} == {b.url, c.url}  # ties broken at random
            await pool.close()

    asyncio.run(main())


def test_an_endpoint_failing_in_a_row_is_ejected_and_readmitted_once_healthy():
    health = {"status": 503, "asked": 0}

    async def handler(_req: web.Request) -> web.Response:
        health["asked"] += 1
        return web.Response(status=health["status"])

    async def main() -> None:
        app = web.Application()
        app.router.add_get("/health", handler)
        runner = web.AppRunner(app)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        good, flaky = f"http://127.0.0.1:{free_port()}", f"http://127.0.0.1:{port}"
        try:
            async with aiohttp.ClientSession() as session:
                cfg = ServerConfig(urls=[good, flaky], eject_after_failures=3, health_interval_s=0.02)
                pool = EndpointPool(cfg, session, {})
                g, f = pool.endpoints
                pool.failure(f, "boom")
                pool.success(f)  # a success resets the run of failures
                pool.failure(f, "boom")
                pool.failure(f, "boom")
                assert f.healthy
                pool.failure(f, "boom")
                assert not f.healthy and f.ejected_since is not None
                assert {pool.pick().url for _ in range(20)} == {g.url}
                assert pool.snapshot()[flaky]["healthy"] is False
                # every endpoint down: requests wait (without spending attempts) until one is back
                for _ in range(3):
                    pool.failure(g, "down")
                assert pool.pick() is None
                waiter = asyncio.create_task(pool.wait_healthy())
                await _until(lambda: health["asked"] >= 2)
                assert not waiter.done()
                health["status"] = 200
                await asyncio.wait_for(waiter, 5)
                assert f.healthy and f.failures == 0 and f.ejected_since is None
                assert pool.pick() is f
                await pool.close()
        finally:
            await runner.cleanup()

    asyncio.run(main())


async def _until(cond, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


# -- parse_response ----------------------------------------------------------------------------

def _chat(finish: object = "stop", content: str | None = "hi", reasoning: str | None = None) -> dict:
    return {"choices": [{"message": {"content": content, "reasoning_content": reasoning}, "finish_reason": finish}],
            "usage": {"prompt_tokens": 7, "completion_tokens": 3}}


def _generate(finish: object) -> dict:
    return {"text": "out", "meta_info": {"finish_reason": finish, "prompt_tokens": 5, "completion_tokens": 9}}


def test_parse_response_reads_both_apis():
    out = parse_response("chat", _chat(reasoning="thought"), "http://s", time.monotonic())
    assert (out.text, out.reasoning, out.prompt_tokens, out.completion_tokens, out.finish_reason, out.endpoint) == \
        ("hi", "thought", 7, 3, "stop", "http://s")
    assert out.latency_s >= 0
    assert parse_response("chat", _chat(content=None), "u", 0).text == ""  # null content: empty answer
    gen = parse_response("generate", _generate({"type": "length", "length": 9}), "u", time.monotonic())
    assert (gen.text, gen.prompt_tokens, gen.completion_tokens, gen.finish_reason) == ("out", 5, 9, "length")
    assert parse_response("generate", _generate("stop"), "u", 0).finish_reason == "stop"


@pytest.mark.parametrize("body", [
    {}, {"choices": []}, {"choices": [{"message": {}, "finish_reason": "stop"}]},
    {"choices": [{"message": {"content": "x"}, "finish_reason": "stop"}], "usage": {"prompt_tokens": "many"}},
])
def test_a_malformed_response_is_a_bad_response_naming_the_server(body):
    with pytest.raises(BadResponseError, match="unexpected response from http://s"):
        parse_response("chat", body, "http://s", 0)


def test_an_abort_is_retryable_unless_the_server_refused_the_request():
    with pytest.raises(AbortedResponseError):
        parse_response("chat", _chat("abort"), "u", 0)
    with pytest.raises(AbortedResponseError):  # 503 while shutting down: try again
        parse_response("generate", _generate({"type": "abort", "status_code": 503, "message": "busy"}), "u", 0)
    with pytest.raises(FatalRequestError, match="too long"):
        parse_response("generate", _generate({"type": "abort", "status_code": 400, "message": "too long"}), "u", 0)
    with pytest.raises(FatalRequestError, match="finish_reason 'weird'"):
        parse_response("chat", _chat("weird"), "u", 0)


# -- the maintenance pass: leaked reservations ---------------------------------------------------

def test_a_reservation_is_released_only_after_two_passes_without_its_job(conn):
    _register(conn)
    m = Maintenance(conn, interval_s=1.0)
    for j in ("live", "leak", "brief"):
        assert run(conn, budget.reserve("D", j, 100)).status is Admission.ADMIT
    conn.zadd(keys.rq_wip_key("D"), {"live:e1": time.time() + 60})

    first = Report()
    m._release_leaks("D", first)
    assert first.leaks_released == 0  # one sighting is not enough: its claim may be on its way
    assert conn.hlen(keys.resv_key("D")) == 3

    run(conn, budget.release("D", "brief"))  # gone by itself before the second pass
    conn.zadd(keys.rq_wip_key("D"), {"brief:e2": time.time() + 60})
    second = Report()
    m._release_leaks("D", second)
    assert second.leaks_released == 1
    assert set(k.decode() for k in conn.hkeys(keys.resv_key("D"))) == {"live"}
    assert int(conn.get(keys.reserved_key("D"))) == int(conn.hget(keys.resv_key("D"), "live"))

    third = Report()
    m._release_leaks("D", third)  # nothing left to find; "live" is still running
    assert third.leaks_released == 0 and conn.hexists(keys.resv_key("D"), "live")


def test_leak_candidates_are_forgotten_once_nothing_is_reserved(conn):
    _register(conn)
    m = Maintenance(conn, interval_s=1.0)
    run(conn, budget.reserve("D", "a", 100))
    m._release_leaks("D", Report())
    run(conn, budget.release("D", "a"))
    m._release_leaks("D", Report())
    assert "D" not in m._leak_candidates
    # "a" reserved again (a new claim): it is a fresh candidate, not released at the next pass
    run(conn, budget.reserve("D", "a", 100))
    r = Report()
    m._release_leaks("D", r)
    assert r.leaks_released == 0 and conn.hexists(keys.resv_key("D"), "a")


def test_slots_resize_grows_at_once_and_shrinks_as_held_slots_come_back():
    from budgetq.worker.context import Slots

    async def scenario() -> None:
        slots = Slots(2)
        await slots.acquire()
        await slots.acquire()
        slots.resize(3)                      # one more free at once
        await asyncio.wait_for(slots.acquire(), 1)
        assert (slots.held, slots.limit) == (3, 3)
        slots.resize(1)                      # fewer: nothing is taken from running requests
        slots.release()
        slots.release()                      # two released, both retired
        assert slots.held == 1
        blocked = asyncio.ensure_future(slots.acquire())
        await asyncio.sleep(0)
        assert not blocked.done()            # one in flight is the limit now
        slots.release()
        await asyncio.wait_for(blocked, 1)
        assert slots.held == 1
        slots.resize(2)                      # grows: one more free at once
        await asyncio.wait_for(slots.acquire(), 1)
        assert (slots.held, slots.peak) == (2, 3)
        slots.resize(1)
        slots.resize(2)                      # a shrink undone before any slot came back retires nothing
        slots.release()
        await asyncio.wait_for(slots.acquire(), 1)
        assert slots.held == 2

    asyncio.run(scenario())


def test_a_job_held_long_is_reported_once_with_where_it_waits(caplog):
    import logging

    from budgetq.shared.jobs import Claimed
    from budgetq.worker.tracked import LONG_HELD_S, Phase, Tracked, report_long_held

    async def main() -> None:
        never = asyncio.Event()

        async def stuck() -> None:
            await never.wait()

        t = Tracked(Claimed("D-p1", "x", b""), "D", phase=Phase.SENDING)
        t.task = asyncio.create_task(stuck())
        await asyncio.sleep(0)
        log = logging.getLogger("budgetq.worker")
        report_long_held({"m": t}, log, now=t.started_at + 1)             # not long yet: nothing
        report_long_held({"m": t}, log, now=t.started_at + LONG_HELD_S + 5)
        report_long_held({"m": t}, log, now=t.started_at + LONG_HELD_S + 9)  # once only
        t.task.cancel()

    with caplog.at_level("INFO", logger="budgetq.worker"):
        asyncio.run(main())
    lines = [r.getMessage() for r in caplog.records if "waiting in" in r.getMessage()]
    assert len(lines) == 1 and "job D-p1: sending for 125 s" in lines[0] and "stuck" in lines[0], lines


def test_the_background_loops_stop_even_when_a_cancellation_is_swallowed(caplog):
    from budgetq.worker.loops import Loops

    async def main() -> Loops:
        loops = Loops("w-test")
        inside = asyncio.Event()

        async def swallows() -> None:  # as a library on the way once did: the cancel never reaches the loop
            inside.set()
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                pass

        once: list[bool] = []

        async def stuck() -> None:  # a task that ignores its first cancel altogether
            while True:
                try:
                    await asyncio.sleep(10)
                except asyncio.CancelledError:
                    if once:
                        raise
                    once.append(True)

        loops.every(0.001, swallows, "swallower")
        loops.run(stuck(), "stuck")
        await inside.wait()
        await loops.stop(timeout_s=0.5)
        return loops

    with caplog.at_level(logging.WARNING, logger="budgetq.worker"):
        loops = asyncio.run(main())
    swallower, stuck = loops.tasks
    assert swallower.done() and not swallower.cancelled()   # it ended at its next turn, cancel or not
    assert [r.getMessage() for r in caplog.records] == [
        "worker w-test: the swallower loop's cancellation was swallowed in "
        "test_the_background_loops_stop_even_when_a_cancellation_is_swallowed.<locals>.main.<locals>.swallows; "
        "it ends anyway",
        "worker w-test: background loops still running 0.5 s after the stop, left behind: stuck"]
