"""The simulator speaks SGLang's shapes, models a batch engine, aborts on disconnect and injects faults.

Most tests start the server in-process (start_sim) and talk real HTTP to it with aiohttp; a few
go through `budgetq sim` subprocesses (sim_factory) to cover the flags. No timing assertions.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import pytest

from budgetq.simulator.lengths import LengthModel
from budgetq.simulator.model import SimSettings
from budgetq.simulator.server import start_sim

CHAT = "/v1/chat/completions"
MSGS = [{"role": "user", "content": "hello there, how are you"}]
Scenario = Callable[[aiohttp.ClientSession, str], Awaitable[Any]]


def run_sim(scenario: Scenario, **settings: Any) -> Any:
    """Run ``scenario(client, base_url)`` against an in-process simulator with these settings."""
    async def main() -> Any:
        runner = await start_sim(SimSettings(**settings), "127.0.0.1", 0)
        port = runner.addresses[0][1]
        try:
            async with aiohttp.ClientSession() as client:
                return await asyncio.wait_for(scenario(client, f"http://127.0.0.1:{port}"), 60)
        finally:
            await runner.cleanup()
    return asyncio.run(main())


async def post(c: aiohttp.ClientSession, url: str, body: Any, **kw: Any) -> tuple[int, Any]:
    async with c.post(url, json=body, **kw) as r:
        return r.status, await r.json(content_type=None)


async def get(c: aiohttp.ClientSession, url: str, **kw: Any) -> tuple[int, Any]:
    async with c.get(url, **kw) as r:
        text = await r.text()
        try:
            return r.status, json.loads(text)
        except ValueError:
            return r.status, text


async def sse(c: aiohttp.ClientSession, url: str, body: dict) -> list[Any]:
    """The events of a streamed answer: parsed JSON objects, and the string "[DONE]"."""
    async with c.post(url, json=body) as r:
        assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
        raw = await r.text()
    events = []
    for block in raw.split("\n\n"):
        if block.strip():
            assert block.startswith("data: "), block
            data = block[len("data: "):]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


async def until(c: aiohttp.ClientSession, base: str, pred: Callable[[dict], bool], limit_s: float = 20) -> dict:
    """Poll /sim/stats until ``pred`` holds (bounded)."""
    for _ in range(int(limit_s / 0.02)):
        _, stats = await get(c, base + "/sim/stats")
        if pred(stats):
            return stats
        await asyncio.sleep(0.02)
    raise AssertionError(f"condition not reached; last stats {stats}")


# --- shapes -----------------------------------------------------------------------------------------


def test_chat_shape_and_reasoning_inline_without_parser():
    async def scenario(c, u):
        status, body = await post(c, u + CHAT, {"messages": MSGS, "max_tokens": 10, "rid": "A1-x"})
        assert status == 200 and body["object"] == "chat.completion" and body["id"] == "A1-x"
        ch = body["choices"][0]
        assert set(ch) == {"index", "message", "logprobs", "finish_reason", "matched_stop"}
        msg = ch["message"]
        # ChatMessage drops tool_calls when None (SGLang 0.5.23 protocol.py).
        assert set(msg) == {"role", "content", "reasoning_content"}
        assert msg["role"] == "assistant" and msg["reasoning_content"] is None
        assert body["metadata"] == {"weight_version": "default"}
        assert ch["finish_reason"] == "length" and ch["matched_stop"] is None
        # No parser: the thinking stays in content; cut by max_tokens, it never reached </think>.
        assert msg["content"].startswith("<think>") and "</think>" not in msg["content"]
        usage = body["usage"]
        assert usage["completion_tokens"] == 10 and usage["total_tokens"] == usage["prompt_tokens"] + 10
        assert usage["reasoning_tokens"] == 10 and usage["prompt_tokens_details"] is None
        assert usage["completion_tokens_details"] == {"reasoning_tokens": 10}
        _, body = await post(c, u + CHAT, {"messages": MSGS, "max_tokens": 9000})
        think, answer = body["choices"][0]["message"]["content"].split("</think>")
        assert len(think.split()) == 2500 and len(answer.split()) == 2500
        assert usage["prompt_tokens"] == len(MSGS[0]["content"]) // 4
    run_sim(scenario, speedup=1000, length_mean=5000, length_sigma=0.0, reasoning_tokens_frac=0.5)


def test_chat_with_reasoning_parser_separates_reasoning_content():
    async def scenario(c, u):
        _, body = await post(c, u + CHAT, {"messages": MSGS, "max_tokens": 1000})
        msg, usage = body["choices"][0]["message"], body["usage"]
        assert body["choices"][0]["finish_reason"] == "stop" and body["choices"][0]["matched_stop"] is not None
        assert "<think>" not in msg["content"] and len(msg["reasoning_content"].split()) == 25
        assert len(msg["content"].split()) == 75 and usage["reasoning_tokens"] == 25
        _, body = await post(c, u + CHAT, {"messages": MSGS, "separate_reasoning": False})
        assert body["choices"][0]["message"]["content"].startswith("<think>")
        _, body = await post(c, u + CHAT, {"messages": MSGS, "chat_template_kwargs": {"enable_thinking": False}})
        assert body["choices"][0]["message"]["reasoning_content"] is None and body["usage"]["reasoning_tokens"] == 0
        _, gen = await post(c, u + "/generate", {"text": "x", "sampling_params": {"max_new_tokens": 500}})
        assert gen["text"].startswith("<think>") and gen["meta_info"]["reasoning_tokens"] == 25   # always inline
    run_sim(scenario, speedup=1000, length_mean=100, length_sigma=0.0, reasoning_tokens_frac=0.25,
            reasoning_parser="qwen3")


def test_chat_stream_role_first_reasoning_key_usage_only_when_asked():
    async def scenario(c, u):
        body = {"messages": MSGS, "max_tokens": 1000, "stream": True, "rid": "s1"}
        events = await sse(c, u + CHAT, body)
        assert events[-1] == "[DONE]" and all(e["object"] == "chat.completion.chunk" for e in events[:-1])
        first, last = events[0]["choices"][0], events[-2]["choices"][0]
        assert first["delta"]["role"] == "assistant" and first["delta"]["content"] == ""
        assert all("reasoning_content" in e["choices"][0]["delta"] for e in events[:-1])
        assert last["finish_reason"] == "stop" and all(e["usage"] is None for e in events[:-1])
        reasoning = "".join(e["choices"][0]["delta"]["reasoning_content"] or "" for e in events[:-1])
        content = "".join(e["choices"][0]["delta"]["content"] or "" for e in events[:-1])
        assert len(reasoning.split()) == 10 and len(content.split()) == 30
        events = await sse(c, u + CHAT, {**body, "stream_options": {"include_usage": True}})
        usage = events[-2]
        assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 40
        assert usage["usage"]["reasoning_tokens"] == 10 and events[-3]["choices"][0]["finish_reason"] == "stop"
    run_sim(scenario, speedup=200, length_mean=40, length_sigma=0.0, reasoning_tokens_frac=0.25,
            reasoning_parser="deepseek-r1", stream_interval_s=0.001)


def test_completions_default_max_tokens_and_stream():
    async def scenario(c, u):
        status, body = await post(c, u + "/v1/completions", {"prompt": "once upon a time"})
        assert status == 200 and body["object"] == "text_completion"
        ch = body["choices"][0]
        assert ch["finish_reason"] == "length" and len(ch["text"].split()) == 16   # max_tokens defaults to 16
        assert body["usage"]["completion_tokens"] == 16
        _, body = await post(c, u + "/v1/completions", {"prompt": [[1, 2, 3, 4, 5], [6, 7]], "max_tokens": 3})
        assert [ch["index"] for ch in body["choices"]] == [0, 1] and body["usage"]["prompt_tokens"] == 7
        events = await sse(c, u + "/v1/completions", {"prompt": "x", "max_tokens": 30, "stream": True,
                                                       "stream_options": {"include_usage": True}})
        assert events[-1] == "[DONE]" and events[-2]["usage"]["completion_tokens"] == 30
        text = "".join(e["choices"][0]["text"] for e in events[:-2])
        assert len(text.split()) == 30 and events[-3]["choices"][0]["finish_reason"] == "length"
    run_sim(scenario, speedup=500, length_mean=1000, length_sigma=0.0, stream_interval_s=0.001)


def test_generate_single_batch_input_ids_and_cumulative_stream():
    async def scenario(c, u):
        status, body = await post(c, u + "/generate", {"text": "hello", "sampling_params": {"max_new_tokens": 1}})
        assert status == 200 and body["meta_info"]["finish_reason"] == {"type": "length", "length": 1}
        assert len(body["output_ids"]) == 1
        assert set(body["meta_info"]) >= {"id", "finish_reason", "prompt_tokens", "completion_tokens",
                                          "cached_tokens", "reasoning_tokens", "e2e_latency"}
        _, body = await post(c, u + "/generate", {"text": "x"})     # max_new_tokens defaults to 128
        assert body["meta_info"]["completion_tokens"] == 128
        status, batch = await post(c, u + "/generate", {"input_ids": [[11, 12, 13], list(range(20, 40))],
                                                        "rid": ["b-0", "b-1"],
                                                        "sampling_params": {"max_new_tokens": 4}})
        assert status == 200 and isinstance(batch, list) and [b["meta_info"]["id"] for b in batch] == ["b-0", "b-1"]
        assert [b["meta_info"]["prompt_tokens"] for b in batch] == [3, 20]
        _, recs = await get(c, u + "/sim/requests")
        by_rid = {r["rid"]: r for r in recs}
        assert by_rid["b-1"]["input_ids_head"] == list(range(20, 28)) and by_rid["b-1"]["prompt_tokens"] == 20
        events = await sse(c, u + "/generate", {"input_ids": [1, 2], "stream": True,
                                                "sampling_params": {"max_new_tokens": 300}})
        assert events[-1] == "[DONE]"
        counts = [e["meta_info"]["completion_tokens"] for e in events[:-1]]
        assert counts == sorted(counts) and counts[-1] == 300
        for e in events[:-1]:      # text and output_ids are cumulative
            assert len(e["text"].split()) == len(e["output_ids"]) == e["meta_info"]["completion_tokens"]
        assert all(e["meta_info"]["finish_reason"] is None for e in events[:-2])
        assert events[-2]["meta_info"]["finish_reason"] == {"type": "length", "length": 300}
        events = await sse(c, u + "/generate", {"text": ["a", "b"], "stream": True,
                                                "sampling_params": {"max_new_tokens": 5}})
        assert {e["index"] for e in events[:-1]} == {0, 1}
    run_sim(scenario, speedup=20, length_mean=5000, length_sigma=0.0, stream_interval_s=0.001)


def test_operational_routes():
    async def scenario(c, u):
        for path in ("/health", "/health_generate"):
            status, text = await get(c, u + path)
            assert status == 200 and text == ""
        _, models = await get(c, u + "/v1/models")
        assert models["object"] == "list" and models["data"][0]["owned_by"] == "sglang"
        assert models["data"][0]["id"] == "m-1" and models["data"][0]["max_model_len"] == 4096
        for path in ("/model_info", "/get_model_info"):
            _, info = await get(c, u + path)
            assert info["is_generation"] is True and info["model_path"] == "m-1"
        for path in ("/server_info", "/get_server_info"):
            _, info = await get(c, u + path)
            assert info["max_running_requests"] == 8 and info["context_length"] == 4096 and "version" in info
        await post(c, u + "/generate", {"text": "abcdefgh", "sampling_params": {"max_new_tokens": 5}})
        status, text = await get(c, u + "/metrics")
        assert status == 200
        values = {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                  if line.startswith("sglang:") and "_bucket" not in line}
        assert values["sglang:num_running_reqs"] == 0 and values["sglang:num_queue_reqs"] == 0
        assert values["sglang:prompt_tokens_total"] == 2 and values["sglang:generation_tokens_total"] == 5
        assert values["sglang:sim_aborted_tokens_total"] == 0 and values["sglang:e2e_request_latency_seconds_count"]
        assert '# TYPE sglang:generation_tokens_total counter' in text and 'model_name="m-1"' in text
    run_sim(scenario, speedup=1000, model="m-1", context_length=4096, max_running_requests=8)


def test_api_key_guards_every_route_but_health_and_metrics():
    async def scenario(c, u):
        for path in ("/v1/models", "/model_info", "/server_info"):
            assert await get(c, u + path) == (401, {"error": "Unauthorized"})
        assert await post(c, u + CHAT, {"messages": MSGS}) == (401, {"error": "Unauthorized"})
        assert (await post(c, u + "/generate", {"text": "x"}, headers={"Authorization": "Bearer nope"}))[0] == 401
        ok = {"Authorization": "Bearer k3y"}
        assert (await post(c, u + CHAT, {"messages": MSGS, "max_tokens": 2}, headers=ok))[0] == 200
        assert (await get(c, u + "/v1/models", headers=ok))[0] == 200
        for path in ("/health", "/health_generate", "/metrics", "/sim/stats"):
            assert (await get(c, u + path))[0] == 200
    run_sim(scenario, speedup=1000, length_mean=10, api_key="k3y")


def test_validation_errors_are_400_with_sglang_bodies():
    async def scenario(c, u):
        async with c.post(u + CHAT, data=json.dumps({"messages": MSGS}),
                          headers={"Content-Type": "text/plain"}) as r:
            body = await r.json(content_type=None)
        assert r.status == 400 and body["object"] == "error" and "application/json" in body["message"]
        assert set(body) == {"object", "message", "type", "param", "code"} and body["param"] is None
        status, body = await post(c, u + CHAT, {"messages": MSGS, "max_tokens": "lots"})
        assert status == 400 and body["code"] == 400 and "max_tokens" in body["message"]
        assert body["type"] == "Bad Request"             # a request-model parse error (RequestValidationError)
        status, body = await post(c, u + "/v1/completions", {"prompt": 5})
        assert status == 400 and body["object"] == "error"
        status, body = await post(c, u + "/generate", {"sampling_params": {}})
        assert status == 400 and "text" in body["error"]["message"]
        status, body = await post(c, u + "/generate", {"text": "x", "sampling_params": {"max_new_tokens": -1}})
        assert status == 400 and "max_new_tokens" in body["error"]["message"]
    run_sim(scenario, speedup=1000, length_mean=10)


def test_context_length_errors_use_sglang_messages():
    async def scenario(c, u):
        long_text = "x" * 4 * 150        # ~150 tokens by the chars/4 estimate
        status, body = await post(c, u + CHAT, {"messages": [{"role": "user", "content": long_text}]})
        assert status == 400 and body["type"] == "BadRequestError"
        assert body["message"] == "The input (150 tokens) is longer than the model's context length (100 tokens)."
        status, body = await post(c, u + "/generate", {"input_ids": list(range(60)),
                                                       "sampling_params": {"max_new_tokens": 50}})
        assert status == 400 and body["error"]["message"].startswith(
            "Requested token count exceeds the model's maximum context length of 100 tokens. "
            "You requested a total of 110 tokens: 60 tokens from the input messages and 50 tokens")
        status, body = await post(c, u + CHAT, {"messages": MSGS})   # no max_tokens: runs to the context limit
        assert status == 200 and body["choices"][0]["finish_reason"] == "length"
        assert body["usage"]["total_tokens"] == 100
        _, stats = await get(c, u + "/sim/stats")
        assert stats["errors"]["context_length"] == 2
    run_sim(scenario, speedup=1000, length_mean=1000, length_sigma=0.0, context_length=100)


# --- the engine -------------------------------------------------------------------------------------


def test_lengths_are_a_function_of_seed_and_rid():
    a, b = LengthModel(7, 1500, 0.8), LengthModel(7, 1500, 0.8)
    rids = [f"D-{i}" for i in range(50)]
    assert [a.draw(r) for r in rids] == [b.draw(r) for r in reversed(rids)][::-1]   # order does not matter
    assert [a.draw(r) for r in rids] != [LengthModel(8, 1500, 0.8).draw(r) for r in rids]
    per_prefix = LengthModel(7, 1500, 0.8, {"A1-": 100, "A1-long-": 10_000})
    small = [per_prefix.draw(f"A1-{i}") for i in range(400)]
    big = [per_prefix.draw(f"A1-long-{i}") for i in range(400)]
    assert 70 < sum(small) / 400 < 130 and 7_000 < sum(big) / 400 < 13_000   # lognormal, mean kept
    assert LengthModel(1, 50, 0.0).draw("x") == 50


def test_same_rid_gets_the_same_length_over_http_whatever_the_order():
    rids = [f"P-{i}" for i in range(12)]

    async def lengths(c, u, order):
        out = {}
        for rid in order:
            _, body = await post(c, u + CHAT, {"messages": MSGS, "max_tokens": 10_000, "rid": rid})
            out[rid] = body["usage"]["completion_tokens"]
        return out

    async def scenario(c, u):
        return await lengths(c, u, rids), await lengths(c, u, rids[::-1])

    first, again = run_sim(scenario, speedup=1000, length_mean=300, seed=5)
    assert first == again and len(set(first.values())) > 6
    other, _ = run_sim(scenario, speedup=1000, length_mean=300, seed=6)
    assert other != first


def test_capacity_saturates_and_the_rest_queue_fifo():
    async def scenario(c, u):
        reqs = [asyncio.create_task(post(c, u + "/generate", {"text": "x", "rid": f"q{i}",
                                                               "sampling_params": {"max_new_tokens": 50}}))
                for i in range(10)]
        stats = await until(c, u, lambda s: s["queued"] == 6)
        assert stats["running"] == 4
        _, text = await get(c, u + "/metrics")
        assert 'sglang:num_running_reqs{model_name="sim-model"} 4.0' in text
        assert 'sglang:num_queue_reqs{model_name="sim-model"} 6.0' in text
        await asyncio.gather(*reqs)
        _, recs = await get(c, u + "/sim/requests")
        by_arrival = [r["rid"] for r in sorted(recs, key=lambda r: r["arrived"])]
        assert [r["rid"] for r in sorted(recs, key=lambda r: r["admitted"])] == by_arrival   # FIFO
        stats = await until(c, u, lambda s: s["running"] == 0)
        assert stats["peak_running"] == 4 and stats["peak_queued"] == 6 and stats["completed"] == 10
        assert stats["generated_tokens"] == 500 and stats["aborted_tokens"] == 0
    # Four decoding at 20 * 10 / 4 = 50 tok/s each hold their slots for a wall second: long
    # enough to see the queue, short enough for a quick test.
    run_sim(scenario, speedup=10, peak_tok_s=20, half_batch=0, length_mean=1000, length_sigma=0.0,
            max_running_requests=4)


def test_rate_per_request_falls_as_the_batch_grows_while_throughput_saturates():
    from budgetq.simulator.model import Engine

    e = Engine(SimSettings(peak_tok_s=1000, half_batch=10))
    per_req = [e.rate_per_request(b) for b in (1, 10, 100, 1000)]
    total = [b * e.rate_per_request(b) for b in (1, 10, 100, 1000)]
    assert per_req == sorted(per_req, reverse=True)
    assert total == sorted(total) and total[-1] < 1000 and total[-1] > 0.98 * 1000


def test_client_disconnect_aborts_and_counts_aborted_tokens():
    async def scenario(c, u):
        task = asyncio.create_task(post(c, u + CHAT, {"messages": MSGS, "max_tokens": 10**6, "rid": "long-1"}))
        await until(c, u, lambda s: s["generated_tokens"] > 20)
        task.cancel()
        stats = await until(c, u, lambda s: s["aborted"] == 1)
        assert stats["running"] == 0 and stats["aborted_tokens"] == stats["generated_tokens"] > 20
        await asyncio.sleep(0.2)
        _, later = await get(c, u + "/sim/stats")
        assert later["generated_tokens"] == stats["generated_tokens"]      # it stopped generating
        _, recs = await get(c, u + "/sim/requests")
        assert recs[0]["rid"] == "long-1" and recs[0]["finish"] == "abort"
        assert recs[0]["completion_tokens"] == stats["aborted_tokens"]
        # the same through a stream the client walks away from
        async with c.post(u + CHAT, json={"messages": MSGS, "max_tokens": 10**6, "stream": True}) as r:
            await r.content.readline()
        stats = await until(c, u, lambda s: s["aborted"] == 2)
        assert stats["running"] == 0
    run_sim(scenario, length_mean=10**6, length_sigma=0.0, context_length=10**7, stream_interval_s=0.01,
            disconnect_poll_s=0, stream_abort_s=0)


def test_abort_request_route_ends_requests_with_finish_abort():
    async def scenario(c, u):
        long = {"sampling_params": {"max_new_tokens": 10**6}}
        one = asyncio.create_task(post(c, u + "/generate", {"text": "x", "rid": "job-1", **long}))
        queued = asyncio.create_task(post(c, u + "/generate", {"text": "x", "rid": "job-2", **long}))
        chat = asyncio.create_task(post(c, u + CHAT, {"messages": MSGS, "rid": "chat-1", "max_tokens": 10**6}))
        await until(c, u, lambda s: s["running"] == 1 and s["queued"] == 2)
        assert (await post(c, u + "/abort_request", {"rid": "job-1"}))[0] == 200
        status, body = await one
        # schedule_batch.FINISH_ABORT().to_json()
        assert status == 200 and body["meta_info"]["finish_reason"] == {"type": "abort", "message": "Aborted",
                                                                        "status_code": None, "err_type": None}
        await until(c, u, lambda s: s["running"] == 1)
        assert (await post(c, u + "/abort_request", {"abort_all": True}))[0] == 200
        _, body = await queued
        assert body["meta_info"]["finish_reason"]["type"] == "abort"
        _, body = await chat
        assert body["choices"][0]["finish_reason"] == "abort"
        stats = await until(c, u, lambda s: s["aborted"] == 3)
        assert stats["running"] == stats["queued"] == 0
    run_sim(scenario, length_mean=10**6, length_sigma=0.0, context_length=10**7, max_running_requests=1)


def test_instant_mode_answers_at_once_with_drawn_lengths():
    async def scenario(c, u):
        bodies = await asyncio.gather(*[post(c, u + "/generate", {"text": "x", "rid": f"i{i}",
                                                                   "sampling_params": {"max_new_tokens": 10**4}})
                                        for i in range(20)])
        got = {b["meta_info"]["id"]: b["meta_info"]["completion_tokens"] for _, b in bodies}
        model = LengthModel(3, 40, 0.5)
        assert got == {f"i{i}": model.draw(f"i{i}") for i in range(20)}
        _, stats = await get(c, u + "/sim/stats")
        assert stats["completed"] == 20 and stats["generated_tokens"] == sum(got.values())
    run_sim(scenario, instant=True, length_mean=40, length_sigma=0.5, seed=3)


# --- faults -----------------------------------------------------------------------------------------


def test_injected_errors_use_each_configured_status():
    codes = [503, 500, 429, 502]

    async def scenario(c, u):
        seen = set()
        for _ in range(60):
            status, body = await post(c, u + CHAT, {"messages": MSGS})
            assert body["object"] == "error" and body["code"] == status and body["param"] is None
            seen.add(status)
        status, body = await post(c, u + "/generate", {"text": "x"})
        assert status in codes and "message" in body["error"]
        _, stats = await get(c, u + "/sim/stats")
        return seen, stats

    seen, stats = run_sim(scenario, error_rate=1.0, error_codes=codes)
    assert seen == set(codes) and sum(stats["errors"][str(c)] for c in codes) == 61 and stats["requests"] == 0


def test_dropped_connections_close_without_a_response():
    async def scenario(c, u):
        for body in ({"text": "x"}, {"text": "x", "stream": True}):
            with pytest.raises((aiohttp.ServerDisconnectedError, aiohttp.ClientPayloadError, aiohttp.ClientOSError)):
                async with c.post(u + "/generate", json={**body, "sampling_params": {"max_new_tokens": 500}}) as r:
                    await r.read()
        with pytest.raises((aiohttp.ServerDisconnectedError, aiohttp.ClientPayloadError, aiohttp.ClientOSError)):
            async with c.post(u + CHAT, json={"messages": MSGS, "max_tokens": 500}) as r:
                await r.read()
        stats = await until(c, u, lambda s: s["dropped"] == 3)
        assert stats["drops"] == 3 and stats["completed"] == 0
        assert stats["aborted_tokens"] == stats["dropped_tokens"] == stats["generated_tokens"]
        _, recs = await get(c, u + "/sim/requests")
        assert [r["finish"] for r in recs] == ["drop"] * 3
    run_sim(scenario, speedup=200, length_mean=400, drop_rate=1.0, stream_interval_s=0.001)


def test_down_switch_and_live_fault_changes():
    async def scenario(c, u):
        assert (await get(c, u + "/health"))[0] == 200
        status, faults = await post(c, u + "/sim/faults", {"down": True})
        assert status == 200 and faults["down"] is True
        assert (await get(c, u + "/health"))[0] == 503
        assert (await get(c, u + "/v1/models"))[0] == 503
        status, body = await post(c, u + CHAT, {"messages": MSGS})
        assert status == 503 and body["object"] == "error"
        await post(c, u + "/sim/faults", {"down": False, "error_rate": 1.0, "error_codes": [429]})
        assert (await get(c, u + "/health"))[0] == 200
        assert (await post(c, u + CHAT, {"messages": MSGS}))[0] == 429
        status, body = await post(c, u + "/sim/faults", {"error_rate": 2})
        assert status == 400 and "error_rate" in body["error"]["message"]
        assert (await post(c, u + "/sim/faults", {"no_such_fault": 1}))[0] == 400
        _, faults = await get(c, u + "/sim/faults")
        assert faults["error_rate"] == 1.0 and faults["error_codes"] == [429] and faults["down"] is False
        await post(c, u + "/sim/faults", {"error_rate": 0, "context_length": 50, "spike_rate": 1, "spike_s": 0.01})
        status, body = await post(c, u + CHAT, {"messages": MSGS, "max_tokens": 60})
        assert status == 400 and "maximum context length of 50 tokens" in body["message"]
        assert (await post(c, u + CHAT, {"messages": MSGS, "max_tokens": 5}))[0] == 200
        _, stats = await get(c, u + "/sim/stats")
        assert stats["errors"]["down"] == 3 and stats["errors"]["429"] == 1 and stats["errors"]["spike"] == 1
        await post(c, u + "/sim/reset", {})
        _, stats = await get(c, u + "/sim/stats")
        assert stats["requests"] == 0 and stats["errors"] == {} and (await get(c, u + "/sim/requests"))[1] == []
    run_sim(scenario, speedup=1000, length_mean=10)


def test_queue_overflow_answers_503():
    async def scenario(c, u):
        long = {"text": "x", "sampling_params": {"max_new_tokens": 10**6}}
        tasks = [asyncio.create_task(post(c, u + "/generate", long)) for _ in range(3)]
        await until(c, u, lambda s: s["queued"] == 2)
        status, body = await post(c, u + CHAT, {"messages": MSGS})
        # An HTTPException(503) in SGLang: the flat ErrorResponse with type str(status), on both APIs.
        assert status == 503 and body == {"object": "error", "message": "The request queue is full.", "type": "503",
                                          "param": None, "code": 503}
        status, body = await post(c, u + "/generate", long)
        assert status == 503 and body["type"] == "503" and body["message"] == "The request queue is full."
        await post(c, u + "/abort_request", {"abort_all": True})
        await asyncio.gather(*tasks)
    run_sim(scenario, length_mean=10**6, length_sigma=0.0, context_length=10**7, max_running_requests=1,
            max_queued_requests=2)


# --- the command line -------------------------------------------------------------------------------


def _http(url: str, body: dict | None = None, headers: dict | None = None) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"null")


def test_cli_flags_reach_the_server(sim_factory):
    sim = sim_factory("--speedup", "1000", "--length-mean", "80", "--length-sigma", "0", "--api-key", "s3",
                      "--reasoning-tokens-frac", "0.5", "--reasoning-parser", "qwen3", "--context-length", "4000",
                      "--error-codes", "500,502", "--max-running-requests", "7", "--half-batch", "4",
                      "--model", "sim-x", "--length-mean-for", "Z-=20")
    auth = {"Authorization": "Bearer s3"}
    assert _http(sim + "/v1/models")[0] == 401
    status, body = _http(sim + CHAT, {"messages": MSGS, "rid": "Z-1"}, auth)
    assert status == 200 and body["usage"]["completion_tokens"] == 20 and body["usage"]["reasoning_tokens"] == 10
    assert body["choices"][0]["message"]["reasoning_content"] and body["model"] == "sim-x"
    _, info = _http(sim + "/server_info", headers=auth)
    assert info["max_running_requests"] == 7 and info["context_length"] == 4000
    assert info["simulator"]["half_batch"] == 4
    _, faults = _http(sim + "/sim/faults")
    assert faults["error_codes"] == [500, 502]


def test_cli_rejects_bad_flags_naming_them():
    for flags, named in ((["--error-codes", "503,oops"], "oops"), (["--drop-rate", "1.5"], "--drop-rate"),
                         (["--length-mean-for", "A1"], "A1")):
        out = subprocess.run([sys.executable, "-m", "budgetq.cli", "sim", "--port", "1", *flags],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 2 and named in out.stderr


def test_cli_fidelity_flags_reach_the_server(sim_factory, tmp_path):
    gen = tmp_path / "generation_config.json"
    gen.write_text(json.dumps({"temperature": 0.6, "top_k": 20, "eos_token_id": 2}))
    sim = sim_factory("--speedup", "1000", "--length-mean", "10", "--disconnect-poll-s", "0", "--stream-abort-s",
                      "0.5", "--max-total-num-tokens", "9999", "--generation-config", str(gen))
    _, info = _http(sim + "/server_info")
    assert info["simulator"]["disconnect_poll_s"] == 0 and info["simulator"]["stream_abort_s"] == 0.5
    assert info["max_total_num_tokens"] == 9999
    assert _http(sim + CHAT, {"messages": MSGS, "rid": "g1", "max_tokens": 3})[0] == 200
    _, recs = _http(sim + "/sim/requests")
    assert recs[-1]["sampling"]["temperature"] == 0.6 and recs[-1]["sampling"]["top_k"] == 20


def test_cli_rejects_bad_fidelity_flags_naming_them(tmp_path):
    bad = tmp_path / "g.json"
    bad.write_text('{"top_p": "high"}')
    for flags, named in ((["--disconnect-poll-s", "-1"], "--disconnect-poll-s"),
                         (["--generation-config", str(tmp_path / "missing.json")], "missing.json"),
                         (["--generation-config", str(bad)], "top_p")):
        out = subprocess.run([sys.executable, "-m", "budgetq.cli", "sim", "--port", "1", *flags],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 2 and named in out.stderr, out.stderr
