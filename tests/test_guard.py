"""The degeneration guard (worker/degeneration.py): exact cycles at the tail of a stream are cut,
whatever the chunking; ordinary text is not; the work per chunk does not grow with the answer."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from budgetq.shared.config import DatasetConfig
from budgetq.shared.config_quality import GuardConfig
from budgetq.worker.degeneration import CHECK_EVERY, LoopGuard, Verdict, scan


def words(rng: random.Random, n: int, vocab: int = 50_000) -> list[str]:
    """``n`` one-token words, no exact cycle (a large vocabulary, drawn at random)."""
    return [f"w{rng.randrange(vocab)} " for _ in range(n)]


def feed_tokens(guard: LoopGuard, tokens: list[str], start: int = 0,
                reasoning: bool = False) -> tuple[Verdict | None, int]:
    """Feed one token per chunk; (verdict, tokens fed when it came)."""
    for i, tok in enumerate(tokens, start=start + 1):
        v = guard.feed(tok, i, reasoning)
        if v is not None:
            return v, i
    return None, start + len(tokens)


def chunked(text: str, cuts: list[int]) -> list[str]:
    points = sorted({0, len(text), *(c % (len(text) + 1) for c in cuts)})
    return [text[a:b] for a, b in zip(points, points[1:], strict=False) if b > a]


def test_one_token_loop_is_cut_soon_after_its_onset() -> None:
    rng = random.Random(1)
    prefix = words(rng, 500)
    v, at = feed_tokens(LoopGuard(), prefix + ["The "] * 5000)
    assert v is not None and v.reason == "loop" and v.period == 1 and v.period_chars == 4
    cfg = GuardConfig()
    # Cut at the threshold, counted in the loop's own tokens (4 characters each, where the answer's were 6-7).
    assert 500 + cfg.min_span_tokens <= at <= 500 + cfg.min_span_tokens + CHECK_EVERY
    assert abs(v.onset_tokens - 500) <= 2 and v.cut_tokens == at and v.repeats >= cfg.min_span_tokens
    assert v.text == "The " and v.channel == "content"


@pytest.mark.parametrize("period", [2, 7, 40, 163, 300])
def test_longer_cycles_need_min_repeats(period: int) -> None:
    rng = random.Random(period)
    cycle = words(rng, period)
    cfg = GuardConfig()
    need = max(cfg.min_span_tokens, cfg.min_repeats * period)
    v, at = feed_tokens(LoopGuard(), words(rng, 300) + cycle * (need // period + 10))
    assert v is not None
    assert need <= at - 300 <= need + period + CHECK_EVERY   # within a check (and a cycle) of the thresholds
    assert v.period == period and v.repeats >= cfg.min_repeats and v.period_chars == len("".join(cycle))
    assert abs(v.onset_tokens - 300) <= 8 and v.cut_tokens == at
    assert v.text in "".join(cycle) * 2   # one cycle, from wherever the cut fell in it


def test_a_loop_in_the_reasoning_is_cut_and_named() -> None:
    rng = random.Random(3)
    guard = LoopGuard()
    for i, tok in enumerate(words(rng, 200) + ["Wait, let me reconsider. "] * 400):
        v = guard.feed(tok, (i + 1) * 5, in_reasoning=True)
        if v:
            break
    assert v is not None and v.channel == "reasoning"
    assert guard.feed("more", 10_000) is v   # decided once: every later chunk gets the same verdict


def test_answer_text_does_not_mix_with_the_reasoning() -> None:
    """Alternate chunks of two channels: each channel alone is ordinary text, so no loop (a guard
    that kept one buffer would see ``a b a b``-style noise, not a cycle, but also never the channel's)."""
    rng = random.Random(4)
    guard = LoopGuard()
    for i, (a, b) in enumerate(zip(words(rng, 3000), words(rng, 3000), strict=True)):
        assert guard.feed(a, 2 * i + 1, in_reasoning=True) is None
        assert guard.feed(b, 2 * i + 2, in_reasoning=False) is None


def test_off_with_one_line_and_tunable() -> None:
    loop = ["x "] * 5000
    assert feed_tokens(LoopGuard(GuardConfig(enabled=False)), loop)[0] is None
    ds = DatasetConfig(name="a", path="p", guard="off")
    assert not ds.guard.enabled and feed_tokens(LoopGuard(ds.guard), loop)[0] is None
    v, at = feed_tokens(LoopGuard(GuardConfig(min_span_tokens=64)), loop)
    assert v is not None and at <= 64 + CHECK_EVERY


def test_a_legitimate_repetition_that_ends_is_kept() -> None:
    """``Write hello 50 times``: 50 tokens of one cycle, then the answer moves on."""
    rng = random.Random(5)
    text = words(rng, 100) + ["hello "] * 50 + words(rng, 400) + ["| --- | --- |\n"] * 30 + words(rng, 100)
    assert feed_tokens(LoopGuard(), text)[0] is None
    assert scan("".join(text), len(text)) is None


def test_scan_judges_a_finished_answer() -> None:
    rng = random.Random(6)
    looped = "".join(words(rng, 100)) + "I am not sure. " * 300
    v = scan(looped, 100 + 300 * 4)
    assert v is not None and v.period_chars == len("I am not sure. ")
    assert scan("".join(words(rng, 3000)), 3000) is None
    assert scan("", 0) is None
    v = scan("fine answer", 1400, reasoning="".join(words(rng, 100)) + "hmm " * 1300)
    assert v is not None and v.channel == "reasoning"


def test_work_per_chunk_does_not_grow_with_the_answer() -> None:
    """100k one-token chunks: checks at most one per CHECK_EVERY characters, and the kept tail bounded
    (a guard that kept, or rescanned, the whole answer would grow with it)."""
    rng = random.Random(7)
    guard = LoopGuard()
    toks = words(rng, 100_000)
    assert feed_tokens(guard, toks)[0] is None
    chars = sum(map(len, toks))
    assert guard.checks <= chars // CHECK_EVERY + 1
    kept = max(len(c.buf) + c.pending for c in guard._channels.values())
    assert kept <= guard._keep + CHECK_EVERY + 16
    assert guard._keep < 20_000


@settings(max_examples=60, deadline=None)
@given(period=st.integers(1, 300), prefix=st.integers(0, 2000), seed=st.integers(0, 2**32),
       cuts=st.lists(st.integers(0, 10**6), max_size=400))
def test_any_cycle_in_any_chunking_is_cut(period: int, prefix: int, seed: int, cuts: list[int]) -> None:
    """An exact cycle of 1..300 one-token words after any prefix, the text split at arbitrary points
    (chunks of several tokens, or of part of one): cut, with its period, within the thresholds (plus
    one check interval and the characters-per-token estimate's drift) of its onset."""
    rng = random.Random(seed)
    cfg = GuardConfig()
    cycle = words(rng, period)
    need = max(cfg.min_span_tokens, cfg.min_repeats * period)
    # Enough cycles that text fed in one piece (its tokens known only on average) is cut too.
    toks = words(rng, prefix) + cycle * (need * 3 // (2 * period) + 8)
    text = "".join(toks)
    ends = []   # token count at each character offset's end
    n = 0
    for t in toks:
        n += 1
        ends.extend([n] * len(t))
    guard = LoopGuard(cfg)
    pos = 0
    verdict = None
    for piece in chunked(text, cuts):
        pos += len(piece)
        verdict = guard.feed(piece, ends[pos - 1])
        if verdict:
            break
    verdict = verdict or guard.flush()
    assert verdict is not None, (period, prefix)
    assert verdict.period_chars == len("".join(cycle))
    assert ends[pos - 1] - prefix <= need * 1.2 + period + CHECK_EVERY + max(0, max(len(p) for p in
                                                                                   chunked(text, cuts)) // 4)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32), cuts=st.lists(st.integers(0, 10**6), max_size=200),
       reps=st.integers(1, 3), block=st.integers(1, 60))
def test_ordinary_text_with_a_few_repeats_in_any_chunking_is_not_cut(seed: int, cuts: list[int], reps: int,
                                                                       block: int) -> None:
    """Text from a large vocabulary, with a block repeated up to min_repeats - 1 times here and
    there (a refrain, a table's identical rows): never a verdict, however it is chunked."""
    rng = random.Random(seed)
    toks: list[str] = []
    for _ in range(20):
        toks += words(rng, rng.randrange(20, 200))
        toks += words(rng, block) * reps
    text = "".join(toks)
    guard = LoopGuard()
    pos = 0
    for piece in chunked(text, cuts):
        pos += len(piece)
        assert guard.feed(piece, max(1, pos // 6)) is None
    assert guard.flush() is None
