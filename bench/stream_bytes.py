"""Bytes on the wire per streamed answer, by route and output mode, at 8k and 32k tokens.

    python bench/stream_bytes.py [--tokens 8192,32768] [--intervals 1,16,64]

SGLang's ``/generate`` streams the *cumulative* text and output_ids in every chunk by default: the
k-th chunk repeats the k - 1 tokens before it, so an answer of n tokens sent a token a chunk moves
~n^2 / 2 tokens' worth of JSON. ``--incremental-streaming-output`` sends each chunk's new tokens only;
chat streams deltas either way. ``--stream-interval`` (or a request's own
``sampling_params.stream_interval``) sends a chunk at token 1 and then every that many tokens
(scheduler_components/output_streamer.py ``accept``).

The chunks are the simulator's own (simulator/native.py ``_output``, simulator/oai_routes.py's chat
chunk; tests/test_sglang_conformance.py checks both against SGLang 0.5.23's models), for an answer
of ordinary words (~5 characters a token) with token ids drawn from a 151,936-token vocabulary
(Qwen's: 5-6 digits each, as a real model's ids are). Sizes are exact, computed per chunk
from running sums (a cumulative 32k answer is ~6 GB: it is counted, not built); tests/test_stream.py
checks the sums against the chunks built and serialised for a short answer.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import sys
from collections.abc import Iterator

import _common as c

from budgetq.simulator.texts import Script

VOCAB_SIZE = 151_936
PROMPT = 200


def _dumps(obj: object) -> int:
    """Bytes of one SSE event carrying ``obj``, as SGLang writes it (orjson: compact JSON)."""
    return len(b"data: ") + len(json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()) + 2


def sent_points(n: int, interval: int) -> list[int]:
    """Token counts at which a chunk goes out: 1, 1 + interval, ..., and n (the final chunk)."""
    if interval <= 1:
        return list(range(1, n + 1))
    return sorted({*range(1, n, interval), n})


class Answer:
    """One answer of ``n`` tokens: the text and ids of its first k tokens, and their JSON sizes, in O(1)."""

    def __init__(self, n: int, seed: int = 0) -> None:
        self.script = Script(seed, "bytes", n, 0)
        rng = random.Random(seed)
        self.ids = [rng.randrange(VOCAB_SIZE) for _ in range(n)]
        # Bytes of the text (JSON-escaped: these words need none) and of the ids, per prefix of tokens.
        self.text_off = [0, *itertools.accumulate(len(w) + 1 for w in self.script.words)]
        assert self.text_off[-1] == len(self.script.inline(n).encode())
        self.id_off = [0, *itertools.accumulate(len(str(i)) for i in self.ids)]

    def text_json(self, a: int, b: int) -> int:
        return 2 + self.text_off[b] - self.text_off[a]

    def ids_json(self, a: int, b: int) -> int:
        return 2 + self.id_off[b] - self.id_off[a] + max(0, b - a - 1)


def _meta(k: int, n: int, final: bool) -> dict:
    # simulator/native.py _output's meta_info keys and value shapes (a 32-character rid, latency floats).
    meta = {"id": "0" * 32, "finish_reason": {"type": "length", "length": n} if final else None,
            "prompt_tokens": PROMPT, "weight_version": "default", "num_retractions": 0, "reasoning_tokens": 0,
            "completion_tokens": k, "cached_tokens": 0, "dp_rank": 0}
    if final:
        meta["e2e_latency"] = 123.456789012
        meta["response_sent_to_client_ts"] = 1796619715.061154
    return meta


def generate_bytes(ans: Answer, n: int, interval: int, incremental: bool) -> tuple[int, int]:
    """(bytes, chunks) of a streamed /generate answer, [DONE] included."""
    total, last = 0, 0
    points = sent_points(n, interval)
    empty = {"text": "", "output_ids": [], "meta_info": None}
    base = _dumps(empty) - 2 - 2 - 4   # without the "" and [] and null placeholders' own bytes
    for k in points:
        start = last if incremental else 0
        total += base + ans.text_json(start, k) + ans.ids_json(start, k) + _dumps(_meta(k, n, k == n)) - 8
        last = k
    return total + len(b"data: [DONE]\n\n"), len(points)


def chat_bytes(ans: Answer, n: int, interval: int, continuous: bool) -> tuple[int, int]:
    """(bytes, chunks) of a streamed chat answer: role chunk, deltas, finish chunk, usage chunk, [DONE]."""
    def chunk(delta: dict, finish: str | None = None, usage: dict | None = None) -> dict:
        return {"id": "0" * 32, "object": "chat.completion.chunk", "created": 1796619715, "model": "Qwen/Qwen3-8B",
                "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish,
                             "matched_stop": None}], "usage": usage}

    def usage(k: int) -> dict:
        return {"prompt_tokens": PROMPT, "total_tokens": PROMPT + k, "completion_tokens": k,
                "prompt_tokens_details": None, "reasoning_tokens": 0, "completion_tokens_details": None}

    total = _dumps(chunk({"role": "assistant", "content": "", "reasoning_content": None}))
    empty = _dumps(chunk({"role": None, "content": "", "reasoning_content": None}))
    last, points = 0, sent_points(n, interval)
    for k in points:
        total += empty + ans.text_json(last, k) - 2
        if continuous:
            total += _dumps(usage(k)) - _dumps(None)
        last = k
    total += _dumps(chunk({"role": None, "content": None, "reasoning_content": None}, "length"))
    total += _dumps({"id": "0" * 32, "object": "chat.completion.chunk", "created": 1796619715,
                     "model": "Qwen/Qwen3-8B", "choices": [], "usage": usage(n)})
    return total + len(b"data: [DONE]\n\n"), len(points) + 3


def rows(tokens: list[int], intervals: list[int]) -> Iterator[list[object]]:
    for n in tokens:
        ans = Answer(n)
        answer_bytes = ans.text_off[n]
        for interval in intervals:
            for route, fn, flag in (("/generate cumulative (default)", generate_bytes, False),
                                    ("/generate --incremental-streaming-output", generate_bytes, True),
                                    ("chat (deltas), final usage only", chat_bytes, False),
                                    ("chat (deltas), continuous_usage_stats", chat_bytes, True)):
                size, chunks = fn(ans, n, interval, flag)
                yield [f"{n:,}", interval, route, chunks, _human(size), f"{size / answer_bytes:,.1f}x"]


def _human(n: int) -> str:
    for unit, div in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= div:
            return f"{n / div:,.2f} {unit}"
    return f"{n} B"


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", default="8192,32768", help="answer lengths, comma-separated")
    ap.add_argument("--intervals", default="1,16,64", help="stream intervals (tokens), comma-separated")
    args = ap.parse_args(argv)
    tokens = [int(x) for x in args.tokens.split(",")]
    intervals = [int(x) for x in args.intervals.split(",")]
    c.print_header("Bytes on the wire per streamed answer", ["bench/stream_bytes.py", *argv])
    print(c.md_table(["answer tokens", "stream interval", "route", "chunks", "bytes", "/ answer text"],
                     list(rows(tokens, intervals))))


if __name__ == "__main__":
    main(sys.argv[1:])
