"""The simulator's answers and budgetq's requests, checked against SGLang's own code (the wheel).

tests/sglang_contract.py loads SGLang's protocol models from the installed wheel (version in
tests/SGLANG_VERSION). A simulator response must survive SGLang's model round trip unchanged
(same keys, same values); every body worker.sglang_wire.build_request makes must pass
SGLang's request models and SamplingParams.verify(). The body is validated as built, whatever
keys it has today.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import warnings
from collections.abc import AsyncIterator

import pytest

from budgetq.shared.config import ServerConfig
from budgetq.shared.schema import JobPayload, Message, SamplingParams
from budgetq.shared.sglang_names import CHAT_REQUEST_KEYS, GENERATE_CONTRACT_SAMPLING_KEYS, GENERATE_SAMPLING_KEYS
from budgetq.simulator import sampling as sim_sampling
from budgetq.worker.sglang_wire import build_request
from tests import sglang_contract as sc
from tests.test_simulator import CHAT, MSGS, post, run_sim, sse, until

# --- name sets ------------------------------------------------------------------------------------


def test_the_installed_wheel_is_the_pinned_version():
    assert sc.SGL.version == sc.WANTED_VERSION


def test_shared_sglang_names_match_the_wheel():
    assert GENERATE_SAMPLING_KEYS == sc.SAMPLING_PARAMS_INIT_KEYS
    assert CHAT_REQUEST_KEYS == sc.CHAT_REQUEST_FIELDS
    assert GENERATE_CONTRACT_SAMPLING_KEYS == frozenset(sc.CONTRACT_SAMPLING_FIELDS)


def test_the_simulators_contract_gate_matches_sglangs():
    assert sim_sampling.CONTRACT_FIELDS == sc.CONTRACT_SAMPLING_FIELDS
    for params in ({"max_tokens": 5}, {"top_p": "x"}, {"top_k": 1.5}, {"ignore_eos": 1}, {"regex": 3}):
        with pytest.raises(sc.SGL.api_types.JsonContractError) as real:
            sc.SGL.api_types.GenerateRequest.from_json_value({"text": "x", "sampling_params": params})
        with pytest.raises(sim_sampling.SamplingError) as sim:
            sim_sampling.check_contract(params)
        assert str(sim.value) == str(real.value), params


@pytest.mark.parametrize("params", [
    {"top_p": 0}, {"top_k": 0}, {"temperature": -1}, {"min_p": 2}, {"repetition_penalty": 0},
    {"repetition_penalty": 2.5}, {"frequency_penalty": -3}, {"presence_penalty": 2.1}, {"min_new_tokens": -1},
    {"max_new_tokens": -1}, {"min_new_tokens": 5, "max_new_tokens": 2}, {"beam_width": 0},
    {"regex": "a", "ebnf": "b"}, {"temperature": float("inf")}, {"sampling_seed": 2**64},
    {"temperature": 0, "top_k": 0}, {"top_k": -1}, {"temperature": 0.7, "top_p": 0.9, "top_k": 20, "min_p": 0.05},
    {"top_p": None, "top_k": None, "temperature": None},
])
def test_the_simulators_verify_matches_sglangs(params):
    try:
        sc.sampling_params(params)
        real = None
    except ValueError as exc:
        real = str(exc)
    try:
        sim_sampling.verify(params)
        sim = None
    except sim_sampling.SamplingError as exc:
        sim = str(exc)
    assert sim == real


# --- simulator responses -> SGLang's response models ----------------------------------------------


def _events(events: list) -> list[dict]:
    assert events[-1] == "[DONE]"
    return events[:-1]


def test_chat_and_completions_responses_round_trip_exactly():
    async def scenario(c, u):
        out = []
        for body in ({"messages": MSGS, "max_tokens": 8}, {"messages": MSGS, "max_completion_tokens": 10**4},
                     {"messages": MSGS, "max_tokens": 8, "separate_reasoning": False}):
            status, resp = await post(c, u + CHAT, body)
            assert status == 200
            out.append(("ChatCompletionResponse", resp))
        status, resp = await post(c, u + "/v1/completions", {"prompt": ["a", "b"], "max_tokens": 5})
        out.append(("CompletionResponse", resp))
        for ev in _events(await sse(c, u + CHAT, {"messages": MSGS, "max_tokens": 30, "stream": True,
                                                   "stream_options": {"include_usage": True}})):
            out.append(("ChatCompletionStreamResponse", ev))
        for ev in _events(await sse(c, u + "/v1/completions", {"prompt": "a", "max_tokens": 30, "stream": True,
                                                               "stream_options": {"include_usage": True}})):
            out.append(("CompletionStreamResponse", ev))
        return out

    checked = run_sim(scenario, speedup=1000, length_mean=20, reasoning_tokens_frac=0.3, reasoning_parser="qwen3",
                      stream_interval_s=0.001)
    assert {name for name, _ in checked} == {"ChatCompletionResponse", "CompletionResponse",
                                             "ChatCompletionStreamResponse", "CompletionStreamResponse"}
    for name, data in checked:
        assert sc.round_trip(name, data) == [], (name, json.dumps(data))


def test_aborted_chat_round_trips_with_finish_reason_abort():
    async def scenario(c, u):
        task = asyncio.create_task(post(c, u + CHAT, {"messages": MSGS, "rid": "ab", "max_tokens": 10**6}))
        await until(c, u, lambda s: s["running"] == 1)
        await post(c, u + "/abort_request", {"rid": "ab"})
        return (await task)[1]

    resp = run_sim(scenario, length_mean=10**6, length_sigma=0.0, context_length=10**7)
    assert resp["choices"][0]["finish_reason"] == "abort"
    assert sc.round_trip("ChatCompletionResponse", resp) == []


def test_error_bodies_are_sglangs_error_response():
    async def scenario(c, u):
        bodies = [
            (await post(c, u + CHAT, {"messages": MSGS, "max_tokens": 10**6}))[1],             # context
            (await post(c, u + CHAT, {"messages": MSGS, "max_tokens": 5, "top_p": 0}))[1],     # verify()
            (await post(c, u + "/v1/completions", {"prompt": "x" * 400, "max_tokens": 1}))[1],  # input too long
        ]
        return bodies

    for body in run_sim(scenario, speedup=1000, length_mean=5, context_length=100):
        assert sc.round_trip("ErrorResponse", body) == [] and body["code"] == 400


def test_generate_responses_decode_with_sglangs_api_types():
    async def scenario(c, u):
        out = [(await post(c, u + "/generate", {"text": "x", "sampling_params": {"max_new_tokens": 6}}))[1]]
        batch = {"input_ids": [[1, 2], [3]], "sampling_params": {"max_new_tokens": 4}}
        out += (await post(c, u + "/generate", batch))[1]
        out += _events(await sse(c, u + "/generate", {"text": "x", "stream": True,
                                                      "sampling_params": {"max_new_tokens": 20}}))
        return out

    for resp in run_sim(scenario, speedup=1000, length_mean=10, stream_interval_s=0.001):
        decoded = sc.SGL.api_types.GenerateResponse.from_json_value(resp)
        assert decoded.meta_info.id == resp["meta_info"]["id"]
        assert decoded.meta_info.completion_tokens == resp["meta_info"]["completion_tokens"]
        assert decoded.meta_info.weight_version == "default"


@pytest.mark.parametrize("incremental", [False, True])
def test_streamed_generate_chunks_decode_with_sglangs_api_types(incremental):
    """Every chunk of a streamed /generate, cumulative (SGLang's default) or incremental, with a server
    and a per-request stream interval, decodes as SGLang's GenerateResponse; the worker reads them the same."""
    async def scenario(c, u):
        out = _events(await sse(c, u + "/generate", {"text": "x", "stream": True,
                                                     "sampling_params": {"max_new_tokens": 40}}))
        out += _events(await sse(c, u + "/generate", {"input_ids": [1, 2], "stream": True,
                                                      "sampling_params": {"max_new_tokens": 30, "stream_interval": 4}}))
        return out

    chunks = run_sim(scenario, speedup=1, length_mean=10**6, length_sigma=0.0, stream_interval_s=0.001,
                     stream_interval=3, incremental_streaming_output=incremental, reasoning_tokens_frac=0.3)
    assert len(chunks) > 4
    for resp in chunks:
        decoded = sc.SGL.api_types.GenerateResponse.from_json_value(resp)
        assert decoded.meta_info.completion_tokens == resp["meta_info"]["completion_tokens"]
        assert decoded.output_ids == resp["output_ids"] and decoded.text == resp["text"]


def test_streamed_chat_with_continuous_usage_round_trips_exactly():
    async def scenario(c, u):
        return _events(await sse(c, u + CHAT, {"messages": MSGS, "max_tokens": 30, "stream": True, "stream_options": {
            "include_usage": True, "continuous_usage_stats": True}}))

    events = run_sim(scenario, speedup=1, length_mean=10**6, length_sigma=0.0, stream_interval_s=0.001,
                     reasoning_tokens_frac=0.3, reasoning_parser="qwen3")
    # The usage so far on every delta; none on the role and finish chunks; the final usage chunk last.
    assert events[-1]["choices"] == [] and all(e["usage"] is not None for e in events[1:-2])
    assert events[0]["usage"] is None and events[-2]["usage"] is None
    for ev in events:
        assert sc.round_trip("ChatCompletionStreamResponse", ev) == [], json.dumps(ev)


# --- budgetq's request bodies -> SGLang's request models ------------------------------------------

SAMPLINGS = [
    SamplingParams(),
    SamplingParams(max_tokens=64, temperature=0.0),
    SamplingParams(max_tokens=128, temperature=0.6, top_p=0.95, top_k=20, min_p=0.0),
    SamplingParams(temperature=1.0, top_p=0.8, top_k=-1, min_p=0.1, stop=["</s>", "\n\nUser:"], seed=1234),
    SamplingParams(extra={"repetition_penalty": 1.05}),
    SamplingParams(extra={"presence_penalty": 0.5, "frequency_penalty": 0.1}),
]


def _payload(sp: SamplingParams, with_ids: bool) -> JobPayload:
    return JobPayload(id="p1", dataset="A1", messages=[Message(role="user", content="hello")],
                      input_ids=[1, 2, 3] if with_ids else None, sampling=sp,
                      chat_template_kwargs={"enable_thinking": False})


@pytest.mark.parametrize(("api", "sp", "with_ids", "stream"), [
    (api, sp, ids, stream) for api, sp, ids, stream in itertools.product(("chat", "generate"), SAMPLINGS, (True, False),
                                                                         (False, True))])
def test_every_request_budgetq_builds_passes_sglangs_request_models(api, sp, with_ids, stream):
    server = ServerConfig(api=api, tokenizer="tok" if api == "generate" else None)
    # Streamed as the client sends to SGLang: the final usage chunk and the usage on every chunk.
    path, body = build_request(server, _payload(sp, with_ids), "A1-p1.0123456789ab", stream=stream,
                               continuous_usage=stream)
    body = json.loads(json.dumps(body))          # what goes over the wire
    if path == "/v1/chat/completions":
        req = sc.validate_chat_request(body)
        # Nothing budgetq sends is silently dropped by SGLang's chat model.
        assert set(body) <= sc.CHAT_REQUEST_FIELDS, set(body) - sc.CHAT_REQUEST_FIELDS
        assert req.rid == body["rid"] and req.stream is stream
        if stream:
            opts = req.stream_options.model_dump()
            assert opts["include_usage"] is True and opts["continuous_usage_stats"] is True
            assert set(body["stream_options"]) <= set(opts)   # neither option dropped by SGLang's model
    else:
        assert path == "/generate"
        sc.validate_generate_request(body)
        assert sc.SGL.api_types.GenerateRequest.from_json_value(body).stream is stream


@pytest.mark.parametrize("params", [{"top_p": 0}, {"top_k": 0}, {"temperature": -1}, {"repetition_penalty": 3},
                                    {"min_p": 0.5, "top_k": 5}])
def test_the_simulators_chat_route_refuses_what_sglangs_chat_refuses(params):
    body = {"messages": MSGS, "max_completion_tokens": 5, **params}
    try:
        sc.validate_chat_request(body)
        real = None
    except ValueError as exc:
        real = str(exc)

    async def scenario(c, u):
        return await post(c, u + CHAT, body)

    status, resp = run_sim(scenario, speedup=1000, length_mean=5)
    assert (status, resp.get("message")) == ((200, None) if real is None else (400, real))


# --- shapes the simulator mirrors: hidden-state gate, dp_rank, queue full -------------------------


@pytest.mark.parametrize("value", ["last", "all", 1, 0.5, {"a": 1}, [1], [True, "last"], [True, False], True, None])
def test_the_simulators_return_hidden_states_gate_is_sglangs(value):
    """/generate's JSON contract gate takes a boolean or a list of booleans only: "last" is refused."""
    from budgetq.simulator import hidden
    from budgetq.simulator.runner import BadRequest

    try:
        sc.SGL.api_types.GenerateRequest.from_json_value({"text": "x", "return_hidden_states": value})
        real = None
    except sc.SGL.api_types.JsonContractError as exc:
        real = str(exc)
    try:
        hidden.check_contract(value)
        sim = None
    except BadRequest as exc:
        assert exc.kind == "contract"  # answered as {"error": "<text>"} (http_server.generate_request)
        sim = exc.message
    assert sim == real


def _queue_full_sim(scenario):
    run_sim(scenario, length_mean=10**6, length_sigma=0.0, context_length=10**7, max_running_requests=1,
            max_queued_requests=1)


def test_generate_meta_info_has_sglangs_keys_dp_rank_included():
    async def scenario(c, u):
        status, body = await post(c, u + "/generate", {"text": "x", "sampling_params": {"max_new_tokens": 3}})
        assert status == 200
        keys = list(body["meta_info"])
        # tokenizer_manager._handle_batch_output: ..., cached_tokens, dp_rank (one DP rank: 0), e2e_latency, ...
        assert keys[:9] == ["id", "finish_reason", "prompt_tokens", "weight_version", "num_retractions",
                            "reasoning_tokens", "completion_tokens", "cached_tokens", "dp_rank"]
        assert body["meta_info"]["dp_rank"] == 0
    run_sim(scenario, speedup=1000, length_mean=10)


def _sglang_error_answer(message: str, err_type: str, code: int) -> tuple[int, str, bytes]:
    """(status, Content-Type, body) of an error answer as SGLang 0.5.23 writes it: its flat
    ErrorResponse in fastapi's ORJSONResponse (serving_base.py:205-221 ``create_error_response``;
    http_server.py:578-631, the HTTPException handler), built here with the same two classes."""
    from fastapi.exceptions import FastAPIDeprecationWarning
    from fastapi.responses import ORJSONResponse

    error = sc.SGL.protocol.ErrorResponse(object="error", message=message, type=err_type, param=None, code=code)
    with warnings.catch_warnings():  # a newer fastapi deprecates the class SGLang still answers with
        warnings.simplefilter("ignore", FastAPIDeprecationWarning)
        resp = ORJSONResponse(content=error.model_dump(), status_code=code)
    return resp.status_code, resp.headers["content-type"], bytes(resp.body)


def test_queue_full_answers_are_sglangs_to_the_byte_with_its_content_type():
    """SGLang 0.5.23, queue full: scheduler.py:3552-3587 ``_abort_on_queued_limit`` aborts the request
    with status 503 and "The request queue is full."; tokenizer_manager.py:1916-1921
    ``_handle_abort_finish_reason`` raises ``HTTPException(503, message)`` for a request not streamed;
    chat catches it in serving_base.py:119-122 (``create_error_response(..., err_type=str(status))``),
    /generate in http_server.py:578-631: on both the flat ErrorResponse, type "503" (Python >= 3.11, which
    the wheel requires: ``str(HTTPStatus.SERVICE_UNAVAILABLE) == "503"``), as compact orjson bytes with
    ``Content-Type: application/json``. A streamed chat is a StreamingResponse: ``text/event-stream;
    charset=utf-8`` (serving_chat.py:2435-2438)."""
    from http import HTTPStatus

    from fastapi.responses import StreamingResponse

    code = HTTPStatus.SERVICE_UNAVAILABLE
    want = _sglang_error_answer("The request queue is full.", str(code), code)
    assert want[1] == "application/json" and b", " not in want[2]

    async def answer() -> AsyncIterator[bytes]:
        yield b""
    sse_type = StreamingResponse(answer(), media_type="text/event-stream").headers["content-type"]

    async def raw(c, url, body):
        async with c.post(url, json=body) as r:
            return r.status, r.headers["Content-Type"], await r.read()

    async def scenario(c, u):
        long = {"text": "x", "sampling_params": {"max_new_tokens": 10**6}}
        tasks = [asyncio.create_task(post(c, u + "/generate", long)) for _ in range(2)]
        await until(c, u, lambda s: s["queued"] == 1)
        assert await raw(c, u + CHAT, {"messages": MSGS}) == want
        assert await raw(c, u + "/generate", long) == want
        status, ctype, _body = await raw(c, u + CHAT, {"messages": MSGS, "stream": True})
        assert (status, ctype) == (200, sse_type)
        await post(c, u + "/abort_request", {"abort_all": True})
        await asyncio.gather(*tasks)
    _queue_full_sim(scenario)


def test_queue_full_bodies_are_sglangs_on_both_apis_streamed_or_not():
    from http import HTTPStatus

    code = HTTPStatus.SERVICE_UNAVAILABLE
    message = "The request queue is full."  # scheduler._abort_on_queued_limit
    # Not streamed: HTTPException(503) -> the flat ErrorResponse with type str(status), on both routes
    # (serving_base.handle_request for chat, the app's HTTPException handler for /generate).
    flat = sc.SGL.protocol.ErrorResponse(object="error", message=message, type=str(code), code=code).model_dump()
    # Streamed chat: serving_chat writes create_streaming_error_response(message, code.name, code.value).
    chunk = json.dumps({"error": sc.SGL.protocol.ErrorResponse(object="error", message=message, type=code.name,
                                                               param=None, code=code.value).model_dump()})

    async def scenario(c, u):
        long = {"text": "x", "sampling_params": {"max_new_tokens": 10**6}}
        tasks = [asyncio.create_task(post(c, u + "/generate", long)) for _ in range(2)]
        await until(c, u, lambda s: s["queued"] == 1)
        assert await post(c, u + CHAT, {"messages": MSGS}) == (503, flat)
        assert await post(c, u + "/generate", long) == (503, flat)
        async with c.post(u + CHAT, json={"messages": MSGS, "stream": True}) as r:
            assert r.status == 200 and await r.text() == f"data: {chunk}\n\ndata: [DONE]\n\n"
        events = await sse(c, u + "/generate", {**long, "stream": True, "rid": "q1"})
        assert events[-1] == "[DONE]" and len(events) == 2
        meta = events[0]["meta_info"]
        assert events[0]["text"] == "" and events[0]["output_ids"] == []
        assert meta["id"] == "q1" and meta["finish_reason"] == {"type": "abort", "status_code": 503,
                                                                 "message": message}
        assert list(meta) == ["id", "finish_reason", "weight_version", "e2e_latency", "completion_tokens",
                              "response_sent_to_client_ts"]  # tokenizer_manager._handle_abort_req + sent time
        await post(c, u + "/abort_request", {"abort_all": True})
        await asyncio.gather(*tasks)
    _queue_full_sim(scenario)
