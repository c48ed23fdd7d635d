"""SGLang's wire format, without I/O: rids, request bodies, and responses read into a Completion.

worker/sglang_client.py (the one HTTP client) sends what this builds and reads what comes back
through it; tests, the conformance check and the benchmarks use these functions directly.
"""

from __future__ import annotations

import re
import secrets
import time
from dataclasses import dataclass

from budgetq.shared.config import ServerConfig
from budgetq.shared.errors import AbortedResponseError, BadResponseError, FatalRequestError
from budgetq.shared.sampling import explicit
from budgetq.shared.schema import JobPayload
from budgetq.shared.server_kind import SGLANG_MODEL

# HTTP statuses worth another attempt (the client retries them; an abort carrying one is retried too).
RETRYABLE_STATUS = {408, 429, 500, 502, 503, 504}
# The endings that are a real answer; anything else (abort, or an unknown type) is not kept.
_KEPT_FINISH = {"stop", "length"}
RID_SEPARATOR = "."  # RQ job ids never contain it (letters, digits, '_' and '-' only)
_NONCE_HEX = 12


def attempt_rid(job_id: str, turn: int = 1) -> str:
    """A fresh SGLang rid for one attempt of a job: ``<job id>.<12 hex>``.

    SGLang aborts by rid *prefix* (scheduler: ``req.rid.startswith(rid)``), on /abort_request
    and on disconnect. A fixed-width nonce after a separator no job id contains means no rid
    is ever a prefix of another one (``C-c1.<n>`` cannot start ``C-c10.<n>``), and a retry
    never reuses an rid the server may still hold.

    regenerate: all sends one request per user turn; turns after the first are
    ``<job id>.t<turn>.<12 hex>``. Still no rid is a prefix of another: after ``<job id>.``
    comes either a hex digit or ``t`` (never hex), after ``t<turn>`` a separator (never a
    digit), and the nonce is fixed-width. The simulator draws lengths per rid without the
    nonce (simulator/lengths.py), so each turn gets its own length, the same on every retry.
    """
    nonce = secrets.token_hex(_NONCE_HEX // 2)
    if turn == 1:
        return f"{job_id}{RID_SEPARATOR}{nonce}"
    return f"{job_id}{RID_SEPARATOR}t{turn}{RID_SEPARATOR}{nonce}"


def job_id_of_rid(rid: str) -> str:
    return rid.split(RID_SEPARATOR, 1)[0]


@dataclass(frozen=True)
class Completion:
    text: str
    reasoning: str | None
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str
    endpoint: str
    latency_s: float
    # Prompt tokens the server found in its prefix cache (SGLang: meta_info.cached_tokens on
    # /generate; usage.prompt_tokens_details.cached_tokens on chat with --enable-cache-report).
    cached_tokens: int = 0
    model: str = ""             # the model name the request carried (the row's "model")
    # features.vllm.single_pass: the file vLLM wrote this request's hidden states to (its kv_transfer_params).
    hidden_states_file: str | None = None
    # (reason, details) when a guard cut the stream (worker/degeneration.py's LoopGuard): the answer so
    # far, finish_reason "abort", its tokens counted (it was generated) but never a kept row.
    discard: tuple[str, dict] | None = None


_THINK = re.compile(r"^\s*<think>(.*?)</think>\s*", re.DOTALL)


def split_thinking(out: Completion) -> tuple[str, str | None]:
    """(answer, thinking): from the server's reasoning parser, or from inline <think> tags."""
    if out.reasoning is not None:
        return out.text, out.reasoning
    m = _THINK.match(out.text)
    if m:
        return out.text[m.end():], m.group(1).strip()
    return out.text, None


def error_message(body: object) -> str:
    if isinstance(body, dict):
        err = body.get("error", body)
        if isinstance(err, dict):
            return str(err.get("message", err))
        if isinstance(body.get("message"), str):
            return body["message"]
        return str(err)
    return str(body)[:500]


# What a server's error body says when the request itself is refused (not a transient fault):
# OpenAI's and SGLang's ``invalid_request_error`` / ``BadRequestError`` types, and the pydantic
# validation text a FastAPI server wraps into a 500 (llama-cpp-python's RouteErrorHandler turns
# a RequestValidationError into ``{"error": {"message": "[{'type': 'greater_than_equal', 'loc':
# ('body', 'top_k'), 'msg': 'Input should be ...'}]", "type": "internal_server_error"}}``).
_INVALID_TYPES = {"invalid_request_error", "badrequesterror", "validation_error", "invalid_request"}
_INVALID_TEXT = re.compile(r"'loc': \('body'|\bvalidation errors? for\b|\bInput should be\b|"
                           r"\bextra_forbidden\b|\bfield required\b", re.IGNORECASE)


def invalid_request(status: int, body: object) -> bool:
    """Whether an error answer says the request itself is invalid: retrying it cannot help."""
    if status in (400, 413, 422):
        return True
    if not 400 <= status < 600:
        return False
    if isinstance(body, dict):
        if isinstance(body.get("detail"), list):  # FastAPI's own 422 shape, behind a proxy that changed the status
            return True
        err = body.get("error", body)
        if isinstance(err, dict) and str(err.get("type", "")).lower() in _INVALID_TYPES:
            return True
    return bool(_INVALID_TEXT.search(error_message(body)))


def build_request(server: ServerConfig, payload: JobPayload, rid: str, sglang: bool = True,
                  model: str | None = None, stream: bool = False, continuous_usage: bool = False) -> tuple[str, dict]:
    """Path and JSON body of one request, in SGLang's terms (``sglang``) or plain OpenAI ones.

    SGLang gets the same explicit sampling on both APIs (shared/sampling.py: its chat route
    would otherwise fill unset fields from the model's generation_config, /generate would not),
    and its own fields (rid, max_completion_tokens). Another OpenAI-style server gets the
    standard fields only, sampling fields only where set, and the token limit under both of
    OpenAI's names: llama.cpp's server reads ``max_tokens`` (it ignores max_completion_tokens
    and would generate to its context's end), newer servers ``max_completion_tokens``.
    ``model``: the endpoint's model name (``Endpoint.model``); else ``server.model`` or ``default``.
    ``stream``: SSE (worker/sglang_stream.py); chat then asks for the final usage chunk
    (``stream_options.include_usage``: the exact counts) and, with ``continuous_usage`` (SGLang, vLLM:
    ``continuous_usage_stats``), the tokens so far on every chunk.
    """
    sp = payload.sampling
    params: dict = dict(explicit(sp, sglang))
    if sp.stop is not None:
        params["stop"] = sp.stop
    if server.api == "chat":
        body: dict = {"model": model or server.model or SGLANG_MODEL,
                      "messages": [m.model_dump() for m in payload.messages]}
        if sglang:
            body.update({"max_completion_tokens": sp.max_tokens, **params, "rid": rid, "stream": stream})
        else:
            body.update({"max_tokens": sp.max_tokens, "max_completion_tokens": sp.max_tokens, **params,
                         "stream": stream})
        if stream:
            body["stream_options"] = {"include_usage": True, **({"continuous_usage_stats": True}
                                                               if continuous_usage else {})}
        if sp.seed is not None:
            body["seed"] = sp.seed
        if payload.chat_template_kwargs:
            body["chat_template_kwargs"] = payload.chat_template_kwargs
        if payload.hidden_states_dir is not None and not sglang:
            body["kv_transfer_params"] = engine_file_params(payload.hidden_states_dir, rid)
        body.update(sp.extra)
        return "/v1/chat/completions", body
    params["max_new_tokens"] = sp.max_tokens
    if sp.seed is not None:
        params["sampling_seed"] = sp.seed
    params.update(sp.extra)
    more = {"stream": True} if stream else {}
    if payload.input_ids is not None:
        return "/generate", {"input_ids": payload.input_ids, "rid": rid, "sampling_params": params, **more}
    # No tokenizer (a job enqueued by hand): a plain-text transcript.
    text = "".join(f"{m.role}: {m.content}\n" for m in payload.messages) + "assistant: "
    return "/generate", {"text": text, "rid": rid, "sampling_params": params, **more}


def engine_file_params(directory: str, rid: str) -> dict:
    """features.vllm.single_pass: vLLM's ``kv_transfer_params`` asking the engine (started with ``budgetq features
    --server-flags``) to write this request's hidden states, prompt *and* answer (``include_output_tokens``), to a
    file named by the attempt's rid (fresh per attempt: two attempts of a job never write the same file;
    ExampleHiddenStatesConnector reads both keys per request)."""
    return {"hidden_states_path": f"{directory.rstrip('/')}/{rid}.safetensors", "include_output_tokens": True}


def _engine_file(body: dict) -> str | None:
    params = body.get("kv_transfer_params")
    path = params.get("hidden_states_path") if isinstance(params, dict) else None
    return path if isinstance(path, str) and path else None


def check_finish(kind: str, detail: dict, url: str) -> None:
    """A response that did not end in stop/length is not a result: never commit it.

    SGLang answers 200 with ``finish_reason`` abort when a request was aborted without an
    error status (another request's prefix abort, /abort_request, the server shutting down):
    the same prompt may succeed again, so it is retried with a fresh rid. An abort that
    carries a 4xx status is the server refusing the request: it fails with its message.
    """
    if kind in _KEPT_FINISH:
        return
    message = str(detail.get("message") or f"finish_reason {kind!r}")[:300]
    status = detail.get("status_code")
    if kind == "abort" and not (isinstance(status, int) and 400 <= status < 500 and status not in RETRYABLE_STATUS):
        raise AbortedResponseError(f"{url}: the server aborted the request: {message}")
    raise FatalRequestError(f"{url}: the request ended with finish_reason {kind!r}: {message}")


def parse_response(api: str, body: dict, url: str, started: float) -> Completion:
    try:
        if api == "chat":
            choice = body["choices"][0]
            usage = body["usage"]
            msg = choice["message"]
            kind = str(choice["finish_reason"])
            out = Completion(msg.get("content") or "", msg.get("reasoning_content"), int(usage["prompt_tokens"]),
                             int(usage["completion_tokens"]), kind, url, time.monotonic() - started,
                             int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0),
                             hidden_states_file=_engine_file(body))
            detail: dict = {}
        else:
            meta = body["meta_info"]
            fr = meta["finish_reason"]
            detail = fr if isinstance(fr, dict) else {}
            kind = str(fr.get("type") if isinstance(fr, dict) else fr)
            out = Completion(body["text"], None, int(meta["prompt_tokens"]), int(meta["completion_tokens"]),
                             kind, url, time.monotonic() - started, int(meta.get("cached_tokens") or 0))
    except (KeyError, IndexError, TypeError, ValueError, AttributeError) as exc:
        raise BadResponseError(f"unexpected response from {url}: {exc!r}: {str(body)[:300]}") from exc
    check_finish(kind, detail, url)
    return out


# Hidden states: one prefill-only /generate per sample (hidden_states/capture/features_worker.py).
@dataclass(frozen=True)
class RawResponse:
    """A /generate answer left as bytes: a hidden-state response is ~150 MB of JSON for 4k tokens
    x 4096, parsed in a worker process (hidden_states/capture/decode.py), never on the event loop."""

    body: bytes
    endpoint: str
    latency_s: float


def prefill_body(input_ids: list[int], rid: str, mode: bool | str = True) -> dict:
    """The whole conversation as input_ids, hidden states on, one token generated (the prefill
    is the work; SGLang's max_new_tokens must be >= 0, sampling/sampling_params.py ``verify``, and
    the prefill's [len(input_ids)][hidden] block is what comes back:
    scheduler_components/batch_result_processor.py ``_append_prefill_hidden_states``)."""
    return {"input_ids": input_ids, "rid": rid, "return_hidden_states": mode,
            "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}}
