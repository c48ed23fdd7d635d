"""The degeneration guard on a real engine's streams: vLLM's CPU build serving SmolLM2-135M-Instruct
(tests/vllm_server.py; in float32, a server of this module's own), the bundled datasets' prompts,
answers streamed token by token with vLLM's running usage (``stream_options.continuous_usage_stats``), as
the worker's stream reader feeds the guard.

- temperature 0.7: 96 ordinary answers; the guard with its defaults cuts none (the false-positive
  corpus's real-engine part: tests/test_guard_corpus.py has the rest);
- temperature 0: this model falls into exact cycles on some prompts (the issue measured 4 of 16);
  with max_tokens 384 no loop can reach the default 384-token span, so this check runs the guard
  with ``min_span_tokens: 64`` and asserts that every answer whose tail is clearly an exact cycle
  (found by brute force over the finished text) is cut, that every cut is true (the text at the cut
  ends in the cycle it names), and that it comes within the thresholds of where the cycle began.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from budgetq.shared.config_quality import GuardConfig
from budgetq.worker.degeneration import CHECK_EVERY, LoopGuard
from tests.test_guard_corpus import bundled
from tests.vllm_server import MODEL_NAME

MAX_TOKENS = 256
# The limit counts the test's own work, not the server's start (tests/vllm_server.py bounds that).
pytestmark = pytest.mark.timeout(900, func_only=True)
ANSWERS = 96   # what two shared CPU cores generate in a few minutes (in float32: conftest.py vllm_fp32)


def prompts() -> list[str]:
    """The bundled datasets' distinct prompts (examples/data), in file order."""
    return list(dict.fromkeys(text for name, text in bundled() if ".jsonl:" in name))


async def stream_one(client: httpx.AsyncClient, url: str, prompt: str, temperature: float, max_tokens: int,
                     cfg: GuardConfig) -> dict:
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": temperature, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    guard = LoopGuard(cfg)
    text, verdict, cut_at, tokens, at_cut = "", None, None, 0, ""
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            tokens = (chunk.get("usage") or {}).get("completion_tokens", tokens)
            for choice in chunk.get("choices", []):
                delta = (choice.get("delta") or {}).get("content") or ""
                text += delta
                if verdict is None and delta:
                    verdict = guard.feed(delta, tokens)
                    if verdict is not None:   # (the worker aborts here; the test reads on, to see the rest)
                        cut_at, at_cut = tokens, text
    verdict = verdict or guard.flush()
    if verdict is not None and cut_at is None:
        cut_at, at_cut = tokens, text
    return {"prompt": prompt, "text": text, "tokens": tokens, "verdict": verdict, "cut_at": cut_at, "at_cut": at_cut}


async def generate(url: str, todo: list[str], temperature: float, max_tokens: int, cfg: GuardConfig) -> list[dict]:
    sem = asyncio.Semaphore(16)
    async with httpx.AsyncClient(timeout=600) as client:
        async def one(p: str) -> dict:
            async with sem:
                return await stream_one(client, url, p, temperature, max_tokens, cfg)
        return await asyncio.gather(*(one(p) for p in todo))


def tail_cycle(text: str, min_span: int, min_repeats: int, max_period: int = 1200) -> tuple[int, int] | None:
    """(period, span) in characters of the shortest exact cycle covering at least ``min_span`` characters
    and ``min_repeats`` periods at the end of ``text`` (brute force, for the check)."""
    for d in range(1, min(max_period, len(text) // max(1, min_repeats)) + 1):
        i = len(text) - 1
        while i - d >= 0 and text[i] == text[i - d]:
            i -= 1
        span = len(text) - 1 - i + d
        if span >= min_repeats * d and span >= min_span:
            return d, span
    return None


def test_no_false_positive_on_real_answers_at_temperature_0_7(vllm_fp32) -> None:
    todo = prompts()[:ANSWERS]
    out = asyncio.run(generate(vllm_fp32.url, todo, 0.7, MAX_TOKENS, GuardConfig()))
    assert len(out) == ANSWERS and sum(r["tokens"] for r in out) > ANSWERS * 20
    assert [(r["prompt"], r["verdict"]) for r in out if r["verdict"]] == []


def test_real_loops_at_temperature_0_are_cut_near_their_onset(vllm_fp32) -> None:
    cfg = GuardConfig(min_span_tokens=64)
    todo = prompts()[:24]
    out = asyncio.run(generate(vllm_fp32.url, todo, 0.0, 384, cfg))
    def clearly(r: dict) -> tuple[int, int] | None:
        """A cycle at the tail twice as long as the guard's thresholds ask (in this answer's characters
        per token): one the guard must have cut."""
        cpt = len(r["text"]) / max(1, r["tokens"])
        return tail_cycle(r["text"], int(2 * cfg.min_span_tokens * cpt), 2 * cfg.min_repeats)

    looping = [(r, c) for r in out if (c := clearly(r))]
    assert looping, "no answer ended in a clear loop: nothing here checks the guard (4 of 24 in bf16 and float32)"
    uncut = [(r["prompt"], c) for r, c in looping if r["verdict"] is None]
    assert uncut == []
    cut = [r for r in out if r["verdict"] is not None]
    for r in cut:
        v, text = r["verdict"], r["at_cut"]
        # Every cut is true: the text at the cut ends in the cycle it names, min_repeats times and more.
        d = v.period_chars
        assert text[-cfg.min_repeats * d:] == text[-d:] * cfg.min_repeats, (r["prompt"], v)
        # Cut within the thresholds (in the loop's own tokens) plus a check, of the onset.
        assert r["cut_at"] - v.onset_tokens <= max(cfg.min_span_tokens, cfg.min_repeats * v.period) * 1.25 \
            + CHECK_EVERY, v
    print(f"temperature 0: {len(looping)} of {len(out)} answers end clearly looping, all cut; {len(cut)} cut in all:",
          [(v.period, v.repeats, v.onset_tokens, v.cut_tokens) for r in cut if (v := r["verdict"])])
