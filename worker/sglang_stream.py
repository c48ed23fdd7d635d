"""Streamed answers (SSE), without I/O: bytes in, deltas and the final Completion out.

worker/sglang_client.py feeds what it reads from the socket into ``SSEParser`` and the events into
``StreamDecoder``; tests feed them byte by byte. What each server sends, and where it is said:

- SGLang ``/generate`` (entrypoints/http_server.py ``generate_request``): ``data: {json}\\n\\n`` per
  chunk, each with ``meta_info`` (``completion_tokens`` so far, ``finish_reason`` null until the
  last), then ``data: [DONE]``. ``text``/``output_ids`` are *cumulative* by default and the delta
  only with ``--incremental-streaming-output`` (managers/tokenizer_manager.py
  ``_handle_batch_output``); both are read here: a chunk whose ``output_ids`` are fewer than its
  ``completion_tokens`` is a delta. A ValueError after the 200 is one ``{"error": {...}}`` chunk.
- Chat (SGLang's serving_chat.py, vLLM, llama.cpp, any OpenAI-style server): ``delta`` chunks
  (``content``, ``reasoning_content`` or vLLM's ``reasoning``), one with ``finish_reason``, then
  with ``stream_options.include_usage`` a chunk with ``choices: []`` and the ``usage``; with
  ``continuous_usage_stats`` (SGLang, vLLM) every chunk carries the usage so far.

Token counts stay exact: the final ``meta_info`` or ``usage``, never a count of chunks. A stream
that ends without them is an error: retryable if it was cut, a clear one if the server never
sends a usage (then the server wants ``server.stream: false``).
"""

from __future__ import annotations

import contextvars
import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

import orjson

from budgetq.shared.errors import BadResponseError, FatalRequestError, RetryableRequestError
from budgetq.worker.sglang_wire import RETRYABLE_STATUS, Completion, check_finish, invalid_request

log = logging.getLogger("budgetq.worker")
DONE = b"[DONE]"
_OPEN, _CLOSE = "<think>", "</think>"


class Guard(Protocol):
    """Part B's LoopGuard (worker/degeneration.py) or anything with its ``feed``."""

    def feed(self, delta_text: str, tokens_so_far: int, in_reasoning: bool) -> Any: ...


@dataclasses.dataclass(frozen=True)
class Watch:
    """What the job flow wants to see of its job's streamed answers (each request of a job).

    ``guard``: a fresh guard per request (worker/degeneration.py's LoopGuard), fed every chunk's new
    text; a verdict cuts the request at the engine. ``on_progress(tokens)``: the request's tokens so
    far after each read (the end game's taper reads them, worker/tracked.py).
    """

    guard: Callable[[], Guard] | None = None
    on_progress: Callable[[int], None] | None = None


# The job being sent, as its task sees it: a context variable rather than a parameter because the
# request passes through worker/turns.py (regenerate: all sends one per user turn), which need not know.
WATCH: contextvars.ContextVar[Watch | None] = contextvars.ContextVar("budgetq_stream_watch", default=None)


class NoStreamUsage(BadResponseError):
    """A stream that ended whole but said no token counts: the server ignores stream_options.include_usage
    (llama-cpp-python's server). The client stops streaming to that endpoint (sglang_client.py)."""


class StreamCut(RetryableRequestError):
    """The stream ended before its final counts (connection closed, proxy cut): try again."""


class SSEParser:
    """Server-sent events from bytes split anywhere (a line across TCP reads, one byte at a time).

    Lines end in ``\\n`` (a ``\\r`` before it is dropped); a blank line ends an event; ``data:``
    lines join with ``\\n``; comments (``:``) and other fields are ignored. A huge line (a
    cumulative 32k-token text) is searched for its end only once: ``_scan`` remembers how far.
    """

    def __init__(self) -> None:
        self._buf = bytearray()
        self._scan = 0
        self._data: list[bytes] = []

    def feed(self, chunk: bytes) -> list[bytes]:
        buf = self._buf
        buf += chunk
        events: list[bytes] = []
        start = 0
        while True:
            end = buf.find(b"\n", max(start, self._scan))
            if end < 0:
                break
            line = bytes(buf[start:end])
            start = end + 1
            if line.endswith(b"\r"):
                line = line[:-1]
            if not line:
                if self._data:
                    events.append(b"\n".join(self._data))
                    self._data = []
            elif line.startswith(b"data:"):
                self._data.append(line[6:] if line[5:6] == b" " else line[5:])
        if start:
            del buf[:start]
        self._scan = len(buf)
        return events

    def pending(self) -> bool:
        """Bytes or data lines not yet ended by a blank line (a stream cut mid-event)."""
        return bool(self._buf) or bool(self._data)


def _think_state(window: str, inside: bool) -> bool:
    """Whether the text is inside <think> after ``window`` (the new text plus a few chars before)."""
    o, c = window.rfind(_OPEN), window.rfind(_CLOSE)
    if o < 0 and c < 0:
        return inside
    return o > c


def _error(obj: dict, url: str) -> Exception:
    """An error chunk after the 200 (SGLang: ``{"error": {message, type, code}}``): fatal when it says
    the request is invalid, retryable when its code is a transient one."""
    err = obj.get("error")
    msg = " ".join(str(err.get("message", err) if isinstance(err, dict) else err).split())[:300]
    code = err.get("code") if isinstance(err, dict) else None
    status = code if isinstance(code, int) and not isinstance(code, bool) else 400
    if status in RETRYABLE_STATUS and not invalid_request(status, obj):
        return RetryableRequestError(f"{url}: error in the stream (HTTP {status} after the 200): {msg}")
    return FatalRequestError(f"{url}: error in the stream (HTTP {status} after the 200): {msg}")


class StreamDecoder:
    """One streamed answer: every event in, deltas to ``on_delta``, the Completion at the end.

    ``on_delta(text, tokens_so_far, in_reasoning)`` returns a verdict (anything but None) to cut the
    stream; ``cut`` then holds it and ``result(cut=True)`` gives the answer so far.
    """

    def __init__(self, api: str, url: str, started: float, model: str = "", prompt_tokens: int = 0,
                 on_delta: Callable[[str, int, bool], Any] | None = None) -> None:
        self.api, self.url, self.started, self.model = api, url, started, model
        self.on_delta = on_delta
        self.text: list[str] = []
        self.reasoning: list[str] = []
        self._generated = ""          # /generate: the text so far (the cumulative chunk's prefix)
        self._incremental: bool | None = None
        self.tokens = 0               # completion tokens so far (exact when the server says)
        self._counted = False         # tokens came from the server, not from counting chunks
        self.prompt_tokens = prompt_tokens
        self.cached_tokens = 0
        self.finish: str | None = None
        self.finish_detail: dict = {}
        self.usage: dict | None = None
        self.done = False
        self.events = 0
        self._inside = False
        self.cut: Any = None

    # --- events -------------------------------------------------------------------------------
    def feed(self, events: list[bytes]) -> None:
        """Decode ``events`` (one read's worth). A cumulative /generate stream needs only the last
        chunk of a read: it holds all the earlier ones' text (and the parse is the cost)."""
        if self.api == "generate" and self._incremental is False and len(events) > 1:
            data = [e for e in events if e != DONE]
            events = data[-1:] + ([DONE] if len(data) < len(events) else [])
        for ev in events:
            if self.cut is not None:
                return
            if ev == DONE:
                self.done = True
                continue
            self.events += 1
            try:
                obj = orjson.loads(ev)
            except orjson.JSONDecodeError as exc:
                raise BadResponseError(f"{self.url}: a stream chunk is not JSON ({exc}): {ev[:200]!r}") from None
            if not isinstance(obj, dict):
                raise BadResponseError(f"{self.url}: a stream chunk is not a JSON object: {ev[:200]!r}")
            if "error" in obj and obj.get("error") is not None:
                raise _error(obj, self.url)
            try:
                self._generate(obj) if self.api == "generate" else self._chat(obj)
            except (KeyError, IndexError, TypeError, ValueError, AttributeError) as exc:
                raise BadResponseError(f"unexpected stream chunk from {self.url}: {exc!r}: {ev[:300]!r}") from exc

    def _generate(self, obj: dict) -> None:
        meta = obj["meta_info"]
        text = obj.get("text") or ""
        ct = meta.get("completion_tokens")
        ids = obj.get("output_ids")
        fr = meta.get("finish_reason")
        if fr is not None:
            self.finish_detail = fr if isinstance(fr, dict) else {}
            self.finish = str(fr.get("type") if isinstance(fr, dict) else fr)
            if self.finish not in ("stop", "length"):
                return   # an abort: its text is not read (SGLang's abort chunk holds the whole text
                #          even with incremental output: tokenizer_manager ``_handle_abort_req``)
        if self._incremental is None:   # decided at the first chunk that tells (the first one cannot)
            if isinstance(ids, list) and isinstance(ct, int) and ct > 0:
                if len(ids) < ct:
                    self._incremental = True
                elif self._generated:
                    self._incremental = False
            elif self._generated:   # no output_ids (a proxy dropped them): the text says
                self._incremental = not text.startswith(self._generated)
        if self._incremental:
            delta = text
            self._generated += text
        else:
            delta = text[len(self._generated):]
            self._generated = text
        if isinstance(ct, int):
            self.tokens, self._counted = ct, True
        if isinstance(meta.get("prompt_tokens"), int):
            self.prompt_tokens = meta["prompt_tokens"]
        self.cached_tokens = int(meta.get("cached_tokens") or 0)
        if delta:
            self._inside = _think_state(self._generated[-len(delta) - len(_CLOSE):], self._inside)
            self._deliver(delta, self._inside)

    def _chat(self, obj: dict) -> None:
        usage = obj.get("usage")
        choices = obj.get("choices") or []
        if isinstance(usage, dict):
            self.usage = usage
            self.tokens, self._counted = int(usage["completion_tokens"]), True
            self.prompt_tokens = int(usage.get("prompt_tokens") or self.prompt_tokens)
            self.cached_tokens = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
        for choice in choices:
            if choice.get("index", 0) != 0:
                continue
            delta = choice.get("delta") or {}
            reasoning = delta.get("reasoning_content") or delta.get("reasoning") or ""
            content = delta.get("content") or ""
            if (reasoning or content) and not isinstance(usage, dict) and not self._counted:
                self.tokens += 1   # an estimate until the usage comes: a chunk is at least a token
            if choice.get("finish_reason") is not None:
                self.finish = str(choice["finish_reason"])
            if reasoning:
                self.reasoning.append(reasoning)
                self._deliver(reasoning, True)
            if content:
                self.text.append(content)
                self._deliver(content, False)

    def _deliver(self, delta: str, in_reasoning: bool) -> None:
        if self.on_delta is None or self.cut is not None:
            return
        try:
            self.cut = self.on_delta(delta, self.tokens, in_reasoning)
        except Exception:  # noqa: BLE001 - a guard's bug must not fail the answer it watches
            log.exception("%s: the stream's guard failed: it is off for the rest of this answer", self.url)
            self.on_delta = None

    # --- the end ------------------------------------------------------------------------------
    def result(self, cut: bool = False) -> Completion:
        """The answer: exact counts, or the error that says why there are none."""
        latency = time.monotonic() - self.started
        reasoning = "".join(self.reasoning) if self.api == "chat" and self.reasoning else None
        if self.api == "generate":
            text = self._generated
        else:
            text = "".join(self.text)
        if cut:
            return Completion(text, reasoning, self.prompt_tokens, self.tokens, "abort", self.url, latency,
                              self.cached_tokens, model=self.model)
        if self.finish is None:
            raise StreamCut(f"{self.url}: the stream ended after {self.events} chunks ({self.tokens} tokens) "
                            f"without its final chunk{'' if self.done else ' or [DONE]'}")
        check_finish(self.finish, self.finish_detail, self.url)
        if self.api == "chat" and self.usage is None:
            if not self.done:
                raise StreamCut(f"{self.url}: the stream ended after its finish_reason without the usage chunk "
                                "or [DONE]")
            raise NoStreamUsage(f"{self.url}: the streamed answer carried no token counts (no usage chunk for "
                                "stream_options.include_usage): set server.stream: false for this server")
        if self.api == "chat":
            self.tokens = int(self.usage["completion_tokens"]) if self.usage else self.tokens
        return Completion(text, reasoning, self.prompt_tokens, self.tokens, self.finish, self.url, latency,
                          self.cached_tokens, model=self.model)


def verdict_details(guard: Any, verdict: Any) -> tuple[str, dict]:
    """(reason, details) of a guard's verdict, for ``Completion.discard``."""
    reason = str(getattr(verdict, "reason", verdict))
    for source in (verdict, guard):
        details = getattr(source, "details", None)
        if callable(details):
            out = details()
            if isinstance(out, dict):
                return reason, out
    if dataclasses.is_dataclass(verdict) and not isinstance(verdict, type):
        return reason, dataclasses.asdict(verdict)
    return reason, {}
