"""What the simulated model "writes": one word per token, thinking first, and the prompt-token estimate.

Each answer's words are drawn per (seed, rid) from a vocabulary of a few thousand made-up words, so
an ordinary answer never repeats itself the way a degenerate one does (a degeneration guard watching
the stream sees no cycle in it), and every retry of a job writes the same answer (as its length,
simulator/lengths.py). ``Script`` is one answer, with the shapes a quality gate or the loop guard is
tested against (``Shape``):

- ``loop``: after a random number of tokens the answer falls into an exact cycle of ``loop_period``
  tokens and repeats it until max_tokens (finish_reason length), in its reasoning when the onset falls
  there (the reasoning then never closes) or in its answer;
- ``empty``: the reasoning (if any) closes and nothing follows (an answer with no content);
- ``unclosed``: every token is reasoning, ``<think>`` never closed, and the model stops (no answer).

``</think>`` is written with the first answer token (or alone, an empty answer's one token), as a
reasoning model writes it as a token of its own.
"""

from __future__ import annotations

import hashlib
import itertools
import random
from dataclasses import dataclass

THINK_ID, ANSWER_ID, CLOSE_ID = 8, 7, 9   # ids of a thinking token, an answer token, a lone </think>
_ONSETS = "bdfgklmnprstvz"
_VOWELS = "aeiou"
# 14 x 5 syllables, words of 2 or 3 of them: 4,900 + 343,000 possible; 4,096 are kept, one per id.
_SYLLABLES = [c + v for c in _ONSETS for v in _VOWELS]
VOCAB: tuple[str, ...] = tuple(a + b for a, b in itertools.product(_SYLLABLES, _SYLLABLES))[:4096]
_FIRST_ID = 16   # ids below are reserved (the EOS the simulated model "stops" on, the ones above)


def estimate_tokens(text: str) -> int:
    """Prompt tokens of a text without a tokenizer: about 4 characters a token, at least 1."""
    return max(1, len(text) // 4)


def content_text(content: object) -> str:
    """An OpenAI message content: a string, or a list of parts of which the text parts count."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    raise ValueError(f"message content must be a string or a list of parts, got {type(content).__name__}")


@dataclass(frozen=True)
class Shape:
    """What kind of answer one request gets (``shape_of``); ``normal`` unless a fraction says otherwise."""

    kind: str = "normal"          # normal | loop | empty | unclosed
    onset: int = 0                # loop: tokens before the cycle starts


def _uniform(seed: int, key: str, salt: str) -> float:
    digest = hashlib.blake2b(f"{seed}\x00{salt}\x00{key}".encode(), digest_size=8).digest()
    return (int.from_bytes(digest, "big") + 0.5) / 2.0**64


def shape_of(seed: int, key: str, natural: int, loop_fraction: float = 0.0, empty_fraction: float = 0.0,
             unclosed_fraction: float = 0.0) -> Shape:
    """The answer's shape, a function of (seed, key) like its length. A loop starts uniformly within
    the length the answer would have had (``natural``), so loops start early and late."""
    u = _uniform(seed, key, "shape")
    if u < loop_fraction:
        return Shape("loop", int(_uniform(seed, key, "onset") * max(1, natural)))
    if u < loop_fraction + unclosed_fraction:
        return Shape("unclosed")
    if u < loop_fraction + unclosed_fraction + empty_fraction:
        return Shape("empty")
    return Shape()


class Script:
    """One answer of ``tokens`` tokens, ``think`` of them reasoning, rendered at any token count.

    Words and the running offsets into the rendered strings are built once (O(n)), so the text of the
    first k tokens is one slice: a cumulative stream renders each chunk without rebuilding it.
    """

    __slots__ = ("tokens", "think", "closed", "words", "ids", "_inline", "_inline_off", "_reason", "_reason_off",
                 "_answer", "_answer_off")

    def __init__(self, seed: int, key: str, tokens: int, think: int, shape: Shape = Shape(),
                 loop_period: int = 1) -> None:
        rng = random.Random(f"{seed}\x00{key}")
        self.tokens = tokens
        self.closed = shape.kind != "unclosed"
        if shape.kind == "unclosed":
            think = tokens
        elif shape.kind == "loop" and think > shape.onset:
            think = tokens          # looping inside the reasoning: it never closes
            self.closed = False
        self.think = min(think, tokens)
        picks = rng.choices(range(len(VOCAB)), k=tokens)
        if shape.kind == "loop":
            period = max(1, loop_period)
            start = min(shape.onset, tokens)
            for i in range(start + period, tokens):
                picks[i] = picks[i - period]
        ids = [_FIRST_ID + p for p in picks]
        words = [VOCAB[p] for p in picks]
        if shape.kind == "empty":
            # The reasoning closes and the answer is nothing: one lone </think> token (or, with no
            # reasoning, one token of no text: the model stopped at once).
            self.think = min(self.think, max(0, tokens - 1))
            del words[self.think + 1:], ids[self.think + 1:]
            words[self.think:] = [""]
            ids[self.think:] = [CLOSE_ID]
            self.tokens = len(words)
        self.words, self.ids = words, ids
        self._inline: str | None = None
        self._inline_off: list[int] = []
        self._reason = self._answer = ""
        self._reason_off: list[int] = []
        self._answer_off: list[int] = []

    def _build(self) -> None:
        think, words = self.think, self.words
        pieces = [w + " " if w else "" for w in words]
        if think and pieces:
            pieces[0] = "<think>" + pieces[0]
        if think < len(pieces) and think and self.closed:
            pieces[think] = "</think>" + pieces[think]
        self._inline = "".join(pieces)
        self._inline_off = [0, *itertools.accumulate(len(p) for p in pieces)]
        reason = [w + " " for w in words[:think]]
        answer = [w + " " if w else "" for w in words[think:]]
        self._reason, self._reason_off = "".join(reason), [0, *itertools.accumulate(len(p) for p in reason)]
        self._answer, self._answer_off = "".join(answer), [0, *itertools.accumulate(len(p) for p in answer)]

    def inline(self, k: int) -> str:
        """The raw text of the first ``k`` tokens: ``<think>...</think>`` then the answer (/generate's text)."""
        if self._inline is None:
            self._build()
        assert self._inline is not None
        return self._inline[:self._inline_off[max(0, min(k, self.tokens))]]

    def separated(self, k: int) -> tuple[str | None, str]:
        """(reasoning_content, content) of the first ``k`` tokens as a reasoning parser splits them."""
        if self._inline is None:
            self._build()
        k = max(0, min(k, self.tokens))
        think = min(k, self.think)
        reasoning = self._reason[:self._reason_off[think]] if self.think else None
        return reasoning, self._answer[:self._answer_off[k - think]]

    def output_ids(self, start: int, end: int) -> list[int]:
        return self.ids[max(0, start):max(0, min(end, self.tokens))]
