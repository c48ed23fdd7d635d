"""The client keeps SGLang's rules: fresh rid per attempt, prefix-free rids, duplicate-rid 400
retried, aborted responses never kept, /abort_request on cancel, one sampling on both APIs.

The server here is a small in-process aiohttp app that applies the rules of SGLang 0.5.23
that matter to the client (managers/tokenizer_manager.py: a second request with an rid still
held is a 400 "Duplicate request ID detected"; a dropped request's rid is held until the
server notices). budgetq sim mirrors the same rules for the integration tests.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Awaitable, Callable

import aiohttp
import pytest
from aiohttp import web

from budgetq.shared import keys
from budgetq.shared.config import ServerConfig
from budgetq.shared.config_load import load_config
from budgetq.shared.errors import FatalRequestError, RetryableRequestError
from budgetq.shared.sampling import NEUTRAL, generation_defaults, resolve, resolve_datasets
from budgetq.shared.schema import JobPayload, Message, SamplingParams
from budgetq.simulator.local import free_port
from budgetq.worker.sglang_client import SGLangClient
from budgetq.worker.sglang_wire import attempt_rid, build_request, job_id_of_rid

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
_DUP = "Duplicate request ID detected: {}"


def _payload(**sampling) -> JobPayload:
    return JobPayload(id="c1", dataset="C", messages=[Message(role="user", content="hi")],
                      input_ids=[1, 2, 3], sampling=SamplingParams(max_tokens=20, **sampling))


def _native(finish: dict, n: int = 5) -> dict:
    return {"text": "x " * n, "output_ids": list(range(n)),
            "meta_info": {"id": "r", "finish_reason": finish, "prompt_tokens": 3, "completion_tokens": n}}


def _chat(finish: str, n: int = 5) -> dict:
    return {"id": "r", "object": "chat.completion", "choices": [
        {"index": 0, "message": {"role": "assistant", "content": "x " * n}, "finish_reason": finish}],
        "usage": {"prompt_tokens": 3, "completion_tokens": n, "total_tokens": 3 + n}}


async def _sglang_info(_request: web.Request) -> web.Response:
    """SGLang's /server_info has internal_states: the client treats this mock as SGLang."""
    return web.json_response({"internal_states": []})


async def _ok(_request: web.Request) -> web.Response:
    return web.Response()


async def _with_server(routes: dict[str, Handler], body: Callable[[str, SGLangClient], Awaitable[None]],
                       api: str = "generate", **server) -> None:
    app = web.Application()
    app.add_routes([web.post(path, h) for path, h in routes.items()] +
                   [web.get("/health", _ok), web.get("/server_info", _sglang_info)])
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    url = f"http://127.0.0.1:{port}"
    cfg = ServerConfig(urls=[url], api=api, tokenizer="t", backoff_base_s=0.01, backoff_max_s=0.05,
                       max_attempts=4, **server)
    try:
        async with aiohttp.ClientSession() as session:
            client = SGLangClient(session, cfg)
            try:
                await body(url, client)
            finally:
                await client.close()
    finally:
        await runner.cleanup()


def test_rids_are_fresh_per_attempt_and_never_a_prefix_of_another():
    job_ids = ["C-c1", "C-c10", "C-c1-x", "C--c1", "A", "A-1", "A-1-x0"]
    rids = [attempt_rid(j) for j in job_ids for _ in range(50)]
    assert len(set(rids)) == len(rids)
    assert all(re.fullmatch(r"[A-Za-z0-9_-]+\.[0-9a-f]{12}", r) for r in rids)
    assert all(job_id_of_rid(r) in job_ids for r in rids)
    # SGLang aborts every rid that *starts with* the given one: none may start another.
    for a in rids:
        assert not any(b != a and b.startswith(a) for b in rids), a


def test_a_dropped_connection_is_retried_under_a_new_rid_while_the_server_still_holds_the_old():
    held: set[str] = set()
    seen: list[str] = []

    async def generate(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        rid = body["rid"]
        seen.append(rid)
        if rid in held:
            return web.json_response({"error": {"message": _DUP.format(rid)}}, status=400)
        if len(seen) == 1:  # drop the first connection; the server keeps the rid (its ~4 s poll)
            held.add(rid)
            assert request.transport is not None
            request.transport.close()
            await asyncio.sleep(1)
        return web.json_response(_native({"type": "stop", "matched": 2}))

    async def run(_url: str, client: SGLangClient) -> None:
        out = await client.complete(_payload(), "C-c1")
        assert out.finish_reason == "stop" and out.completion_tokens == 5

    asyncio.run(_with_server({"/generate": generate}, run))
    assert len(seen) == 2 and seen[0] != seen[1]
    assert all(job_id_of_rid(r) == "C-c1" for r in seen)


def test_a_duplicate_rid_400_is_retried_with_a_fresh_rid_not_failed():
    seen: list[str] = []

    async def chat(request: web.Request) -> web.StreamResponse:
        rid = (await request.json())["rid"]
        seen.append(rid)
        if len(seen) == 1:  # SGLang's OpenAI routes: the flat error body
            return web.json_response({"object": "error", "message": _DUP.format(rid), "type": "BadRequestError",
                                      "param": None, "code": 400}, status=400)
        return web.json_response(_chat("stop"))

    async def run(_url: str, client: SGLangClient) -> None:
        assert (await client.complete(_payload(), "C-c1")).finish_reason == "stop"

    asyncio.run(_with_server({"/v1/chat/completions": chat}, run, api="chat"))
    assert len(seen) == 2 and seen[0] != seen[1]


@pytest.mark.parametrize("api", ["generate", "chat"])
def test_an_aborted_response_is_retried_and_never_returned_as_a_result(api):
    calls: list[str] = []

    async def handler(request: web.Request) -> web.StreamResponse:
        calls.append((await request.json())["rid"])
        if len(calls) == 1:  # 200 with an aborted finish: what a prefix abort of another rid gives
            if api == "chat":
                return web.json_response(_chat("abort", n=2))
            return web.json_response(_native({"type": "abort", "message": "Abort request C-c1"}, n=2))
        return web.json_response(_chat("length", n=20) if api == "chat" else _native({"type": "length",
                                                                                      "length": 20}, n=20))

    async def run(_url: str, client: SGLangClient) -> None:
        out = await client.complete(_payload(), "C-c1")
        assert out.finish_reason == "length" and out.completion_tokens == 20

    path = "/v1/chat/completions" if api == "chat" else "/generate"
    asyncio.run(_with_server({path: handler}, run, api=api))
    assert len(calls) == 2


def test_an_abort_with_a_client_error_status_fails_with_the_servers_message():
    async def generate(_request: web.Request) -> web.StreamResponse:
        return web.json_response(_native({"type": "abort", "message": "prompt too long for this lora",
                                          "status_code": 400, "err_type": "BadRequestError"}, n=0))

    async def run(_url: str, client: SGLangClient) -> None:
        with pytest.raises(FatalRequestError, match="prompt too long for this lora"):
            await client.complete(_payload(), "C-c1")

    asyncio.run(_with_server({"/generate": generate}, run))


def test_aborts_every_attempt_gives_up_as_retryable():
    async def generate(_request: web.Request) -> web.StreamResponse:
        return web.json_response(_native({"type": "abort", "message": "server shutting down"}, n=1))

    async def run(_url: str, client: SGLangClient) -> None:
        with pytest.raises(RetryableRequestError, match="gave up after 4 attempts.*aborted"):
            await client.complete(_payload(), "C-c1")

    asyncio.run(_with_server({"/generate": generate}, run))


def test_cancelling_a_request_posts_abort_request_for_its_rid():
    started, released = asyncio.Event(), asyncio.Event()
    sent: list[str] = []
    aborted: list[str] = []

    async def generate(request: web.Request) -> web.StreamResponse:
        sent.append((await request.json())["rid"])
        started.set()
        await released.wait()  # "generating" until the client's abort arrives
        return web.json_response(_native({"type": "abort", "message": "aborted"}))

    async def abort(request: web.Request) -> web.StreamResponse:
        aborted.append((await request.json())["rid"])
        released.set()
        return web.Response()

    async def run(_url: str, client: SGLangClient) -> None:
        task = asyncio.create_task(client.complete(_payload(), "C-c1"))
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await client.close()  # waits for the pending abort
        assert client.aborts_sent == 1

    asyncio.run(_with_server({"/generate": generate, "/abort_request": abort}, run))
    assert aborted == sent and len(sent) == 1


def test_both_apis_send_the_same_explicit_sampling():
    payload = _payload(temperature=0.3, top_k=20, seed=7, stop=["</s>"])
    chat_path, chat = build_request(ServerConfig(api="chat"), payload, "C-c1.000000000000")
    gen_path, gen = build_request(ServerConfig(api="generate", tokenizer="t"), payload, "C-c1.000000000000")
    params = gen["sampling_params"]
    assert (chat_path, gen_path) == ("/v1/chat/completions", "/generate")
    for key in NEUTRAL:  # every field SGLang's chat route would fill from generation_config
        assert key in chat and chat[key] == params[key], key
    assert (chat["temperature"], chat["top_k"], chat["top_p"], chat["min_p"]) == (0.3, 20, 1.0, 0.0)
    assert chat["max_completion_tokens"] == params["max_new_tokens"] == 20 and "max_tokens" not in chat
    assert chat["seed"] == params["sampling_seed"] == 7 and chat["stop"] == params["stop"] == ["</s>"]


def test_the_sampling_line_at_info_is_short_and_says_where_each_value_came_from(tmp_path, caplog):
    """It was ~330 characters a dataset on every start (every field with SGLang's neutral value)."""
    from budgetq.shared.sampling import sampling_summary

    sp, origin = resolve(SamplingParams(temperature=0.2), {"top_p": 0.95}, "m/generation_config.json")
    assert sampling_summary(sp, origin) == ("temperature=0.2 (config); top_p=0.95 (m/generation_config.json); "
                                            "server defaults: top_k, min_p, repetition_penalty")
    sp, origin = resolve(SamplingParams(), {}, "")
    assert sampling_summary(sp, origin) == "the server's defaults (none set by the config or the model)"
    cfg_path = tmp_path / "c.yaml"
    cfg_path.write_text(json.dumps({"datasets": [{"name": "A", "path": "a.jsonl", "budget": "1M"}]}))
    cfg = load_config(cfg_path)
    with caplog.at_level("DEBUG", logger="budgetq.sampling"):
        resolve_datasets(cfg.datasets, None)
    (info,) = [r.getMessage() for r in caplog.records if r.levelname == "INFO"]
    (debug,) = [r.getMessage() for r in caplog.records if r.levelname == "DEBUG"]
    assert info == "dataset A: sampling: the server's defaults (none set by the config or the model)"
    assert len(debug) > 200 and "SGLang's is 1.0" in debug   # the long form, for whoever asks


def test_unset_sampling_comes_from_the_models_generation_config_in_both_modes(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.6, "top_k": 20, "top_p": 0.95, "do_sample": True, "eos_token_id": 2}))
    defaults, source = generation_defaults(str(tmp_path))
    assert defaults == {"temperature": 0.6, "top_k": 20, "top_p": 0.95} and source.endswith("generation_config.json")
    sp, origin = resolve(SamplingParams(temperature=0.2), defaults, source)
    # Neither the config nor the model sets min_p / repetition_penalty: they stay unset (the worker
    # sends SGLang its neutral value for them, another server nothing).
    assert (sp.temperature, sp.top_k, sp.top_p, sp.min_p, sp.repetition_penalty) == (0.2, 20, 0.95, None, None)
    assert origin["temperature"] == "config" and origin["min_p"].startswith("unset")
    cfg_path = tmp_path / "c.yaml"
    cfg_path.write_text(json.dumps({"server": {"tokenizer": str(tmp_path)},
                                    "datasets": [{"name": "A", "path": "a.jsonl", "budget": "1M"}]}))
    cfg = load_config(cfg_path)
    resolve_datasets(cfg.datasets, cfg.server.tokenizer)
    resolved = _payload(**{k: getattr(cfg.datasets[0].sampling, k) for k in NEUTRAL})
    bodies = [build_request(ServerConfig(api=api, tokenizer="t"), resolved, "r.000000000000")[1]
              for api in ("chat", "generate")]
    assert {k: bodies[0][k] for k in NEUTRAL} == {k: bodies[1]["sampling_params"][k] for k in NEUTRAL} == {
        "temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.0, "repetition_penalty": 1.0}
    # no generation_config.json, or none readable: SGLang's own defaults, never a failure
    assert generation_defaults(str(tmp_path / "missing")) == ({}, "")
    (tmp_path / "generation_config.json").write_text("{not json")
    assert generation_defaults(str(tmp_path)) == ({}, "")


@pytest.mark.parametrize(("api", "extra", "message"), [
    ("generate", {"min_tokens": 5}, "sampling.extra.min_tokens: SGLang 0.5.23 /generate sampling_params has no "
                                    "'min_tokens': use sampling.extra.min_new_tokens"),
    ("generate", {"separate_reasoning": True}, "has no 'separate_reasoning' and rejects every request (400)"),
    ("generate", {"max_completion_tokens": 5}, "use sampling.max_tokens"),
    ("generate", {"repetiton_penalty": 1.1}, "(did you mean sampling.repetition_penalty?)"),
    ("chat", {"min_new_tokens": 5}, "use sampling.extra.min_tokens"),
    ("chat", {"sampling_seed": 5}, "use sampling.seed"),
    ("chat", {"max_tokens": 5}, "budgetq sets 'max_tokens' itself on server.api 'chat': use sampling.max_tokens"),
    ("chat", {"frequency_penalty_x": 1}, "ignores it silently (did you mean sampling.extra.frequency_penalty?)"),
    ("chat", {"n": 2}, "n must stay 1"),
])
def test_sampling_extra_is_checked_against_the_apis_names(tmp_path, api, extra, message):
    from budgetq.shared.errors import ConfigError

    cfg = tmp_path / "c.yaml"
    cfg.write_text(json.dumps({"server": {"api": api, "tokenizer": "t"}, "datasets": [
        {"name": "A", "path": "a.jsonl", "budget": "1M", "sampling": {"extra": extra}}]}))
    with pytest.raises(ConfigError) as err:
        load_config(cfg)
    assert "dataset A: " in str(err.value) and message in str(err.value), str(err.value)


@pytest.mark.parametrize(("api", "extra"), [("generate", {"min_new_tokens": 3, "frequency_penalty": 0.1}),
                                            ("chat", {"min_tokens": 3, "separate_reasoning": False})])
def test_sampling_extra_with_the_apis_own_names_passes(tmp_path, api, extra):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(json.dumps({"server": {"api": api, "tokenizer": "t"}, "datasets": [
        {"name": "A", "path": "a.jsonl", "budget": "1M", "sampling": {"extra": extra}}]}))
    assert load_config(cfg).datasets[0].sampling.extra == extra


@pytest.mark.parametrize(("field", "value"), [("top_p", 0), ("top_k", 0), ("top_k", -2), ("temperature", -0.1),
                                              ("repetition_penalty", 0), ("repetition_penalty", 2.5), ("min_p", 1.5)])
def test_sampling_values_sglang_rejects_fail_at_config_load(field, value):
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match=field):
        SamplingParams(**{field: value})


# --- the whole pipeline against `budgetq sim` with SGLang's rules ------------------------------

def test_a_run_with_dropped_connections_and_held_rids_loses_nothing(tmp_path, redis_url, conn, sim_factory):
    """SGLang holds a dropped request's rid ~4 s and aborts by rid prefix (p1 prefixes p10..p19, p100..).

    On the old scheme (rid = job id, reused on retry) the retries met "400 Duplicate request
    ID" and failed, and a drop of p1 aborted p10.., whose cut answers were committed.
    """
    from tests.helpers import check_invariants, rows, run_to_completion, sim_get, write_config, write_dataset

    sim = sim_factory("--speedup", "4", "--length-mean", "60", "--length-sigma", "0.5", "--seed", "3",
                      "--drop-rate", "0.05", "--disconnect-poll-s", "4")
    ids = write_dataset(tmp_path / "D.jsonl", 2000)
    cfg = write_config(tmp_path, redis_url, [sim], [{"name": "D", "path": str(tmp_path / "D.jsonl"),
                                                     "budget": "100M", "id_field": "id",
                                                     "sampling": {"max_tokens": 400}}],
                       worker={"concurrency": 128, "heartbeat_ttl_s": 10, "control_interval_s": 0.2},
                       server={"backoff_base_s": 0.05, "backoff_max_s": 0.5, "max_attempts": 8,
                               "eject_after_failures": 1000})
    run_to_completion(cfg, tmp_path, workers=2, timeout_s=300)
    states = check_invariants(conn, tmp_path / "out", "D", ids)
    stats = sim_get(sim, "/sim/stats")
    assert stats["dropped"] >= 40, stats  # ~5% of 2,000 were cut
    out = rows(tmp_path / "out" / "D.jsonl")
    assert states["committed"] == 2000 and states["failed"] == 0, states
    assert {r["finish_reason"] for r in out} <= {"stop", "length"}
    assert int(conn.get(keys.used_key("D"))) == sum(r["completion_tokens"] for r in out)
    requests = sim_get(sim, "/sim/requests")
    assert all(job_id_of_rid(r["rid"]) != r["rid"] for r in requests)  # every rid carries its attempt nonce
    print(f"2,000 prompts: {stats['dropped']} connections dropped, {len(requests)} requests, "
          f"{int(conn.hget(keys.stats_key('D'), 'retried') or 0)} retries, 0 failed, 0 aborted rows")


def test_the_names_module_and_the_pinned_wheel_name_the_same_sglang_version():
    from pathlib import Path

    from budgetq.shared.sglang_names import SGLANG_VERSION

    pinned = (Path(__file__).parent / "SGLANG_VERSION").read_text().strip()
    assert SGLANG_VERSION == pinned


def test_every_attempt_of_a_job_gets_the_same_simulated_length():
    from budgetq.simulator.lengths import LengthModel, draw_key

    model = LengthModel(7, 1500, 0.8)
    rids = [attempt_rid("D--p1") for _ in range(5)]
    assert len({model.draw(r) for r in rids}) == 1 and model.draw(rids[0]) == model.draw("D--p1")
    assert draw_key("D--p1.0123456789ab") == "D--p1" and draw_key("D--p1.xyz") == "D--p1.xyz"


def test_an_endpoint_whose_server_info_fails_gets_only_standard_fields_and_is_asked_again_later():
    """A proxy answering /server_info with a 5xx (the server behind it unknown): requests carry no
    SGLang-only value (top_k -1 would fail every prompt on a server that refuses it), and
    /server_info is not asked again for every request."""
    asked: list[int] = []
    bodies: list[dict] = []

    async def server_info(_request: web.Request) -> web.Response:
        asked.append(1)
        return web.Response(status=502, text="<html>Bad Gateway</html>", content_type="text/html")

    async def chat(request: web.Request) -> web.Response:
        bodies.append(await request.json())
        return web.json_response(_chat("stop"))

    async def main() -> None:
        app = web.Application()
        app.add_routes([web.post("/v1/chat/completions", chat), web.get("/server_info", server_info),
                        web.get("/health", _ok)])
        runner = web.AppRunner(app)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        try:
            async with aiohttp.ClientSession() as session:
                client = SGLangClient(session, ServerConfig(urls=[f"http://127.0.0.1:{port}"], api="chat"))
                try:
                    for i in range(6):
                        await client.complete(_payload(), f"C-c{i}")
                    assert client.pool.endpoints[0].sglang is None
                finally:
                    await client.close()
        finally:
            await runner.cleanup()

    asyncio.run(main())
    assert len(bodies) == 6 and len(asked) == 1
    assert not any("top_k" in b or "rid" in b for b in bodies), bodies
