"""HTTP surface of the simulator: SGLang's endpoints and JSON shapes (see SGLANG_API.md), plus /sim/*.

/sim/* are the simulator's own test hooks (stats, request records, live faults, reset); they are
never behind the API key or the down switch, so a test can always read them and switch back.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime

from aiohttp import web
from pydantic import ValidationError

from budgetq.simulator import metrics
from budgetq.simulator.faults import FaultInjector, Faults, proxy_page
from budgetq.simulator.model import Engine, SimSettings
from budgetq.simulator.native import NativeRoutes
from budgetq.simulator.oai_routes import OpenAIRoutes
from budgetq.simulator.runner import WEIGHT_VERSION, Runner

VERSION = "0.5.23-sim"   # the SGLang release whose behaviour the simulator mirrors
_NO_KEY = {"/health", "/health_generate", "/metrics"}
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class SimServer:
    def __init__(self, settings: SimSettings, host: str = "127.0.0.1", port: int = 30000) -> None:
        self.s = settings
        self.host, self.port = host, port
        self.engine = Engine(settings)
        self.faults = FaultInjector(Faults(
            error_rate=settings.error_rate, error_codes=settings.error_codes, spike_rate=settings.spike_rate,
            spike_s=settings.spike_s, drop_rate=settings.drop_rate, context_length=settings.context_length,
            drop_after_tokens=settings.drop_after_tokens),
            settings.seed)
        self.runner = Runner(settings, self.engine, self.faults)
        self.started = time.time()

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024, middlewares=[self._gate])
        oai, native = OpenAIRoutes(self.s, self.runner), NativeRoutes(self.s, self.runner)
        app.add_routes([
            web.post("/v1/chat/completions", oai.chat),
            web.post("/v1/completions", oai.completions),
            web.post("/generate", native.generate),
            web.get("/health", self.health),
            web.get("/health_generate", self.health),
            web.get("/v1/models", self.models),
            web.get("/get_model_info", self.model_info),
            web.get("/model_info", self.model_info),
            web.get("/get_server_info", self.server_info),
            web.get("/server_info", self.server_info),
            web.get("/v1/loads", self.loads),
            web.post("/abort_request", self.abort_request),
            web.get("/metrics", self.metrics),
            web.get("/sim/stats", self.sim_stats),
            web.get("/sim/requests", self.sim_requests),
            web.get("/sim/faults", self.sim_faults),
            web.post("/sim/faults", self.sim_faults),
            web.post("/sim/reset", self.sim_reset),
        ])
        return app

    @web.middleware
    async def _gate(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """The proxy-error and down switches (every route, /health too) and the API key, before any route."""
        path = request.path
        if path.startswith("/sim/"):
            return await handler(request)
        proxy = self.faults.faults.proxy_error
        if proxy is not None:  # a reverse proxy in front of a dead server: its HTML error page, everywhere
            self.faults.count(f"proxy_{proxy}")
            return web.Response(status=proxy, content_type="text/html", text=proxy_page(proxy))
        if self.faults.faults.down:
            self.faults.count("down")
            if path.startswith("/v1/"):
                return web.json_response({"object": "error", "message": "The server is down (simulated)",
                                          "type": "ServiceUnavailableError", "param": None, "code": 503}, status=503)
            return web.json_response({"error": {"message": "The server is down (simulated)"}}, status=503)
        key = self.s.api_key
        if key and path not in _NO_KEY and request.headers.get("Authorization") != f"Bearer {key}":
            return web.json_response({"error": "Unauthorized"}, status=401)
        return await handler(request)

    # --- SGLang's operational routes ------------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        # SGLang answers 200 with an empty body once a 1-token generation works; the simulator always can.
        return web.Response(status=200)

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{
            "id": self.s.model, "object": "model", "created": int(self.started), "owned_by": "sglang",
            "root": self.s.model, "parent": None, "max_model_len": self.faults.faults.context_length}]})

    def _kv_tokens(self) -> int:
        s = self.s
        return s.max_total_num_tokens if s.max_total_num_tokens is not None else s.max_running_requests * 4096

    async def model_info(self, request: web.Request) -> web.Response:
        # http_server.model_info's keys.
        s = self.s
        return web.json_response({"model_path": s.model, "served_model_name": s.model, "tokenizer_path": s.model,
                                  "is_generation": True, "preferred_sampling_params": None,
                                  "weight_version": WEIGHT_VERSION, "load_format": "auto",
                                  "reasoning_parser": s.reasoning_parser, "tool_call_parser": None,
                                  "disaggregation_mode": "null", "has_image_understanding": False,
                                  "has_audio_understanding": False, "model_type": "simulator",
                                  "architectures": ["SimulatedForCausalLM"]})

    async def server_info(self, request: web.Request) -> web.Response:
        # http_server.server_info: server args + scheduler info + internal_states per DP rank.
        s, f = self.s, self.faults.faults
        args = {"model_path": s.model, "tokenizer_path": s.model, "served_model_name": s.model,
                "host": self.host, "port": self.port, "max_running_requests": s.max_running_requests,
                "max_queued_requests": s.max_queued_requests, "context_length": f.context_length,
                "reasoning_parser": s.reasoning_parser, "random_seed": s.seed, "enable_metrics": True,
                "sampling_defaults": "model", "dp_size": 1, "weight_version": WEIGHT_VERSION,
                "api_key": None if s.api_key is None else "***", "stream_interval": s.stream_interval,
                "incremental_streaming_output": s.incremental_streaming_output}
        state = {"world_size": 1, "startup_time": self.started,
                 "effective_max_running_requests_per_dp": s.max_running_requests,
                 "last_gen_throughput": self.engine.throughput(),
                 "memory_usage": {"weight": 0.0, "kvcache": 0.0, "startup_available": 0.0,
                                  "token_capacity": self._kv_tokens(), "token_capacity_swa": None, "graph": {}}}
        return web.json_response({**args, "launch_command": "budgetq sim", "max_total_num_tokens": self._kv_tokens(),
                                  "max_req_input_len": f.context_length - 1, "startup_time": self.started,
                                  "internal_states": [state], "version": VERSION, "frontend": "python",
                                  "simulator": {"peak_tok_s": s.peak_tok_s, "half_batch": s.half_batch,
                                                "prefill_tok_s": s.prefill_tok_s, "speedup": s.speedup,
                                                "instant": s.instant, "disconnect_poll_s": s.disconnect_poll_s,
                                                "stream_abort_s": s.stream_abort_s,
                                                "loop_fraction": s.loop_fraction, "loop_period": s.loop_period,
                                                "empty_fraction": s.empty_fraction,
                                                "unclosed_fraction": s.unclosed_fraction}})

    async def loads(self, request: web.Request) -> web.Response:
        # entrypoints/v1_loads.get_loads with one DP rank: LoadSnapshot's core keys.
        e, total = self.engine, self._kv_tokens()
        used = min(total, sum(r.prompt_tokens + e.tokens_now(r) for r in e.live_rids.values()))
        load = {"timestamp": time.time(), "dp_rank": 0, "num_running_reqs": e.running, "num_waiting_reqs": e.queued,
                "num_waiting_uncached_tokens": 0, "num_used_tokens": used, "num_total_tokens": total,
                "num_active_tokens": total, "num_prealloc_ready_tokens": 0, "max_total_num_tokens": total,
                "max_running_requests": self.s.max_running_requests, "token_usage": used / total if total else 0.0,
                "gen_throughput": e.throughput(), "cache_hit_rate": 0.0,
                "utilization": e.running / self.s.max_running_requests, "total_prefill_uncached_tokens": 0,
                "total_prefill_busy_us": 0, "decode_moments": None}
        return web.json_response({"timestamp": datetime.now(UTC).isoformat(), "version": VERSION,
                                  "accelerator": None, "num_accelerators": 1, "loads": [load]})

    async def abort_request(self, request: web.Request) -> web.Response:
        try:
            body = await request.json()
        except ValueError:
            body = None
        if not isinstance(body, dict):
            return web.json_response({"error": {"message": "body must be a JSON object"}}, status=400)
        if body.get("abort_all"):
            self.engine.abort_all()
        elif isinstance(body.get("rid"), str) and body["rid"]:
            self.engine.abort_rid(body["rid"])
        return web.Response(status=200)

    async def metrics(self, request: web.Request) -> web.Response:
        text = metrics.render(self.engine, self.s.model, self.s.max_running_requests)
        return web.Response(text=text, content_type="text/plain", charset="utf-8")

    # --- the simulator's own hooks --------------------------------------------------------------

    async def sim_stats(self, request: web.Request) -> web.Response:
        # pid: whoever started this process can tell that the server answering on its port is
        # this one and not another that took the port first (simulator/local.py LocalSim).
        return web.json_response({**self.engine.stats(), "errors": dict(self.faults.counts),
                                  "drops": self.faults.counts.get("drop", 0), "pid": os.getpid()})

    async def sim_requests(self, request: web.Request) -> web.Response:
        recs = [r.to_json() for r in self.engine.records]
        return web.Response(text=json.dumps(recs), content_type="application/json")

    async def sim_faults(self, request: web.Request) -> web.Response:
        if request.method == "POST":
            try:
                changes = await request.json()
                if not isinstance(changes, dict):
                    raise ValueError(f"the body must be a JSON object, got {type(changes).__name__}")
                self.faults.update(changes)
            except (ValueError, ValidationError) as exc:
                return web.json_response({"error": {"message": f"bad faults: {exc}"}}, status=400)
        return web.json_response(self.faults.faults.model_dump())

    async def sim_reset(self, request: web.Request) -> web.Response:
        self.engine.reset_counters()
        self.faults.counts.clear()
        return web.json_response({"reset": True})


async def start_sim(settings: SimSettings, host: str, port: int) -> web.AppRunner:
    """Start serving; returns the runner (call ``cleanup()`` to stop)."""
    # handler_cancellation: a client disconnect cancels the handler, as SGLang aborts.
    runner = web.AppRunner(SimServer(settings, host, port).app(), handler_cancellation=True, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    return runner
