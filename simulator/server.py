"""HTTP surface of the simulator: SGLang's endpoints and JSON shapes (see SGLANG_API.md)."""

from __future__ import annotations

import json
import time
import uuid

from aiohttp import web

from simulator.model import Engine, RequestRecord, SimSettings

WORD = "tok "


def _prompt_tokens(text: str) -> int:
    return max(1, len(text) // 4)


def _oai_error(status: int, message: str, kind: str = "BadRequestError") -> web.Response:
    # SGLang's OpenAI-compatible error body is flat, not OpenAI's nested envelope.
    body = {"object": "error", "message": message, "type": kind, "param": None, "code": status}
    return web.json_response(body, status=status)


class SimServer:
    def __init__(self, settings: SimSettings) -> None:
        self.s = settings
        self.engine = Engine(settings)

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.add_routes([
            web.post("/v1/chat/completions", self.chat),
            web.post("/generate", self.generate),
            web.get("/health", self.health),
            web.get("/health_generate", self.health),
            web.get("/v1/models", self.models),
            web.get("/get_model_info", self.model_info),
            web.get("/model_info", self.model_info),
            web.get("/sim/stats", self.sim_stats),
            web.get("/sim/requests", self.sim_requests),
        ])
        return app

    def _fault(self) -> web.Response | None:
        if self.s.error_rate and self.engine._rng.random() < self.s.error_rate:
            return _oai_error(503, "simulated overload", "ServiceUnavailableError")
        return None

    async def _run(self, rid: str, prompt_tokens: int, max_tokens: int) -> RequestRecord | web.Response:
        if prompt_tokens + max_tokens > self.s.context_length and prompt_tokens >= self.s.context_length:
            return _oai_error(400, f"The input ({prompt_tokens} tokens) is longer than the model's "
                                   f"context length ({self.s.context_length} tokens).")
        rec = RequestRecord(rid=rid, arrived=time.time(), prompt_tokens=prompt_tokens)
        self.engine.records.append(rec)
        target = self.engine.draw_length(rid, max_tokens)
        await self.engine.generate(rec, target)
        rec.finish = "length" if target >= max_tokens else "stop"
        return rec

    async def chat(self, request: web.Request) -> web.StreamResponse:
        if request.content_type != "application/json":
            return _oai_error(400, "Content-Type must be application/json")
        try:
            body = await request.json()
            messages = body["messages"]
            text = "".join(str(m.get("content", "")) for m in messages)
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            return _oai_error(400, f"invalid request: {exc}")
        if (fault := self._fault()) is not None:
            return fault
        max_tokens = body.get("max_completion_tokens") or body.get("max_tokens") or self.s.context_length
        rid = str(body.get("rid") or uuid.uuid4().hex)
        started = time.time()
        out = await self._run(rid, _prompt_tokens(text), int(max_tokens))
        if isinstance(out, web.Response):
            return out
        usage = {"prompt_tokens": out.prompt_tokens, "completion_tokens": out.completion_tokens,
                 "total_tokens": out.prompt_tokens + out.completion_tokens, "reasoning_tokens": 0,
                 "prompt_tokens_details": None}
        return web.json_response({
            "id": rid, "object": "chat.completion", "created": int(started), "model": self.s.model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": WORD * out.completion_tokens,
                                                  "reasoning_content": None, "tool_calls": None},
                         "logprobs": None, "finish_reason": out.finish, "matched_stop": None}],
            "usage": usage,
        })

    async def generate(self, request: web.Request) -> web.Response:
        try:
            body = await request.json()
        except ValueError as exc:
            return web.json_response({"error": {"message": f"invalid JSON: {exc}"}}, status=400)
        if "input_ids" in body and body["input_ids"] is not None:
            prompt_tokens = len(body["input_ids"])
        elif isinstance(body.get("text"), str):
            prompt_tokens = _prompt_tokens(body["text"])
        else:
            return web.json_response({"error": {"message": "text or input_ids required"}}, status=400)
        if (fault := self._fault()) is not None:
            return fault
        sp = body.get("sampling_params") or {}
        max_new = int(sp.get("max_new_tokens") or 128)
        rid = str(body.get("rid") or uuid.uuid4().hex)
        started = time.time()
        out = await self._run(rid, prompt_tokens, max_new)
        if isinstance(out, web.Response):
            return out
        finish = ({"type": "length", "length": out.completion_tokens} if out.finish == "length"
                  else {"type": "stop", "matched": 2})
        return web.json_response({
            "text": WORD * out.completion_tokens, "output_ids": [7] * out.completion_tokens,
            "meta_info": {"id": rid, "finish_reason": finish, "prompt_tokens": out.prompt_tokens,
                          "completion_tokens": out.completion_tokens, "cached_tokens": 0,
                          "reasoning_tokens": 0, "e2e_latency": time.time() - started},
        })

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{
            "id": self.s.model, "object": "model", "owned_by": "sglang", "root": self.s.model,
            "max_model_len": self.s.context_length}]})

    async def model_info(self, request: web.Request) -> web.Response:
        return web.json_response({"model_path": self.s.model, "tokenizer_path": self.s.model,
                                  "is_generation": True, "preferred_sampling_params": None})

    async def sim_stats(self, request: web.Request) -> web.Response:
        return web.json_response(self.engine.stats())

    async def sim_requests(self, request: web.Request) -> web.Response:
        recs = [{"rid": r.rid, "arrived": r.arrived, "finished": r.finished, "finish": r.finish,
                 "prompt_tokens": r.prompt_tokens, "completion_tokens": r.completion_tokens}
                for r in self.engine.records]
        return web.Response(text=json.dumps(recs), content_type="application/json")


async def start_sim(settings: SimSettings, host: str, port: int) -> web.AppRunner:
    """Start serving; returns the runner (call ``cleanup()`` to stop)."""
    # handler_cancellation: a client disconnect cancels the handler, as SGLang aborts.
    runner = web.AppRunner(SimServer(settings).app(), handler_cancellation=True, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    return runner
