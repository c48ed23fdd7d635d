"""A second endpoint in front of the one real vLLM server the suite can afford (a second start costs minutes on
2 cores): every request goes through to it unchanged, streamed both ways, except ``GET /metrics``, which is the
server's own exposition with its waiting gauges raised by ``extra_waiting``, as if other clients queued requests
there.

It also records each ``POST`` it forwards (``requests``: path, X-Request-Id, the body's
``kv_transfer_params.hidden_states_path``, and whether the answer reached the client): a request whose client
went away before its answer is still forwarded whole (aiohttp does not cancel a handler on a disconnect), so it is
the evidence of a client killed mid-request (tests/test_vllm_features.py).
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
from dataclasses import dataclass

import aiohttp
from aiohttp import web

from budgetq.simulator.local import free_port

_HOP = {"host", "content-length", "transfer-encoding", "connection", "keep-alive"}
# vllm:num_requests_waiting{engine="0",...} 0.0 and the reason="capacity" part of the by-reason gauge
_WAITING = re.compile(r'^(vllm:num_requests_waiting(?:\{[^}]*\})?|vllm:num_requests_waiting_by_reason\{[^}]*'
                      r'reason="capacity"[^}]*\}) (\S+)$', re.M)


@dataclass
class Proxied:
    path: str
    rid: str
    hidden_states_path: str | None
    answered: bool = False          # the whole answer written to a client still connected
    status: int | None = None       # the server's answer


def raise_waiting(text: str, extra: int) -> str:
    return _WAITING.sub(lambda m: f"{m.group(1)} {float(m.group(2)) + extra}", text)


class MetricsProxy:
    """``url``: the second endpoint; ``metrics_reads``: how many times its /metrics was read; ``stop()``."""

    def __init__(self, upstream: str, extra_waiting: int = 0) -> None:
        self.upstream, self.extra_waiting = upstream.rstrip("/"), extra_waiting
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.metrics_reads = 0
        self.requests: list[Proxied] = []
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="metrics-proxy", daemon=True)
        self._thread.start()
        if not self._ready.wait(30):
            raise AssertionError("the metrics proxy did not start")

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(self._start())
        self._ready.set()
        self._loop.run_forever()

    async def _start(self) -> None:
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None))
        app = web.Application(client_max_size=64 * 2**20)
        app.router.add_route("*", "/{tail:.*}", self._forward)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()

    async def _forward(self, request: web.Request) -> web.StreamResponse:
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
        body = await request.read()
        seen = None
        if request.method == "POST":
            seen = Proxied(request.path, request.headers.get("X-Request-Id", ""), _hidden_states_path(body))
            self.requests.append(seen)
        async with self._session.request(request.method, self.upstream + request.path_qs, headers=headers,
                                         data=body or None) as up:
            if request.path == "/metrics" and up.status == 200:
                self.metrics_reads += 1
                return web.Response(text=raise_waiting(await up.text(), self.extra_waiting),
                                    content_type="text/plain")
            out = web.StreamResponse(status=up.status, headers={k: v for k, v in up.headers.items()
                                                                if k.lower() not in _HOP})
            if seen is not None:
                seen.status = up.status
            if request.transport is None or request.transport.is_closing():
                return out                  # the client went away meanwhile: nothing to answer
            try:
                await out.prepare(request)
                async for chunk in up.content.iter_any():
                    await out.write(chunk)
                await out.write_eof()
            except ConnectionResetError:    # it went away while the answer was written
                return out
            if seen is not None:
                seen.answered = request.transport is not None and not request.transport.is_closing()
            return out

    def stop(self) -> None:
        async def close() -> None:
            await self._runner.cleanup()
            await self._session.close()

        asyncio.run_coroutine_threadsafe(close(), self._loop).result(30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(30)
        self._loop.close()


def _hidden_states_path(body: bytes) -> str | None:
    try:
        return json.loads(body)["kv_transfer_params"]["hidden_states_path"]
    except (ValueError, KeyError, TypeError):
        return None
