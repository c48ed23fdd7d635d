"""The simulator fails where SGLang 0.5.23 fails (docs/simulator.md, "SGLang behaviour -> simulator").

Each test names the SGLang function it mirrors. Conditions are waited on, never slept for; the
disconnect poll is set in simulated seconds so the tests stay short at any load.
"""

from __future__ import annotations

import asyncio
import json

import aiohttp

from tests.test_simulator import CHAT, MSGS, get, post, run_sim, until

LONG = {"text": "x", "sampling_params": {"max_new_tokens": 10**6}}
ENDLESS = {"length_mean": 10**6, "length_sigma": 0.0, "context_length": 10**7}


async def _records(c: aiohttp.ClientSession, u: str) -> dict[str, dict]:
    _, recs = await get(c, u + "/sim/requests")
    return {r["rid"]: r for r in recs}


# --- 1. duplicate rids (tokenizer_manager._send_one_request / rid_to_state) -----------------------


def test_duplicate_in_flight_rid_is_refused_on_both_apis():
    async def scenario(c, u):
        first = asyncio.create_task(post(c, u + "/generate", {**LONG, "rid": "dup-1"}))
        await until(c, u, lambda s: s["running"] == 1)
        status, body = await post(c, u + "/generate", {**LONG, "rid": "dup-1"})
        assert status == 400 and body == {"error": {"message": "Duplicate request ID detected: dup-1"}}
        status, body = await post(c, u + CHAT, {"messages": MSGS, "rid": "dup-1", "max_tokens": 5})
        assert status == 400 and body == {"object": "error", "message": "Duplicate request ID detected: dup-1",
                                          "type": "BadRequestError", "param": None, "code": 400}
        # Twice in one batch is refused too, before anything runs.
        status, body = await post(c, u + "/generate", {"text": ["a", "b"], "rid": ["b-1", "b-1"]})
        assert status == 400 and body["error"]["message"] == "Duplicate request ID detected: b-1"
        await post(c, u + "/abort_request", {"rid": "dup-1"})
        await first
        # Once it has ended, the rid is free again.
        one = {"text": "x", "rid": "dup-1", "sampling_params": {"max_new_tokens": 1}}
        status, _ = await post(c, u + "/generate", one)
        assert status == 200
        _, stats = await get(c, u + "/sim/stats")
        assert stats["errors"]["duplicate_rid"] == 3
    run_sim(scenario, **ENDLESS, max_running_requests=4)


# --- 2. abort by rid prefix (scheduler.abort_request) ------------------------------------------------


def test_abort_request_aborts_every_rid_with_the_prefix_and_counts_their_tokens():
    async def scenario(c, u):
        tasks = {rid: asyncio.create_task(post(c, u + "/generate", {**LONG, "rid": rid}))
                 for rid in ("job7", "job7.a1", "job7.b2", "job70", "other")}
        await until(c, u, lambda s: s["running"] == 5 and s["generated_tokens"] > 50)
        # A rid not in flight aborts nothing, even if it prefixes some (tokenizer_manager.abort_request).
        await post(c, u + "/abort_request", {"rid": "job"})
        assert (await get(c, u + "/sim/stats"))[1]["aborted"] == 0
        assert (await post(c, u + "/abort_request", {"rid": "job7"}))[0] == 200
        for rid in ("job7", "job7.a1", "job7.b2", "job70"):
            status, body = await tasks[rid]
            assert status == 200 and body["meta_info"]["finish_reason"] == {
                "type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
        stats = await until(c, u, lambda s: s["aborted"] == 4)
        assert stats["running"] == 1 and stats["aborted_tokens"] > 0
        await post(c, u + "/abort_request", {"rid": "other"})
        await tasks["other"]
        # Waste: every aborted request's tokens, as for disconnects.
        stats = await until(c, u, lambda s: s["aborted"] == 5)
        kept = sum(r["completion_tokens"] for r in (await _records(c, u)).values())
        assert stats["aborted_tokens"] == kept == stats["generated_tokens"]
    run_sim(scenario, **ENDLESS, speedup=50)


def test_abort_in_the_waiting_queue_has_sglangs_short_meta_info():
    async def scenario(c, u):
        running = asyncio.create_task(post(c, u + "/generate", {**LONG, "rid": "r1"}))
        waiting = asyncio.create_task(post(c, u + "/generate", {**LONG, "rid": "w1"}))
        chat = asyncio.create_task(post(c, u + CHAT, {"messages": MSGS, "rid": "w2", "max_tokens": 10**6}))
        await until(c, u, lambda s: s["queued"] == 2)
        await post(c, u + "/abort_request", {"rid": "w"})      # "w" is not in flight: nothing happens
        await post(c, u + "/abort_request", {"rid": "w1"})
        _, body = await waiting
        # tokenizer_manager._handle_abort_req
        assert body["meta_info"]["finish_reason"] == {"type": "abort", "message": "Abort in waiting queue"}
        assert set(body["meta_info"]) == {"id", "finish_reason", "weight_version", "e2e_latency", "completion_tokens"}
        await post(c, u + "/abort_request", {"abort_all": True})
        _, body = await chat
        assert body["choices"][0]["finish_reason"] == "abort"
        await running
    run_sim(scenario, **ENDLESS, max_running_requests=1)


# --- 3. disconnects are noticed late (tokenizer_manager._stream_one_response, create_abort_task) -------


HELD = 10**4   # simulated seconds: longer than any test, so a held request stays held until aborted


def test_dropped_non_streaming_client_keeps_its_rid_and_generates_until_the_poll():
    async def scenario(c, u):
        task = asyncio.create_task(post(c, u + "/generate", {**LONG, "rid": "gone-1"}))
        await until(c, u, lambda s: s["generated_tokens"] > 10)
        task.cancel()
        before = (await get(c, u + "/sim/stats"))[1]
        # It goes on generating with its slot ...
        stats = await until(c, u, lambda s: s["generated_tokens"] > before["generated_tokens"] + 100)
        assert stats["running"] == 1 and stats["aborted"] == 0
        # ... and its rid: a retry with the same rid is refused (so a retry needs a fresh rid).
        status, body = await post(c, u + "/generate", {**LONG, "rid": "gone-1"})
        assert status == 400 and body["error"]["message"] == "Duplicate request ID detected: gone-1"
        await post(c, u + "/abort_request", {"rid": "gone-1"})
        stats = await until(c, u, lambda s: s["aborted"] == 1)
        rec = (await _records(c, u))["gone-1"]
        assert rec["finish"] == "abort" and rec["completion_tokens"] == stats["aborted_tokens"]
        status, _ = await post(c, u + "/generate", {"text": "x", "rid": "gone-1",
                                                     "sampling_params": {"max_new_tokens": 1}})
        assert status == 200                                      # the rid is free again
    run_sim(scenario, **ENDLESS, speedup=50, disconnect_poll_s=HELD)


def test_the_state_wait_poll_aborts_a_dropped_client_after_at_least_one_poll():
    async def scenario(c, u):
        task = asyncio.create_task(post(c, u + "/generate", {**LONG, "rid": "gone-2"}))
        await until(c, u, lambda s: s["running"] == 1)
        task.cancel()
        stats = await until(c, u, lambda s: s["aborted"] == 1)
        assert stats["running"] == 0
        rec = (await _records(c, u))["gone-2"]
        # The poll fires at arrival + k x poll, k >= 1 (0.5 simulated s at 50x = 10 ms).
        assert rec["finish"] == "abort" and rec["finished"] - rec["arrived"] >= 0.5 / 50 * 0.99
    run_sim(scenario, **ENDLESS, speedup=50, disconnect_poll_s=0.5)


def test_dropped_streaming_client_is_held_then_aborted_after_the_stream_delay():
    async def scenario(c, u):
        async with c.post(u + CHAT, json={"messages": MSGS, "rid": "s-1", "max_tokens": 10**6, "stream": True}) as r:
            await r.content.readline()
        await until(c, u, lambda s: s["running"] == 1 and s["generated_tokens"] > 100)
        status, _ = await post(c, u + CHAT, {"messages": MSGS, "rid": "s-1", "max_tokens": 5})
        assert status == 400                                       # still held
        await post(c, u + "/abort_request", {"rid": "s-1"})
        await until(c, u, lambda s: s["aborted"] == 1)
    run_sim(scenario, **ENDLESS, speedup=50, stream_abort_s=HELD, stream_interval_s=0.01)

    async def released(c, u):
        async with c.post(u + CHAT, json={"messages": MSGS, "rid": "s-2", "max_tokens": 10**6, "stream": True}) as r:
            await r.content.readline()
        stats = await until(c, u, lambda s: s["aborted"] == 1)
        assert stats["running"] == 0
    run_sim(released, **ENDLESS, speedup=50, stream_abort_s=0.5, stream_interval_s=0.01)


def test_disconnect_poll_zero_aborts_at_once():
    async def scenario(c, u):
        task = asyncio.create_task(post(c, u + "/generate", {**LONG, "rid": "z"}))
        await until(c, u, lambda s: s["running"] == 1)
        task.cancel()
        await until(c, u, lambda s: s["aborted"] == 1)
    run_sim(scenario, **ENDLESS, disconnect_poll_s=0)


def test_drop_fault_closes_the_connection_but_the_request_runs_on():
    async def scenario(c, u):
        try:
            async with c.post(u + "/generate", json={**LONG, "rid": "d-1"}) as r:
                await r.read()
            raise AssertionError("the connection should have been dropped")
        except (aiohttp.ServerDisconnectedError, aiohttp.ClientPayloadError, aiohttp.ClientOSError):
            pass
        await until(c, u, lambda s: s["generated_tokens"] > 200 and s["running"] == 1)   # past the cut at 10
        await post(c, u + "/sim/faults", {"drop_rate": 0})
        # The server has not noticed yet: same rid -> duplicate (this is why a retry needs a fresh rid).
        status, body = await post(c, u + "/generate", {**LONG, "rid": "d-1"})
        assert status == 400 and "Duplicate request ID" in body["error"]["message"]
        await post(c, u + "/abort_request", {"rid": "d-1"})
        stats = await until(c, u, lambda s: s["dropped"] == 1)
        assert stats["aborted_tokens"] == stats["dropped_tokens"] == stats["generated_tokens"] > 200
        assert (await _records(c, u))["d-1"]["finish"] == "drop"
    run_sim(scenario, **ENDLESS, speedup=50, disconnect_poll_s=HELD, drop_rate=1.0, drop_after_tokens=10)


# --- 4. /generate sampling_params (api_contract + SamplingParams.verify) -----------------------------


def test_generate_unknown_or_mistyped_sampling_keys_fail_the_contract_gate():
    async def scenario(c, u):
        status, body = await post(c, u + "/generate", {"text": "x", "sampling_params": {"max_tokens": 5}})
        assert status == 400 and isinstance(body["error"], str)
        assert body["error"].startswith("unknown field `max_tokens`, expected one of `max_new_tokens`, `stop`,")
        status, body = await post(c, u + "/generate", {"text": "x", "sampling_params": {"top_p": "high"}})
        assert status == 400 and body == {"error": 'invalid type: string "high", expected f64'}
        status, body = await post(c, u + "/generate", {"text": "x", "sampling_params": {"top_k": 1.5}})
        assert status == 400 and body == {"error": "invalid type: floating point `1.5`, expected i64"}
        _, stats = await get(c, u + "/sim/stats")
        assert stats["requests"] == 0
    run_sim(scenario, speedup=1000, length_mean=10)


def test_sampling_verify_rules_and_messages_on_both_apis():
    # /generate keeps the JSON value (msgspec does not coerce): 0 reads "got 0."; chat's pydantic
    # model has made it a float: "got 0.0.".
    cases = [
        ({"top_p": 0}, "top_p must be in (0, 1], got {}.", "0", "0.0"),
        ({"top_k": 0}, "top_k must be -1 (disable) or at least 1, got {}.", "0", "0"),
        ({"temperature": -0.5}, "temperature must be a non-negative finite number, got {}.", "-0.5", "-0.5"),
        ({"min_p": 1.5}, "min_p must be in [0, 1], got {}.", "1.5", "1.5"),
        ({"repetition_penalty": 0}, "repetition_penalty must be in (0, 2] (1.0 = no penalty), got {}.", "0", "0.0"),
        ({"frequency_penalty": 3}, "frequency_penalty must be in [-2, 2], got {}.", "3", "3.0"),
    ]

    async def scenario(c, u):
        for params, message, native, chat in cases:
            status, body = await post(c, u + "/generate", {"text": "x", "sampling_params": params})
            assert status == 400 and body == {"error": {"message": message.format(native)}}, params
            status, body = await post(c, u + CHAT, {"messages": MSGS, "max_tokens": 5, **params})
            assert status == 400 and body["message"] == message.format(chat), params
            assert body["type"] == "BadRequestError"
        # Greedy (temperature 0) and top_k -1 are fine; null means the default.
        for params in ({"temperature": 0, "top_k": -1}, {"top_p": None, "top_k": None}):
            assert (await post(c, u + "/generate", {"text": "x", "sampling_params": params}))[0] == 200
        # A streamed /generate gets a ValueError after the 200, as one error event.
        async with c.post(u + "/generate", json={"text": "x", "stream": True, "sampling_params": {"top_p": 0}}) as r:
            assert r.status == 200
            raw = await r.text()
        first = json.loads(raw.split("\n\n")[0][len("data: "):])
        assert first["error"]["message"] == "top_p must be in (0, 1], got 0." and raw.endswith("data: [DONE]\n\n")
    run_sim(scenario, speedup=1000, length_mean=10)


# --- 5. context length (tokenizer_manager._validate_one_request) -------------------------------------


def test_context_check_is_input_plus_max_new_tokens_greater_than_context():
    async def scenario(c, u):
        ids = list(range(40))
        ok = {"input_ids": ids, "sampling_params": {"max_new_tokens": 10}}       # 40 + 10 == 50: allowed
        assert (await post(c, u + "/generate", ok))[0] == 200
        status, body = await post(c, u + "/generate", {"input_ids": ids, "sampling_params": {"max_new_tokens": 11}})
        assert status == 400 and body["error"]["message"] == (
            "Requested token count exceeds the model's maximum context length of 50 tokens. You requested a total "
            "of 51 tokens: 40 tokens from the input messages and 11 tokens for the completion. Please reduce the "
            "number of tokens in the input messages or the completion to fit within the limit.")
        status, body = await post(c, u + "/v1/completions", {"prompt": list(range(50)), "max_tokens": 1})
        assert status == 400 and body["message"] == ("The input (50 tokens) is longer than the model's context "
                                                     "length (50 tokens).") and body["type"] == "BadRequestError"
    run_sim(scenario, speedup=1000, length_mean=5, context_length=50)


# --- 7-9. response shapes, info routes, chat parameters --------------------------------------------


def test_generate_meta_info_keys():
    async def scenario(c, u):
        _, body = await post(c, u + "/generate", {"text": "x", "sampling_params": {"max_new_tokens": 3}})
        assert set(body["meta_info"]) == {"id", "finish_reason", "prompt_tokens", "weight_version", "num_retractions",
                                          "reasoning_tokens", "completion_tokens", "cached_tokens", "dp_rank",
                                          "e2e_latency", "response_sent_to_client_ts"}
        assert body["meta_info"]["weight_version"] == "default" and body["meta_info"]["num_retractions"] == 0
    run_sim(scenario, speedup=1000, length_mean=10)


def test_info_routes_and_loads_report_capacity():
    async def scenario(c, u):
        for path in ("/model_info", "/get_model_info"):
            _, info = await get(c, u + path)
            assert info["served_model_name"] == "m" and info["weight_version"] == "default"
        for path in ("/server_info", "/get_server_info"):
            _, info = await get(c, u + path)
            state = info["internal_states"][0]
            assert state["effective_max_running_requests_per_dp"] == 8
            assert state["memory_usage"]["token_capacity"] == info["max_total_num_tokens"] == 1234
            assert info["version"].startswith("0.5.23")
        _, loads = await get(c, u + "/v1/loads")
        [load] = loads["loads"]
        assert load["max_running_requests"] == 8 and load["max_total_num_tokens"] == 1234
        assert load["num_running_reqs"] == 0 and load["num_waiting_reqs"] == 0
    run_sim(scenario, model="m", max_running_requests=8, max_total_num_tokens=1234)


def test_chat_prefers_max_completion_tokens_ignores_generate_names_and_fills_generation_config():
    async def scenario(c, u):
        body = {"messages": MSGS, "max_completion_tokens": 3, "max_tokens": 7, "rid": "c1",
                "max_new_tokens": 99, "no_such_field": True, "temperature": 0.5}
        status, out = await post(c, u + CHAT, body)
        assert status == 200 and out["usage"]["completion_tokens"] == 3
        _, out = await post(c, u + CHAT, {"messages": MSGS, "max_tokens": 4, "rid": "c2"})
        assert out["usage"]["completion_tokens"] == 4
        recs = await _records(c, u)
        # Unset fields come from the generation config; set ones win (to_sampling_params).
        assert recs["c1"]["sampling"]["temperature"] == 0.5 and recs["c1"]["sampling"]["top_k"] == 20
        assert recs["c2"]["sampling"]["temperature"] == 0.6 and recs["c2"]["sampling"]["top_p"] == 0.95
        assert recs["c2"]["sampling"]["min_p"] == 0.0       # not in the config: SGLang's default
    run_sim(scenario, speedup=1000, length_mean=1000, length_sigma=0.0,
            generation_config={"temperature": 0.6, "top_p": 0.95, "top_k": 20})


def test_a_request_that_ends_before_its_disconnect_is_noticed_counts_as_waste():
    async def scenario(c, u):
        task = asyncio.create_task(post(c, u + "/generate", {"text": "x", "rid": "o-1",
                                                              "sampling_params": {"max_new_tokens": 2000}}))
        await until(c, u, lambda s: s["running"] == 1 and s["generated_tokens"] > 0)
        task.cancel()
        stats = await until(c, u, lambda s: s["orphaned"] == 1)
        assert stats["completed"] == stats["aborted"] == 0 and stats["running"] == 0
        assert stats["orphaned_tokens"] == stats["aborted_tokens"] == stats["generated_tokens"] == 2000
        rec = (await _records(c, u))["o-1"]
        assert rec["finish"] == "length" and rec["client_gone"] is True
    run_sim(scenario, **ENDLESS, speedup=2, disconnect_poll_s=HELD)   # ~1.7 s: the cancel comes well before


def test_a_disconnect_aborts_by_prefix_too():
    async def scenario(c, u):
        parent = asyncio.create_task(post(c, u + "/generate", {**LONG, "rid": "p7"}))
        child = asyncio.create_task(post(c, u + "/generate", {**LONG, "rid": "p7.a"}))
        other = asyncio.create_task(post(c, u + "/generate", {**LONG, "rid": "q7"}))
        await until(c, u, lambda s: s["running"] == 3)
        parent.cancel()
        # tokenizer_manager sends AbortReq("p7"): the scheduler aborts every rid starting with it.
        status, body = await child
        assert status == 200 and body["meta_info"]["finish_reason"]["type"] == "abort"
        stats = await until(c, u, lambda s: s["aborted"] == 2)
        assert stats["running"] == 1
        await post(c, u + "/abort_request", {"rid": "q7"})
        await other
    run_sim(scenario, **ENDLESS, disconnect_poll_s=0)
