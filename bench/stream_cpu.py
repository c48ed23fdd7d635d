"""The worker's CPU per 1,000 streamed tokens: reading SSE, decoding chunks, feeding the loop guard.

    python bench/stream_cpu.py [--tokens 4096] [--intervals 1,4,16] [--repeat 3]

bench/pipeline_vs_direct.py measures a whole worker against the simulator, whose chunks come on a
timer (``--stream-interval-s``, 50 ms: ~14 tokens a chunk at its speed-up), so it cannot say what a
real SGLang costs at one token a chunk. This feeds the worker's own stream code
(worker/sglang_stream.py ``SSEParser`` + ``StreamDecoder``, and worker/degeneration.py's
``LoopGuard`` on every chunk's new text, as worker/sglang_client.py does) the bytes SGLang 0.5.23
sends (bench/stream_bytes.py's chunks: ~5 characters and one 5-6 digit id per token), one chunk per
socket read, as they arrive from a server that streams as it decodes. CPU is ``time.process_time``
of this process, best of ``--repeat``; the answer is ordinary text (no cycle: the guard checks and
finds nothing, its usual case).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import _common as c
from stream_bytes import Answer, _meta, sent_points

from budgetq.shared.config_quality import GuardConfig
from budgetq.worker.degeneration import LoopGuard
from budgetq.worker.sglang_stream import SSEParser, StreamDecoder


def _sse(obj: object) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def generate_events(ans: Answer, n: int, interval: int, incremental: bool) -> list[bytes]:
    words, out, last = ans.script.words, [], 0
    for k in sent_points(n, interval):
        a = last if incremental else 0
        out.append(_sse({"text": "".join(w + " " for w in words[a:k]), "output_ids": ans.ids[a:k],
                         "meta_info": _meta(k, n, k == n)}))
        last = k
    return [*out, b"data: [DONE]\n\n"]


def chat_events(ans: Answer, n: int, interval: int) -> list[bytes]:
    words, last = ans.script.words, 0

    def chunk(delta: dict, finish: str | None = None, usage: dict | None = None) -> bytes:
        return _sse({"id": "0" * 32, "object": "chat.completion.chunk", "created": 1796619715, "model": "m",
                     "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish,
                                  "matched_stop": None}], "usage": usage})

    def usage(k: int) -> dict:
        return {"prompt_tokens": 200, "total_tokens": 200 + k, "completion_tokens": k,
                "prompt_tokens_details": None, "reasoning_tokens": 0, "completion_tokens_details": None}

    out = [chunk({"role": "assistant", "content": "", "reasoning_content": None})]
    for k in sent_points(n, interval):
        out.append(chunk({"role": None, "content": "".join(w + " " for w in words[last:k]),
                          "reasoning_content": None}, usage=usage(k)))
        last = k
    out.append(chunk({"role": None, "content": None, "reasoning_content": None}, "length"))
    out.append(_sse({"id": "0" * 32, "object": "chat.completion.chunk", "created": 1, "model": "m", "choices": [],
                     "usage": usage(n)}))
    return [*out, b"data: [DONE]\n\n"]


def cpu_per_1k(api: str, events: list[bytes], n: int, guard: bool, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.process_time()
        g = LoopGuard(GuardConfig()) if guard else None
        dec = StreamDecoder(api, "http://x", 0.0, "m", on_delta=g.feed if g is not None else None)
        parser = SSEParser()
        for ev in events:
            got = parser.feed(ev)
            if got:
                dec.feed(got)
        out = dec.result()
        best = min(best, time.process_time() - t0)
        assert out.completion_tokens == n and dec.cut is None
    return 1000 * 1000 * best / n   # ms per 1,000 tokens


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=4096, help="answer length")
    ap.add_argument("--intervals", default="1,4,16", help="stream intervals (tokens), comma-separated")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--smoke", action="store_true", help="tiny, for the test suite")
    args = ap.parse_args(argv)
    n, repeat = (512, 1) if args.smoke else (args.tokens, args.repeat)
    intervals = [int(x) for x in args.intervals.split(",")]
    c.print_header("The worker's CPU per 1,000 streamed tokens", ["bench/stream_cpu.py", *argv])
    ans = Answer(n)
    rows = []
    for interval in intervals:
        for route, api, events in (
                ("chat + continuous usage", "chat", chat_events(ans, n, interval)),
                ("/generate incremental", "generate", generate_events(ans, n, interval, True)),
                ("/generate cumulative", "generate", generate_events(ans, n, interval, False))):
            plain = cpu_per_1k(api, events, n, False, repeat)
            guarded = cpu_per_1k(api, events, n, True, repeat)
            rows.append([f"{n:,}", interval, route, len(events), f"{plain:.2f}", f"{guarded:.2f}",
                         f"{guarded / plain:.2f}"])
    print(c.md_table(["answer tokens", "stream interval", "route", "events", "decode ms / 1k tokens",
                      "decode + guard ms / 1k tokens", "ratio guard / decode"], rows))


if __name__ == "__main__":
    main(sys.argv[1:])
