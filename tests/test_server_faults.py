"""Server faults are counted by reason per endpoint and said in one line; a request the server
calls invalid fails its prompt at once; servers that are not SGLang get standard fields only."""

from __future__ import annotations

import asyncio
import errno
import json
import subprocess
import types
import urllib.request

import aiohttp
import pytest
from aiohttp import web

from budgetq.shared import keys, server_faults
from budgetq.shared.config import ServerConfig
from budgetq.shared.errors import FatalRequestError, RetryableRequestError
from budgetq.shared.schema import JobPayload, Message, SamplingParams
from budgetq.simulator.local import free_port
from budgetq.worker.sglang_client import SGLangClient
from budgetq.worker.sglang_wire import build_request, invalid_request
from tests.helpers import PY, ROOT, Procs, rows, serve_routes, wait_for, write_config, write_dataset

FAST = {"heartbeat_ttl_s": 3, "maintenance_interval_s": 0.5, "control_interval_s": 0.2}
# What llama-cpp-python 0.3.36's server answers to ``top_k: -1`` (seen from the real server: its
# RouteErrorHandler wraps FastAPI's RequestValidationError into a 500).
LLAMA_TOP_K = {"error": {"message": "1 validation error:\n  {'type': 'greater_than_equal', 'loc': ('body', 'top_k'), "
                                    "'msg': 'Input should be greater than or equal to 0', 'input': -1, "
                                    "'ctx': {'ge': 0}}\n", "type": "internal_server_error", "param": None,
                         "code": None}}
NGINX_500 = ("<html>\r\n<head><title>500 Internal Server Error</title></head>\r\n<body>\r\n<center><h1>500 Internal "
             "Server Error</h1></center>\r\n<hr><center>nginx</center>\r\n</body>\r\n</html>\r\n")


def _payload(**sampling) -> JobPayload:
    return JobPayload(id="c1", dataset="C", messages=[Message(role="user", content="hi")],
                      sampling=SamplingParams(max_tokens=8, **sampling))


# -- reasons and the one line -------------------------------------------------------------------
def test_reasons_name_the_status_and_the_body_type():
    assert server_faults.http_reason(500, "text/html; charset=utf-8") == "HTTP 500 text/html"
    assert server_faults.http_reason(503, "application/json") == "HTTP 503 JSON"
    assert server_faults.http_reason(413, None) == "HTTP 413 no body type"
    assert server_faults.http_reason(500, "application/json", invalid=True) == "invalid request (HTTP 500)"
    assert server_faults.unreadable_reason("text/html") == "non-JSON answer (text/html)"
    assert server_faults.transport_reason(ConnectionRefusedError(111, "Connection refused")) == "connection refused"
    assert server_faults.transport_reason(TimeoutError()) == "timeout"
    assert server_faults.brief(NGINX_500) == "500 Internal Server Error"
    assert len(server_faults.brief("x " * 10_000)) == server_faults.MESSAGE_CHARS


def test_aiohttp_connect_errors_are_named_by_their_errno():
    """aiohttp words a refused port "Connect call failed"; the OSError it wraps says refused."""
    key = types.SimpleNamespace(host="127.0.0.1", port=9, ssl=True)
    refused = aiohttp.ClientConnectorError(key, ConnectionRefusedError(errno.ECONNREFUSED, "Connect call failed"))
    assert "refused" not in str(refused).lower()
    assert server_faults.transport_reason(refused) == "connection refused"
    unreachable = aiohttp.ClientConnectorError(key, OSError(errno.EHOSTUNREACH, "No route to host"))
    assert server_faults.transport_reason(unreachable) == "cannot connect"
    assert server_faults.transport_reason(aiohttp.ServerDisconnectedError()) == "connection dropped"

    async def connect() -> str:  # and a real refused port, as the worker meets it
        async with aiohttp.ClientSession() as session:
            with pytest.raises(aiohttp.ClientConnectorError) as caught:
                await session.get(f"http://127.0.0.1:{free_port()}/")
        return server_faults.transport_reason(caught.value)

    assert asyncio.run(connect()) == "connection refused"


def test_no_worker_and_every_server_failing_are_stalls():
    line = "no worker is running: 262 prompts queued (start `budgetq worker -c CONFIG`)"
    assert server_faults.stall([], workers=0, queued=262) == line
    assert server_faults.stall([], workers=0, queued=1, running=2) == (
        "no worker is running: 1 prompt queued, 2 claimed by workers that are gone (start `budgetq worker -c CONFIG`)")
    assert server_faults.stall([], workers=0, queued=0) is None   # nothing waits: no stall
    assert server_faults.stall([], workers=1, queued=262) is None
    down = _view("http://a", "connection refused", 10.0, None, healthy=False)
    up = _view("http://b", None, None, 12.0)
    assert server_faults.stall([down], workers=1, queued=5) == "1/1 server failing: connection refused"
    assert server_faults.stall([down, up], workers=1, queued=5) is None  # b takes the prompts


def _view(url: str, reason: str | None, fault_at: float | None, ok_at: float | None, healthy: bool = True,
          message: str = "", streak: int = 3) -> server_faults.EndpointView:
    v = server_faults.EndpointView(url)
    server_faults._fold({url: v}, url, {"healthy": healthy, "counts": {reason: 3} if reason else {},
                                        "last_reason": reason, "last_message": message,
                                        "last_fault_at": fault_at, "last_ok_at": ok_at, "streak": streak})
    return v


def test_the_diagnosis_is_one_line_and_only_when_something_fails():
    a = _view("http://a", "HTTP 500 text/html", 10.0, 5.0, message="500 Internal Server Error")
    b = _view("http://b", "HTTP 500 text/html", 11.0, None, healthy=False, message="500 Internal Server Error")
    assert server_faults.diagnosis([a, b]) == "2/2 servers failing: HTTP 500 text/html (500 Internal Server Error)"
    ok = _view("http://c", "HTTP 503 JSON", 10.0, 12.0)  # answered since its last fault
    assert not ok.failing and server_faults.diagnosis([ok]) is None
    once = _view("http://e", "invalid request (HTTP 400)", 10.0, 5.0, streak=1)  # one refused prompt: counted only
    assert not once.failing and once.counts
    refused = _view("http://d", "connection refused", 9.0, None, healthy=False)
    assert server_faults.diagnosis([a, ok, refused]) == (
        "2/3 servers failing: http://a HTTP 500 text/html; http://d connection refused")
    assert server_faults.diagnosis([]) is None


def test_faults_travel_through_redis_from_live_workers_only(conn):
    faults = server_faults.EndpointFaults()
    faults.fault("HTTP 500 text/html", NGINX_500)
    conn.sadd(keys.WORKERS, "w1", "w2")   # w2 has no fault key: it published none (or is gone)
    pipe = conn.pipeline()
    server_faults.publish(pipe, "w1", {"http://u:secret@a": faults.to_json(healthy=False)}, ttl_s=30)
    pipe.execute()
    (view,) = server_faults.read(conn)
    assert view.url == "http://u:***@a" and view.failing and view.counts == {"HTTP 500 text/html": 1}
    assert server_faults.diagnose(conn) == "1/1 server failing: HTTP 500 text/html (500 Internal Server Error)"
    assert 0 < conn.ttl(keys.server_faults_key("w1")) <= 30


# -- what the client does with an answer ---------------------------------------------------------
def test_a_validation_error_sent_as_500_fails_the_prompt_at_once_with_the_servers_message():
    bodies: list[dict] = []

    async def chat(request: web.Request) -> web.Response:
        bodies.append(await request.json())
        return web.json_response(LLAMA_TOP_K, status=500)

    async def run(url: str) -> None:
        cfg = ServerConfig(urls=[url], backoff_base_s=0.01, max_attempts=5)
        async with aiohttp.ClientSession() as session:
            client = SGLangClient(session, cfg)
            with pytest.raises(FatalRequestError, match=r"refused the request as invalid: .*'top_k'.*greater than"):
                await client.complete(_payload(top_k=-1), "C-c1")
            ep = client.pool.endpoints[0]
            assert ep.healthy and ep.faults.counts == {"invalid request (HTTP 500)": 1}
            await client.close()

    asyncio.run(serve_routes([web.post("/v1/chat/completions", chat)], run))
    assert len(bodies) == 1  # not retried


def test_an_html_500_is_retried_counted_and_the_endpoint_checked_through_v1_models():
    state = {"broken": True, "models": 0}

    async def chat(_request: web.Request) -> web.Response:
        if state["broken"]:
            return web.Response(status=500, text=NGINX_500, content_type="text/html")
        return web.json_response({"choices": [{"message": {"role": "assistant", "content": "ok"},
                                               "finish_reason": "stop"}],
                                  "usage": {"prompt_tokens": 3, "completion_tokens": 1}})

    async def models(_request: web.Request) -> web.Response:  # no /health route at all: 404 there
        state["models"] += 1
        # the first ask is the worker's: what the server is (worker/endpoints.py ask_kind); the health
        # probe's, after the endpoint was taken out, finds it repaired
        state["broken"] = state["models"] == 1
        return web.json_response({"object": "list", "data": []})

    async def run(url: str) -> None:
        cfg = ServerConfig(urls=[url], backoff_base_s=0.01, backoff_max_s=0.02, max_attempts=3,
                           eject_after_failures=2, health_interval_s=0.05)
        async with aiohttp.ClientSession() as session:
            client = SGLangClient(session, cfg)
            out = await asyncio.wait_for(client.complete(_payload(), "C-c1"), 10)
            ep = client.pool.endpoints[0]
            assert out.text == "ok" and ep.healthy and ep.sglang is False
            assert ep.faults.counts == {"HTTP 500 text/html": 2}
            assert ep.faults.last_message == "500 Internal Server Error"
            assert ep.faults.last_ok_at is not None and ep.faults.last_ok_at >= ep.faults.last_fault_at
            await client.close()

    asyncio.run(serve_routes([web.post("/v1/chat/completions", chat), web.get("/v1/models", models)], run))
    assert state["models"] >= 2


def test_refused_connections_are_counted_and_exhausted_attempts_say_why():
    async def run() -> None:
        url = f"http://127.0.0.1:{free_port()}"  # nothing listens
        cfg = ServerConfig(urls=[url], backoff_base_s=0.01, backoff_max_s=0.02, max_attempts=2,
                           eject_after_failures=5)
        async with aiohttp.ClientSession() as session:
            client = SGLangClient(session, cfg)
            with pytest.raises(RetryableRequestError, match="gave up after 2 attempts"):
                await client.complete(_payload(), "C-c1")
            assert dict(client.pool.endpoints[0].faults.counts) == {"connection refused": 2}  # as docs/worker.md says
            await client.close()

    asyncio.run(run())


def test_invalid_request_bodies():
    assert invalid_request(500, LLAMA_TOP_K)
    assert invalid_request(400, {"object": "error", "message": "anything", "type": "BadRequestError"})
    assert invalid_request(413, "Request Entity Too Large")
    assert invalid_request(502, {"detail": [{"loc": ["body", "x"], "msg": "field required"}]})
    assert invalid_request(500, {"error": {"message": "bad", "type": "invalid_request_error"}})
    assert not invalid_request(500, NGINX_500)
    assert not invalid_request(503, {"object": "error", "message": "The server is overloaded", "type": "503"})
    assert not invalid_request(200, {"error": {"type": "invalid_request_error"}})


def test_servers_that_are_not_sglang_get_only_the_fields_that_are_set():
    payload = _payload(temperature=0.5)
    _path, sglang = build_request(ServerConfig(), payload, "C-c1.000000000000", sglang=True)
    assert sglang["top_k"] == -1 and sglang["rid"] and sglang["max_completion_tokens"] == 8
    _path, other = build_request(ServerConfig(), payload, "C-c1.000000000000", sglang=False)
    assert other["temperature"] == 0.5 and other["max_tokens"] == other["max_completion_tokens"] == 8
    assert not {"top_k", "top_p", "min_p", "repetition_penalty", "rid"} & set(other)
    _path, chosen = build_request(ServerConfig(), _payload(top_k=20), "r", sglang=False)
    assert chosen["top_k"] == 20  # what the user set is sent


# -- the whole pipeline against a fleet that only answers HTML 500s ------------------------------
def _sim_faults(url: str, faults: dict) -> None:
    req = urllib.request.Request(url + "/sim/faults", json.dumps(faults).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        resp.read()


def test_a_fleet_behind_a_proxy_answering_html_500_says_why_and_recovers(tmp_path, redis_url, conn, sim_factory):
    sims = [sim_factory("--speedup", "50", "--length-mean", "20") for _ in range(2)]
    for s in sims:
        _sim_faults(s, {"proxy_error": 500})
    ids = write_dataset(tmp_path / "D.jsonl", 20)
    cfg = write_config(tmp_path, redis_url, sims,
                       [{"name": "D", "path": str(tmp_path / "D.jsonl"), "budget": "1M", "id_field": "id",
                         "sampling": {"max_tokens": 40}}],
                       worker={"concurrency": 4, **FAST},
                       server={"health_interval_s": 0.3, "eject_after_failures": 2, "backoff_base_s": 0.05},
                       producer={"progress": "log", "progress_interval_s": 0.5})
    procs = Procs(cfg, tmp_path)
    producer = procs.producer()
    procs.worker()
    line = "2/2 servers failing: HTTP 500 text/html (500 Internal Server Error)"
    try:
        wait_for(lambda: line in Procs.log(producer), 30, "the producer to say why nothing lands")
        status = subprocess.run([*PY, "status", "-c", str(cfg)], cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert status.returncode == 0 and line in status.stdout, status.stdout + status.stderr
        snap = json.loads(subprocess.run([*PY, "status", "--json", "-c", str(cfg)], cwd=ROOT, capture_output=True,
                                         text=True, timeout=60, check=True).stdout)
        assert snap["diagnosis"] == line
        assert {f["url"] for f in snap["server_faults"]} == set(sims)
        assert all(f["failing"] and f["counts"]["HTTP 500 text/html"] >= 2 for f in snap["server_faults"])
        assert int(conn.hget(keys.stats_key("D"), "committed") or 0) == 0
        for s in sims:  # the servers come back behind the proxy: the run finishes by itself
            _sim_faults(s, {"proxy_error": None})
        assert producer.wait(90) == 0, Procs.log(producer)
        wait_for(lambda: server_faults.diagnose(conn) is None, 15, "the servers to count as answering again")
    finally:
        procs.stop_all()
    out = rows(tmp_path / "out" / "D.jsonl") + rows(tmp_path / "out" / "D.truncated.jsonl")
    assert sorted(r["id"] for r in out) == sorted(ids)


def test_concurrent_first_requests_ask_server_info_once():
    asked: list[int] = []

    async def server_info(_request: web.Request) -> web.Response:
        asked.append(1)
        await asyncio.sleep(0.05)
        return web.Response(status=404)

    async def chat(request: web.Request) -> web.Response:
        assert "top_k" not in await request.json()
        return web.json_response({"choices": [{"message": {"role": "assistant", "content": "ok"},
                                               "finish_reason": "stop"}],
                                  "usage": {"prompt_tokens": 3, "completion_tokens": 1}})

    async def run(url: str) -> None:
        async with aiohttp.ClientSession() as session:
            client = SGLangClient(session, ServerConfig(urls=[url]))
            outs = await asyncio.gather(*[client.complete(_payload(), f"C-c{i}") for i in range(8)])
            assert [o.text for o in outs] == ["ok"] * 8 and client.pool.endpoints[0].sglang is False
            await client.close()

    asyncio.run(serve_routes([web.post("/v1/chat/completions", chat), web.get("/server_info", server_info)], run))
    assert len(asked) == 1
