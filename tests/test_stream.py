"""Streamed answers without a server: SSE bytes split anywhere, SGLang's /generate (cumulative and
incremental) and OpenAI-style chat chunks in, exact counts and the text out (worker/sglang_stream.py).

The chunks are the shapes SGLang 0.5.23 sends (tokenizer_manager ``_handle_batch_output`` /
``_wait_one_response``, serving_chat ``_generate_chat_stream``); test_stream_sim.py runs the same
decoder against ``budgetq sim`` over HTTP, test_sglang_conformance.py checks them against SGLang's models.
"""

from __future__ import annotations

import json

import pytest

from budgetq.shared.errors import AbortedResponseError, BadResponseError, FatalRequestError, RetryableRequestError
from budgetq.worker.sglang_stream import SSEParser, StreamCut, StreamDecoder

URL = "http://sim"


def sse(obj: object) -> bytes:
    return b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + b"\n\n"


def generate_chunks(words: list[str], incremental: bool, interval: int = 1, finish: str = "stop",
                    think: int = 0) -> list[bytes]:
    """A /generate stream of ``words`` (one token each) as SGLang writes it: a chunk at token 1, then every
    ``interval`` (scheduler: ``len(output_ids) % interval == 1``), the last with its finish_reason, then [DONE]."""
    def text(a: int, b: int) -> str:
        out = ""
        for i in range(a, b):
            if i == 0 and think:
                out += "<think>"
            if i == think and think:
                out += "</think>"
            out += words[i] + " "
        return out

    n = len(words)
    points = [k for k in range(1, n) if (k % interval == 1 if interval > 1 else True)] + [n]
    chunks, sent = [], 0
    for k in points:
        start = sent if incremental else 0
        final = k == n
        fr = {"type": "stop", "matched": 2} if finish == "stop" else {"type": "length", "length": n}
        meta = {"id": "r1", "finish_reason": fr if final else None, "prompt_tokens": 5, "weight_version": "default",
                "num_retractions": 0, "reasoning_tokens": 0, "completion_tokens": k, "cached_tokens": 2}
        chunks.append(sse({"text": text(start, k), "output_ids": list(range(100 + start, 100 + k)), "meta_info": meta}))
        sent = k
    return [*chunks, b"data: [DONE]\n\n"]


def chat_chunks(reasoning: list[str], content: list[str], usage: bool = True, continuous: bool = False,
                finish: str = "stop") -> list[bytes]:
    def chunk(delta: dict, fr: str | None = None, k: int = 0) -> bytes:
        u = {"prompt_tokens": 5, "total_tokens": 5 + k, "completion_tokens": k} if continuous else None
        return sse({"id": "r1", "object": "chat.completion.chunk", "choices": [
            {"index": 0, "delta": delta, "logprobs": None, "finish_reason": fr, "matched_stop": None}], "usage": u})

    out = [chunk({"role": "assistant", "content": "", "reasoning_content": None})]
    k = 0
    for w in reasoning:
        k += 1
        out.append(chunk({"role": None, "content": None, "reasoning_content": w + " "}, k=k))
    for w in content:
        k += 1
        out.append(chunk({"role": None, "content": w + " ", "reasoning_content": None}, k=k))
    out.append(chunk({"role": None, "content": None, "reasoning_content": None}, finish, k=k))
    if usage:
        out.append(sse({"id": "r1", "object": "chat.completion.chunk", "choices": [],
                        "usage": {"prompt_tokens": 5, "total_tokens": 5 + k, "completion_tokens": k,
                                  "prompt_tokens_details": {"cached_tokens": 3}}}))
    return [*out, b"data: [DONE]\n\n"]


def split(stream: bytes, how: str) -> list[bytes]:
    """The same bytes as the socket may deliver them: one byte a read, odd-sized reads, or all at once."""
    if how == "bytes":
        return [stream[i:i + 1] for i in range(len(stream))]
    if how == "odd":
        out, i, step = [], 0, 1
        while i < len(stream):
            out.append(stream[i:i + step])
            i, step = i + step, step % 97 + 13
        return out
    return [stream]


def decode(api: str, pieces: list[bytes], on_delta=None):
    dec = StreamDecoder(api, URL, 0.0, "m", on_delta=on_delta)
    parser = SSEParser()
    for p in pieces:
        events = parser.feed(p)
        if events:
            dec.feed(events)
        if dec.cut is not None or dec.done:
            break
    return dec


WORDS = [f"w{i % 7}x{i}" for i in range(40)]


@pytest.mark.parametrize("how", ["bytes", "odd", "all"])
@pytest.mark.parametrize("incremental", [False, True])
@pytest.mark.parametrize("interval", [1, 4])
def test_generate_text_and_counts_are_exact_cumulative_or_incremental_however_the_bytes_arrive(how, incremental,
                                                                                            interval):
    stream = b"".join(generate_chunks(WORDS, incremental, interval, think=5))
    deltas: list[tuple[str, int, bool]] = []
    dec = decode("generate", split(stream, how), on_delta=lambda d, k, r: deltas.append((d, k, r)))
    out = dec.result()
    want = "<think>" + " ".join(WORDS[:5]) + " </think>" + " ".join(WORDS[5:]) + " "
    assert out.text == want and "".join(d for d, _k, _r in deltas) == want
    assert (out.completion_tokens, out.prompt_tokens, out.cached_tokens, out.finish_reason) == (40, 5, 2, "stop")
    # Progress is the server's count, never decreasing; the reasoning flag follows the think tags.
    counts = [k for _d, k, _r in deltas]
    assert counts == sorted(counts) and counts[-1] == 40
    assert deltas[0][2] is True and deltas[-1][2] is False


@pytest.mark.parametrize("how", ["bytes", "odd", "all"])
@pytest.mark.parametrize("continuous", [False, True])
def test_chat_deltas_reasoning_and_the_final_usage_chunk(how, continuous):
    stream = b"".join(chat_chunks(["r1", "r2"], ["a1", "a2", "a3"], continuous=continuous))
    seen: list[tuple[str, bool]] = []
    progress: list[int] = []

    def on_delta(delta: str, tokens: int, in_reasoning: bool) -> None:
        seen.append((delta, in_reasoning))
        progress.append(tokens)

    dec = decode("chat", split(stream, how), on_delta=on_delta)
    out = dec.result()
    assert (out.text, out.reasoning) == ("a1 a2 a3 ", "r1 r2 ")
    assert (out.completion_tokens, out.prompt_tokens, out.cached_tokens) == (5, 5, 3)
    assert seen == [("r1 ", True), ("r2 ", True), ("a1 ", False), ("a2 ", False), ("a3 ", False)]
    assert progress == [1, 2, 3, 4, 5]


def test_chat_without_a_usage_chunk_is_a_clear_error_naming_server_stream_false():
    stream = b"".join(chat_chunks([], ["a1", "a2"], usage=False))
    dec = decode("chat", [stream])
    with pytest.raises(BadResponseError, match="server.stream: false"):
        dec.result()


@pytest.mark.parametrize("api", ["generate", "chat"])
def test_a_stream_cut_before_its_final_chunk_is_retryable(api):
    chunks = generate_chunks(WORDS, False) if api == "generate" else chat_chunks([], ["a", "b", "c"])
    stream = b"".join(chunks[:-3])   # neither the final chunk nor [DONE]
    dec = decode(api, split(stream, "odd"))
    with pytest.raises(StreamCut, match="without its final chunk"):
        dec.result()
    assert isinstance(StreamCut("x"), RetryableRequestError)


def test_an_error_after_the_200_fails_or_retries_by_its_code():
    # http_server.generate_request: a ValueError in the stream is one {"error": {...}} event, then [DONE].
    bad = sse({"error": {"message": "The input (9 tokens) is longer than the model's context length"}})
    with pytest.raises(FatalRequestError, match="after the 200.*context length"):
        decode("generate", [bad, b"data: [DONE]\n\n"])
    # serving_chat's streaming error (create_streaming_error_response) with a transient code.
    busy = sse({"error": {"object": "error", "message": "overloaded", "type": "ServiceUnavailableError", "code": 503}})
    with pytest.raises(RetryableRequestError, match="HTTP 503 after the 200"):
        decode("chat", [busy, b"data: [DONE]\n\n"])


def test_an_abort_mid_stream_is_retried_not_kept():
    # /abort_request (or the server stopping) mid-stream: the last chunk carries finish_reason abort.
    chunks = generate_chunks(WORDS[:10], True)[:3]
    abort = sse({"text": "", "output_ids": [], "meta_info": {
        "id": "r1", "finish_reason": {"type": "abort", "message": "Abort before prefill", "status_code": None,
                                      "err_type": None}, "prompt_tokens": 5, "completion_tokens": 3}})
    dec = decode("generate", [*chunks, abort, b"data: [DONE]\n\n"])
    with pytest.raises(AbortedResponseError, match="aborted"):
        dec.result()


def test_a_guard_verdict_cuts_the_stream_and_keeps_the_answer_so_far():
    stream = b"".join(generate_chunks(["a"] * 30, incremental=False))
    calls: list[int] = []

    def guard(delta: str, tokens: int, in_reasoning: bool):
        calls.append(tokens)
        return "loop" if tokens >= 12 else None

    dec = decode("generate", split(stream, "bytes"), on_delta=guard)
    assert dec.cut == "loop" and calls[-1] == 12
    out = dec.result(cut=True)
    assert (out.finish_reason, out.completion_tokens, out.text) == ("abort", 12, "a " * 12)


def test_sse_parser_joins_data_lines_ignores_comments_and_crlf():
    p = SSEParser()
    events = p.feed(b": keep-alive\r\ndata: {\"a\":\r\ndata: 1}\r\n\r\nevent: x\ndata:[DONE]\n\n")
    assert events == [b'{"a":\n1}', b"[DONE]"] and not p.pending()
    assert p.feed(b"data: {") == [] and p.pending()


def test_stream_bytes_bench_counts_what_serialising_every_chunk_gives():
    """bench/stream_bytes.py counts a cumulative 32k answer (~6 GB) from running sums: they equal the
    bytes of the chunks built and serialised one by one, on a short answer, every route and interval."""
    import importlib.util
    import sys
    from pathlib import Path

    bench = Path(__file__).resolve().parent.parent / "bench"
    sys.path.insert(0, str(bench))
    try:
        spec = importlib.util.spec_from_file_location("stream_bytes", bench / "stream_bytes.py")
        assert spec is not None and spec.loader is not None
        sb = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sb)
    finally:
        sys.path.remove(str(bench))
    n = 300
    ans = sb.Answer(n)
    words = ans.script.words
    for interval in (1, 7):
        for incremental in (False, True):
            built, last = 0, 0
            for k in sb.sent_points(n, interval):
                a = last if incremental else 0
                obj = {"text": "".join(w + " " for w in words[a:k]), "output_ids": ans.ids[a:k],
                       "meta_info": sb._meta(k, n, k == n)}
                built += sb._dumps(obj)
                last = k
            assert sb.generate_bytes(ans, n, interval, incremental) == (built + 14, len(sb.sent_points(n, interval)))
        for continuous in (False, True):
            size, chunks = sb.chat_bytes(ans, n, interval, continuous)
            assert chunks == len(sb.sent_points(n, interval)) + 3 and size > ans.text_off[n]


def test_the_taper_reads_a_streams_tokens_so_far_over_the_elapsed_time_estimate():
    """worker/tracked.py: a running request's tokens so far are what its stream said (exact); without a
    stream (server.stream: false, or no chunk yet) elapsed time x the decode rate, as before."""
    from budgetq.shared.jobs import Claimed
    from budgetq.worker.estimator import LengthModel
    from budgetq.worker.tracked import Tracked

    length = LengthModel()
    length.observe(1000, 10.0)                       # 100 tok/s per request
    t = Tracked(Claimed.__new__(Claimed), "D")
    t.new_request()
    now = t.admitted_at + 5.0
    assert t.generated(length, now) == 500.0        # the estimate
    t.progressed(37)                                # e.g. queued behind others: 37 made, not 500
    assert t.generated(length, now) == 37.0
    t.new_request()                                 # the next turn of a regenerate: all job
    assert t.streamed is None and t.generated(length, t.admitted_at) == 0.0


def test_a_guard_that_raises_is_turned_off_for_that_answer_and_the_answer_is_kept(caplog):
    stream = b"".join(generate_chunks(WORDS, incremental=True))
    calls: list[int] = []

    def broken(delta: str, tokens: int, in_reasoning: bool):
        calls.append(tokens)
        raise ZeroDivisionError("a bug in the guard")

    dec = decode("generate", split(stream, "odd"), on_delta=broken)
    out = dec.result()
    assert (out.completion_tokens, out.finish_reason, len(calls)) == (40, "stop", 1)
    assert "guard failed" in caplog.text
