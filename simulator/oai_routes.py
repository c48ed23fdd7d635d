"""POST /v1/chat/completions and /v1/completions with SGLang's shapes (see SGLANG_API.md)."""

from __future__ import annotations

import json
import time
import uuid
from http import HTTPStatus

from aiohttp import web

from budgetq.simulator.faults import ERROR_TYPES
from budgetq.simulator.model import RequestRecord, SimSettings
from budgetq.simulator.runner import (
    MATCHED_STOP,
    WEIGHT_VERSION,
    BadRequest,
    Item,
    Runner,
    close_sse,
    drop_connection,
    error_json,
    json_object,
    open_sse,
    opt_int,
    sse,
)
from budgetq.simulator.sampling import SamplingError, chat_sampling, verify
from budgetq.simulator.texts import Script, content_text, estimate_tokens

_FINISH = {"stop": "stop", "length": "length", "abort": "abort"}


def oai_error(exc: BadRequest) -> web.Response:
    # SGLang's OpenAI-compatible error body is flat (protocol.ErrorResponse), not OpenAI's envelope.
    # A ValueError (context, sampling, duplicate rid) -> "BadRequestError" (serving_chat's
    # create_error_response); an HTTPException (queue full) -> type str(status) (serving_base);
    # a body FastAPI cannot parse into the request model -> "Bad Request" (http_server's
    # RequestValidationError handler).
    if exc.kind == "overload":
        kind = str(exc.status)
    elif exc.kind in ("content_type", "validation"):
        kind = "Bad Request"
    else:
        kind = ERROR_TYPES.get(exc.status, "BadRequestError")
    body = {"object": "error", "message": exc.message, "type": kind, "param": None, "code": exc.status}
    return error_json(body, exc.status)   # an ORJSONResponse, as SGLang's (runner.error_json)


async def stream_overload(request: web.Request, exc: BadRequest) -> web.StreamResponse:
    """Queue full on a streamed chat: the abort carries an HTTPStatus, so serving_chat's stream loop
    writes one error chunk, ``{"error": ErrorResponse}`` with type ``code.name`` and serialized by
    ``json.dumps`` (spaces after separators, unlike the other chunks), then [DONE]
    (serving_chat ``_generate_chat_stream``, serving_base ``create_streaming_error_response``)."""
    resp = await open_sse(request)
    error = {"object": "error", "message": exc.message, "type": HTTPStatus(exc.status).name, "param": None,
             "code": exc.status}
    await resp.write(f"data: {json.dumps({'error': error})}\n\n".encode())
    return await close_sse(resp)


async def oai_body(request: web.Request) -> dict:
    if request.content_type != "application/json":
        # http_server.validate_json_request -> RequestValidationError -> 400 "Bad Request".
        # (FastAPI's str() of the error list around it is not reproduced.)
        raise BadRequest("Unsupported Media Type: Only 'application/json' is allowed", kind="content_type")
    return await json_object(request)




def _usage(recs: list[RequestRecord], cache_report: bool = False) -> dict:
    # protocol.UsageInfo's keys in its order (usage_processor.calculate_token_usage).
    # prompt_tokens_details only with --enable-cache-report (calculate_response_usage).
    return _usage_of(sum(r.prompt_tokens for r in recs), sum(r.completion_tokens for r in recs),
                     sum(min(r.completion_tokens, r.reasoning_target) for r in recs),
                     sum(r.cached_tokens for r in recs) if cache_report else None)


def _usage_of(prompt: int, completion: int, reasoning: int, cached: int | None) -> dict:
    return {"prompt_tokens": prompt, "total_tokens": prompt + completion, "completion_tokens": completion,
            "prompt_tokens_details": {"cached_tokens": cached} if cached is not None else None,
            "reasoning_tokens": reasoning,
            "completion_tokens_details": {"reasoning_tokens": reasoning} if reasoning else None}


_METADATA = {"weight_version": WEIGHT_VERSION}   # weight_versions.build_endpoint_weight_version_metadata


def _matched(rec: RequestRecord) -> int | None:
    return MATCHED_STOP if rec.finish == "stop" else None


class OpenAIRoutes:
    def __init__(self, settings: SimSettings, runner: Runner) -> None:
        self.s = settings
        self.runner = runner

    def _model(self, body: dict) -> str:
        return str(body.get("model") or self.s.model)

    # --- chat -----------------------------------------------------------------------------------

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body: dict = {}
        try:
            body = await oai_body(request)
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages:
                raise BadRequest("messages must be a non-empty list")
            try:
                text = "".join(content_text(m.get("content")) for m in messages)
            except (AttributeError, ValueError) as exc:
                raise BadRequest(f"invalid messages: {exc}") from exc
            # to_sampling_params: max_completion_tokens or max_tokens (deprecated); other names are
            # ignored (ChatCompletionRequest has pydantic's default extra="ignore").
            max_tokens = opt_int(body, "max_completion_tokens") or opt_int(body, "max_tokens")
            kwargs = body.get("chat_template_kwargs") or {}
            thinking = kwargs.get("enable_thinking", kwargs.get("thinking", True)) is not False
            separate = bool(self.s.reasoning_parser) and body.get("separate_reasoning", True) is not False
            if (err := self.runner.injected_error()) is not None:
                raise err
            item = Item(_rid(body), estimate_tokens(text), max_tokens, "chat", thinking=thinking, prompt=text)
            self.runner.check_context(item)
            item.sampling = chat_sampling(body, self.s.generation_config)
            try:
                verify(item.sampling)
            except SamplingError as exc:
                raise BadRequest(str(exc), kind="sampling") from exc
            [rec] = await self.runner.start([item])
        except BadRequest as exc:
            if body.get("stream") and exc.kind == "overload":
                return await stream_overload(request, exc)
            return oai_error(exc)
        if body.get("stream"):
            opts = body.get("stream_options") or {}
            return await self._chat_stream(request, rec, self._model(body), separate, bool(opts.get("include_usage")),
                                           bool(opts.get("continuous_usage_stats")))
        await self.runner.wait_all([rec], request)
        reasoning, content = _chat_texts(rec, rec.completion_tokens, separate)
        return web.json_response({
            "id": rec.rid, "object": "chat.completion", "created": int(time.time()), "model": self._model(body),
            "choices": [{"index": 0, "message": {"role": "assistant", "content": content,
                                                  "reasoning_content": reasoning},
                         "logprobs": None, "finish_reason": _FINISH[rec.finish], "matched_stop": _matched(rec)}],
            "usage": _usage([rec], self.s.enable_cache_report), "metadata": _METADATA,
        })

    async def _chat_stream(self, request: web.Request, rec: RequestRecord, model: str, separate: bool,
                           include_usage: bool, continuous: bool = False) -> web.StreamResponse:
        created = int(time.time())

        def chunk(delta: dict, finish: str | None = None, matched: int | None = None,
                  tokens: int | None = None) -> bytes:
            # stream_options.continuous_usage_stats: the usage so far on every reasoning or content delta, not
            # on the role or finish chunks (serving_chat ``_generate_stream_content``: calculate_token_usage).
            usage = None
            if continuous and tokens is not None:
                usage = _usage_of(rec.prompt_tokens, tokens, min(tokens, rec.reasoning_target),
                                  rec.cached_tokens if self.s.enable_cache_report else None)
            return sse({"id": rec.rid, "object": "chat.completion.chunk", "created": created, "model": model,
                        "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish,
                                     "matched_stop": matched}], "usage": usage})

        try:
            with self.runner.aborting([rec], stream=True):
                resp = await open_sse(request)
                # DeltaMessage drops tool_calls when it is None (ChatCompletionResponseStreamChoice._serialize).
                await resp.write(chunk({"role": "assistant", "content": "", "reasoning_content": None}))
                sent_r, sent_c = "", ""
                async for k, final in self.runner.progress(rec):
                    if final and (rec.cut or rec.finish == "drop"):
                        await drop_connection(request)
                    reasoning, content = _chat_texts(rec, k, separate)
                    reasoning = reasoning or ""
                    d_r, d_c = reasoning[len(sent_r):], content[len(sent_c):]
                    if d_r or d_c:
                        await resp.write(chunk({"role": None, "content": d_c or None, "reasoning_content": d_r or None},
                                               tokens=k))
                        sent_r, sent_c = reasoning, content
                await resp.write(chunk({"role": None, "content": None, "reasoning_content": None},
                                       _FINISH[rec.finish], _matched(rec)))
                if include_usage:
                    await resp.write(sse({"id": rec.rid, "object": "chat.completion.chunk", "created": created,
                                          "model": model, "choices": [],
                                          "usage": _usage([rec], self.s.enable_cache_report)}))
                return await close_sse(resp)
        except ConnectionResetError:
            # The client went away mid-stream (its requests aborted when SGLang would notice): nothing
            # more to write, and no error to log, as SGLang logs none.
            return web.Response(status=499)

    # --- completions ----------------------------------------------------------------------------

    async def completions(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await oai_body(request)
            prompts = _prompts(body.get("prompt"))
            max_tokens = opt_int(body, "max_tokens")
            max_tokens = 16 if max_tokens is None else max_tokens
            rids = _rids(body.get("rid"), len(prompts))
            if (err := self.runner.injected_error()) is not None:
                raise err
            items = []
            for prompt, rid in zip(prompts, rids, strict=True):
                items.append(self.runner.prompt_item(rid, prompt, max_tokens, "completions"))
            recs = await self.runner.start(items)
        except BadRequest as exc:
            return oai_error(exc)
        model = self._model(body)
        if body.get("stream"):
            include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
            return await self._completions_stream(request, recs, model, include_usage)
        await self.runner.wait_all(recs, request)
        return web.json_response({
            "id": recs[0].rid if len(recs) == 1 else uuid.uuid4().hex, "object": "text_completion",
            "created": int(time.time()), "model": model,
            "choices": [{"index": i, "text": _script(r).inline(r.completion_tokens), "logprobs": None,
                         "finish_reason": _FINISH[r.finish], "matched_stop": _matched(r)} for i, r in enumerate(recs)],
            "usage": _usage(recs, self.s.enable_cache_report), "metadata": _METADATA,
        })

    async def _completions_stream(self, request: web.Request, recs: list[RequestRecord], model: str,
                                  include_usage: bool) -> web.StreamResponse:
        created = int(time.time())
        cid = recs[0].rid if len(recs) == 1 else uuid.uuid4().hex

        def chunk(i: int, text: str, finish: str | None = None, matched: int | None = None) -> bytes:
            return sse({"id": cid, "object": "text_completion", "created": created, "model": model,
                         "choices": [{"index": i, "text": text, "logprobs": None, "finish_reason": finish,
                                      "matched_stop": matched}], "usage": None})

        try:
            with self.runner.aborting(recs, stream=True):
                resp = await open_sse(request)
                sent = [""] * len(recs)
                async for i, k, final in self.runner.progress_all(recs):
                    rec = recs[i]
                    if final and (rec.cut or rec.finish == "drop"):
                        await drop_connection(request)
                    text = _script(rec).inline(k)
                    delta, sent[i] = text[len(sent[i]):], text
                    if final:
                        await resp.write(chunk(i, delta, _FINISH[rec.finish], _matched(rec)))
                    elif delta:
                        await resp.write(chunk(i, delta))
                if include_usage:
                    await resp.write(sse({"id": cid, "object": "text_completion", "created": created, "model": model,
                                          "choices": [], "usage": _usage(recs, self.s.enable_cache_report)}))
                return await close_sse(resp)
        except ConnectionResetError:
            # The client went away mid-stream (its requests aborted when SGLang would notice): nothing
            # more to write, and no error to log, as SGLang logs none.
            return web.Response(status=499)


def _script(rec: RequestRecord) -> Script:
    assert rec.script is not None   # the runner gives every request one
    return rec.script


def _chat_texts(rec: RequestRecord, tokens: int, separate: bool) -> tuple[str | None, str]:
    if separate:
        return _script(rec).separated(tokens)
    return None, _script(rec).inline(tokens)


def _rid(body: dict) -> str | None:
    rid = body.get("rid")
    if rid is not None and not isinstance(rid, str):
        raise BadRequest(f"rid must be a string, got {rid!r}")
    return rid or None


def _rids(rid: object, n: int) -> list[str | None]:
    """One rid per prompt: a list as given, or a string (suffixed -i when there are several prompts)."""
    if rid is None:
        return [None] * n
    if isinstance(rid, list):
        if len(rid) != n or not all(isinstance(r, str) for r in rid):
            raise BadRequest(f"rid must be a list of {n} strings (one per prompt), got {rid!r}")
        return rid
    if isinstance(rid, str):
        return [rid] if n == 1 else [f"{rid}-{i}" for i in range(n)]
    raise BadRequest(f"rid must be a string or a list of strings, got {rid!r}")


def _prompts(prompt: object) -> list[str | list[int]]:
    """/v1/completions ``prompt``: a string, a list of strings, token ids, or a list of token-id lists."""
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return list(prompt)
        if all(isinstance(p, int) and not isinstance(p, bool) for p in prompt):
            return [prompt]
        if all(isinstance(p, list) and p and all(isinstance(t, int) for t in p) for p in prompt):
            return list(prompt)
    raise BadRequest("prompt must be a string, a list of strings, a list of token ids or a list of such lists")
