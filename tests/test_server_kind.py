"""What kind of server an endpoint is (SGLang, vLLM, another OpenAI-style one), the model name its
requests carry, the rid sent as X-Request-Id, vLLM's load read for concurrency: auto and shown by
status: against a stand-in server that answers as vLLM 0.32.0 does (tests/test_vllm_fleet.py runs the
real one)."""

from __future__ import annotations

import asyncio
import re

import aiohttp
import pytest
from aiohttp import web

from budgetq.cli.status_view import server_label
from budgetq.producer.ops.check import check_server
from budgetq.shared import server_kind
from budgetq.shared.config import Config, ServerConfig
from budgetq.shared.errors import ConfigError, FatalRequestError
from budgetq.shared.redis_conn import aconnect
from budgetq.shared.schema import JobPayload, Message, SamplingParams
from budgetq.shared.status import endpoint_summary
from budgetq.worker.capacity import Capacity
from budgetq.worker.context import Slots
from budgetq.worker.endpoints import sglang_from_server_info
from budgetq.worker.sglang_client import ServerInfo, SGLangClient
from tests.helpers import serve_routes
from tests.test_capacity import VLLM_METRICS

PAYLOAD = JobPayload(id="c1", dataset="C", messages=[Message(role="user", content="hi")],
                     sampling=SamplingParams(max_tokens=8))


def _card(model_id: str, owner: str = "vllm") -> dict:
    return {"id": model_id, "object": "model", "owned_by": owner, "root": f"/models/{model_id}", "max_model_len": 2048}


def test_the_kind_comes_from_server_info_then_v1_models_and_the_model_from_its_one_id():
    assert sglang_from_server_info(200, {"tp_size": 1, "internal_states": []}) is True
    assert sglang_from_server_info(404, {"detail": "Not Found"}) is False      # vLLM, llama.cpp
    assert sglang_from_server_info(200, {"hello": 1}) is False                 # some other JSON
    assert sglang_from_server_info(401, None) is True                          # SGLang's route, an admin key
    assert sglang_from_server_info(502, "<html>") is None                      # a proxy: ask again later
    vllm = {"object": "list", "data": [_card("smollm2")]}
    assert server_kind.kind_of_models(vllm) == ("vllm", ["smollm2"])
    assert server_kind.kind_of_models({"data": [_card("m", owner="me")]}) == ("openai", ["m"])  # llama.cpp's
    assert server_kind.kind_of_models(None) == ("openai", [])
    assert server_kind.resolve_model(None, "vllm", ["smollm2"], "http://v") == "smollm2"
    assert server_kind.resolve_model(None, "sglang", ["Qwen/Qwen3-8B"], "http://s") == "default"  # as always
    assert server_kind.resolve_model(None, "openai", [], "http://o") == "default"   # nothing listed: as before
    assert server_kind.resolve_model("llama", "vllm", ["a", "b"], "http://v") == "llama"   # set: used as is
    with pytest.raises(ConfigError, match=r"^server http://v serves 2 models \(a, b\) and server.model is not set"):
        server_kind.resolve_model(None, "vllm", ["a", "b"], "http://v")


class FakeVllm:
    """/server_info 404, /v1/models, /metrics and a chat route that refuses any other model name (404),
    as vLLM does; it records each chat request's X-Request-Id and body. ``owner``: another server's
    /v1/models owned_by (llama-cpp-python says "me")."""

    def __init__(self, models: list[str], owner: str = "vllm") -> None:
        self.models = models
        self.owner = owner
        self.seen: list[tuple[str | None, dict]] = []
        self.metrics = VLLM_METRICS

    def routes(self) -> list[web.RouteDef]:
        return [web.get("/v1/models", self._models), web.get("/metrics", self._metrics),
                web.post("/v1/chat/completions", self._chat)]

    async def _models(self, _r: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [_card(m, self.owner) for m in self.models]})

    async def _metrics(self, _r: web.Request) -> web.Response:
        return web.Response(text=self.metrics, content_type="text/plain")

    async def _chat(self, r: web.Request) -> web.Response:
        body = await r.json()
        self.seen.append((r.headers.get("X-Request-Id"), body))
        if body["model"] not in self.models:
            return web.json_response({"error": {"message": f"The model '{body['model']}' does not exist.",
                                                "type": "NotFoundError", "code": 404}}, status=404)
        return web.json_response({"id": f"chatcmpl-{r.headers.get('X-Request-Id')}", "model": body["model"],
                                  "choices": [{"message": {"role": "assistant", "content": "ok"},
                                               "finish_reason": "stop"}],
                                  "usage": {"prompt_tokens": 3, "completion_tokens": 1}})


async def _serving(server: FakeVllm, body) -> None:
    await serve_routes(server.routes(), body)


def test_a_vllm_gets_its_one_model_our_rid_as_x_request_id_and_its_metrics_are_read(redis_url):
    server = FakeVllm(["smollm2"])

    async def run(url: str) -> None:
        async with aiohttp.ClientSession() as session:
            client = SGLangClient(session, ServerConfig(urls=[url]))
            await client.pool.detect_all()
            ep = client.pool.endpoints[0]
            assert (ep.kind, ep.model) == ("vllm", "smollm2")
            out = await client.complete(PAYLOAD, "C-c1")
            assert out.text == "ok" and out.model == "smollm2"
            aconn = aconnect(redis_url)
            try:
                cap = Capacity("w1", aconn, client.pool, Slots(8), asyncio.Event(), interval_s=5.0)
                await cap.refresh()
            finally:
                await aconn.aclose()
            assert ep.load is not None
            assert {k: ep.load[k] for k in ("running", "waiting", "kv_cache_use")} == \
                {"running": 78, "waiting": 7, "kv_cache_use": 0.625}
            # 6 wait for room, more than the queue kept at 8 slots: the estimate falls to what runs
            assert cap.slots_estimate[url] == 78 and ep.load["slots"] == 78
            assert cap.shares[url] >= 1 and cap.slots.limit == cap.shares[url]
            snap = client.pool.snapshot()[url]
            assert snap["kind"] == "vllm" and snap["model"] == "smollm2" and snap["load"]["running"] == 78
            await client.close()

    asyncio.run(_serving(server, run))
    ((rid, body),) = server.seen
    assert re.fullmatch(r"C-c1\.[0-9a-f]{12}", rid or "")           # the attempt's rid
    assert body["model"] == "smollm2" and "rid" not in body and "top_k" not in body


def test_another_openai_style_server_gets_its_model_but_no_x_request_id():
    """llama-cpp-python's server answers 400 (empty body) to an X-Request-Id that is not a UUID
    (starlette_context RequestIdPlugin, validate=True: llama_cpp/server/app.py), so only SGLang and
    vLLM get the rid as that header."""
    server = FakeVllm(["/models/SmolLM2-135M-Instruct.Q4_1.gguf"], owner="me")

    async def run(url: str) -> None:
        async with aiohttp.ClientSession() as session:
            client = SGLangClient(session, ServerConfig(urls=[url]))
            out = await client.complete(PAYLOAD, "C-c1")
            assert client.pool.endpoints[0].kind == "openai" and out.model == server.models[0]
            await client.close()

    asyncio.run(_serving(server, run))
    ((rid, body),) = server.seen
    assert rid is None and body["model"] == server.models[0]


def test_unreadable_vllm_metrics_keep_the_share_and_say_so_once(redis_url, caplog):
    server = FakeVllm(["smollm2"])
    server.metrics = "<html>Bad gateway</html>"

    async def run(url: str) -> None:
        async with aiohttp.ClientSession() as session:
            client = SGLangClient(session, ServerConfig(urls=[url]))
            aconn = aconnect(redis_url)
            try:
                cap = Capacity("w1", aconn, client.pool, Slots(8), asyncio.Event(), interval_s=5.0)
                for _ in range(3):
                    await cap.refresh()
            finally:
                await aconn.aclose()
            assert cap.shares[url] == 8 and client.pool.endpoints[0].load is None
            await client.close()

    with caplog.at_level("INFO", logger="budgetq.capacity"):
        asyncio.run(_serving(server, run))
    said = [r.getMessage() for r in caplog.records if "cannot read" in r.getMessage()]
    assert len(said) == 1 and "keeping its share 8" in said[0], said


def test_several_models_and_no_server_model_stop_the_worker_and_fail_check_in_one_line():
    server = FakeVllm(["llama-3-8b", "qwen3-8b"])
    line = "serves 2 models (llama-3-8b, qwen3-8b) and server.model is not set: set server.model to the one to use"

    async def run(url: str) -> None:
        async with aiohttp.ClientSession() as session:
            client = SGLangClient(session, ServerConfig(urls=[url]))
            with pytest.raises(ConfigError, match=re.escape(f"server {url} {line}")):
                await client.pool.detect_all()          # the worker's start: exit 2 with this line
            with pytest.raises(FatalRequestError, match=re.escape(line)):
                await client.complete(PAYLOAD, "C-c1")  # a server that came up later: the prompt fails, says why
            chosen = SGLangClient(session, ServerConfig(urls=[url], model="qwen3-8b"))
            assert (await chosen.complete(PAYLOAD, "C-c1")).model == "qwen3-8b"
            await client.close()
            await chosen.close()

    asyncio.run(_serving(server, run))
    assert [body["model"] for _rid, body in server.seen] == ["qwen3-8b"]   # nothing sent without a model

    cfg = Config.model_validate({"server": {"urls": ["http://v"]}, "datasets": []})
    several = check_server(cfg, "http://v", lambda url: ServerInfo(url, ["llama-3-8b", "qwen3-8b"], None, kind="vllm"))
    assert not several.ok and several.error == f"server http://v {line}"
    one = check_server(cfg, "http://v", lambda url: ServerInfo(url, ["smollm2"], None, kind="vllm"))
    assert one.ok and one.model == "smollm2" and one.kind == "vllm"
    sglang = check_server(cfg, "http://s", lambda url: ServerInfo(url, ["a", "b"], None, kind="sglang"))
    assert sglang.ok and sglang.model is None                        # SGLang takes "default", as before


def test_status_shows_the_kind_model_and_the_latest_load_any_worker_read():
    def worker(read_at: float, running: int) -> dict:
        load = {"running": running, "waiting": 3, "kv_cache_use": 0.42, "slots": 64, "read_at": read_at}
        return {"endpoints": {"http://v": {"healthy": True, "in_flight": 5, "failures": 0, "ejected_since": None,
                                           "prompt_tokens": 0, "cached_tokens": 0, "kind": "vllm",
                                           "model": "smollm2", "load": load}}}

    (e,) = endpoint_summary([worker(100.0, 60), worker(105.0, 61)], ["http://v"])
    assert e["kind"] == "vllm" and e["model"] == "smollm2" and e["in_flight"] == 10
    assert e["load"]["running"] == 61                                  # the server's own number: the latest read
    assert server_label(e) == "vLLM smollm2"
    (unknown,) = endpoint_summary([], ["http://v"])
    assert unknown["kind"] is None and unknown["load"] is None and server_label(unknown) == "-"
