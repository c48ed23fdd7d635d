"""The degeneration guard: notice, while an answer streams, that its tail has become one exact
cycle repeated over and over (``The the the ...``, a phrase or a paragraph looping until
``max_tokens``), so the request can be aborted at the engine instead of burning ``max_tokens``.

How (cheap enough to run on every chunk of every stream): the guard keeps the last few thousand
characters of each channel (answer, reasoning). On a chunk it takes the last ``PROBE`` characters
and looks for their earlier occurrences within one longest period (``str.rfind``: C speed);
each occurrence at distance ``d`` is a candidate period, confirmed by one slice comparison of
the stretch the thresholds ask for (s[i] == s[i - d] over it). The nearest confirmed occurrence is
the smallest period. A chunk costs a list append; a check (once per CHECK_EVERY new characters)
joins them and trims the kept tail, searches one longest period and compares a few spans: bounded
work, mostly in C, independent of how long the answer already is (tests/test_guard.py).

The thresholds (shared/config_quality.py GuardConfig) are in tokens, as people think of them; the
text is in characters. Each check records (characters fed, tokens so far), so how many tokens the
last L characters took is read off those marks (to one check, ~8 tokens): a loop's tokens may be
much shorter or longer than the answer's before it, and an average over the answer would misjudge
its span. A server that gives no token count: ~4 characters a token.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from budgetq.shared.config_quality import GuardConfig

# Characters at the tail whose earlier occurrences give the candidate periods. Shorter than any
# span the guard acts on (min_span_tokens >= 16 tokens >= 16 characters), long enough that
# ordinary text rarely repeats it within one period (few candidates to confirm).
PROBE = 16
# Candidates confirmed per check at most: a probe that occurs more often within one period is
# itself repetitive (a run of spaces in code); the next chunk's probe is another.
MAX_CANDIDATES = 32
# Characters per token assumed before the stream says how many tokens it made, and the range a
# measured ratio is clamped to (one character per token for digits or CJK, a few for English;
# a run of spaces or dashes can be dozens, which must not make a huge span look short).
DEFAULT_CHARS_PER_TOKEN = 4.0
MIN_CHARS_PER_TOKEN = 1.0
MAX_CHARS_PER_TOKEN = 8.0
# A period's tokens are estimated (to a check's resolution): this much over max_period_tokens passes.
PERIOD_SLACK = 1.1
# Check at most once per this many new characters of a channel (about 8 tokens: a cut comes at most
# that late, and one-token chunks cost a list append each, not a check).
CHECK_EVERY = 32


@dataclass(frozen=True)
class Verdict:
    """Why the guard cut an answer (logged once, kept in the discarded row's details)."""

    reason: str          # "loop"
    period: int          # the cycle's length, tokens (estimated from characters)
    repeats: int         # whole cycles seen in a row
    onset_tokens: int    # tokens generated when the cycle began (estimated)
    cut_tokens: int      # tokens generated when the guard decided
    channel: str = "content"   # "content" or "reasoning"
    period_chars: int = 0
    text: str = ""       # one cycle, cut to 200 characters (for the log and the row's details)

    def details(self) -> dict[str, object]:
        return {"period": self.period, "repeats": self.repeats, "onset_tokens": self.onset_tokens,
                "cut_tokens": self.cut_tokens, "channel": self.channel, "period_chars": self.period_chars,
                "cycle": self.text}


class _Channel:
    """One stream of text (the answer or its reasoning) and the tail the guard keeps of it."""

    __slots__ = ("buf", "pieces", "total", "pending", "marks")

    def __init__(self) -> None:
        self.buf = ""        # the kept tail, as of the last check
        self.pieces: list[str] = []   # text fed since (joined at the next check: no copy per chunk)
        self.total = 0       # characters ever fed
        self.pending = 0     # characters in pieces
        # (characters fed, tokens so far) at each check, back to about the kept tail's start.
        self.marks: deque[tuple[int, float]] = deque()


class LoopGuard:
    """One per request. ``feed`` each chunk's *new* text; a Verdict the first time the tail loops
    (and every call after that returns the same Verdict: the caller aborts once)."""

    def __init__(self, cfg: GuardConfig | None = None) -> None:
        self.cfg = cfg if cfg is not None else GuardConfig()
        self._channels = {False: _Channel(), True: _Channel()}
        self._verdict: Verdict | None = None
        self._tokens = 0
        self.checks = 0   # how many tail checks ran (tests: the cost stays per chunk)
        self._keep = self._keep_chars(self.cfg)

    @property
    def verdict(self) -> Verdict | None:
        return self._verdict

    @staticmethod
    def _keep_chars(cfg: GuardConfig) -> int:
        """Tail characters a check may look at: the longest stretch the thresholds ask for, at the
        most characters per token, plus one period for the comparison's other side."""
        longest = MAX_CHARS_PER_TOKEN * max(cfg.min_span_tokens, cfg.min_repeats * cfg.max_period_tokens)
        return int(longest + MAX_CHARS_PER_TOKEN * cfg.max_period_tokens) + PROBE

    def feed(self, delta_text: str, tokens_so_far: int, in_reasoning: bool = False) -> Verdict | None:
        """``delta_text``: the text this chunk added (never the cumulative text); ``tokens_so_far``:
        completion tokens generated so far (0 when the server does not say: then characters / 4)."""
        if self._verdict is not None:
            return self._verdict
        if not self.cfg.enabled or not delta_text:
            return None
        if tokens_so_far > 0:
            self._tokens = tokens_so_far
        ch = self._channels[in_reasoning]
        ch.pieces.append(delta_text)
        ch.total += len(delta_text)
        ch.pending += len(delta_text)
        if ch.pending < CHECK_EVERY:
            return None
        self._verdict = self._check(ch, in_reasoning)
        return self._verdict

    def flush(self) -> Verdict | None:
        """Check the text fed since the last check (the stream ended between checks)."""
        if self._verdict is not None or not self.cfg.enabled:
            return self._verdict
        for in_reasoning, ch in self._channels.items():
            if ch.pending:
                self._verdict = self._check(ch, in_reasoning)
                if self._verdict is not None:
                    break
        return self._verdict

    def _tokens_now(self) -> float:
        if self._tokens > 0:
            return float(self._tokens)
        return (self._channels[False].total + self._channels[True].total) / DEFAULT_CHARS_PER_TOKEN

    def _chars_for(self, ch: _Channel, tokens: float) -> float:
        """How many of the channel's last characters took ``tokens`` tokens (read off the marks;
        before the oldest mark, at the ratio of the marks' stretch, clamped)."""
        back = _back(ch.marks, 1, tokens)
        if back is not None:
            return back
        (first_chars, first_tokens), (now_chars, now_tokens) = ch.marks[0], ch.marks[-1]
        return (now_chars - first_chars) + (first_tokens - (now_tokens - tokens)) * self._ratio(ch)

    def _tokens_in(self, ch: _Channel, chars: int) -> float:
        """Tokens the channel's last ``chars`` characters took (the inverse of _chars_for)."""
        back = _back(ch.marks, 0, chars)
        if back is not None:
            return back
        (first_chars, first_tokens), (now_chars, now_tokens) = ch.marks[0], ch.marks[-1]
        return (now_tokens - first_tokens) + (first_chars - (now_chars - chars)) / self._ratio(ch)

    def _ratio(self, ch: _Channel) -> float:
        """Characters per token before the oldest mark: the marks' own stretch's, else the answer's."""
        now_chars, now_tokens = ch.marks[-1]
        first_chars, first_tokens = ch.marks[0]
        if now_tokens - first_tokens >= 8:
            ratio = (now_chars - first_chars) / (now_tokens - first_tokens)
        elif now_tokens > 0:
            ratio = (self._channels[False].total + self._channels[True].total) / now_tokens
        else:
            ratio = DEFAULT_CHARS_PER_TOKEN
        return min(MAX_CHARS_PER_TOKEN, max(MIN_CHARS_PER_TOKEN, ratio))

    def _check(self, ch: _Channel, in_reasoning: bool) -> Verdict | None:
        # One join and one trim per check, each O(kept tail): per character, O(kept tail / CHECK_EVERY)
        # bytes copied in C, however long the answer already is.
        ch.buf = (ch.buf + "".join(ch.pieces))[-self._keep:]
        ch.pieces.clear()
        ch.pending = 0
        ch.marks.append((ch.total, self._tokens_now()))
        while len(ch.marks) > 2 and ch.total - ch.marks[1][0] >= self._keep:
            ch.marks.popleft()
        self.checks += 1
        cfg = self.cfg
        s = ch.buf
        n = len(s)
        if n < 2 * PROBE:
            return None
        probe = s[n - PROBE:]
        lo = max(0, n - PROBE - int(cfg.max_period_tokens * MAX_CHARS_PER_TOKEN))
        end = n - 1   # occurrences strictly before the probe itself
        min_span: float | None = None
        for _ in range(MAX_CANDIDATES):
            at = s.rfind(probe, lo, end)
            if at < 0:
                return None
            d = n - PROBE - at
            end = at + PROBE - 1
            if min_span is None:
                min_span = self._chars_for(ch, cfg.min_span_tokens)
            # The stretch that must hold period d: the span threshold and min_repeats cycles.
            span = int(max(min_span, cfg.min_repeats * d))
            if span > n:
                return None   # a longer period needs a longer stretch still
            if s[n - span + d:] != s[n - span:n - d]:
                continue
            period_tokens = self._tokens_in(ch, span) * d / span
            if period_tokens > cfg.max_period_tokens * PERIOD_SLACK:
                return None
            return self._verdict_for(ch, d, period_tokens, in_reasoning)
        return None

    def _verdict_for(self, ch: _Channel, d: int, period_tokens: float, in_reasoning: bool) -> Verdict:
        """The cycle found: how far back it goes (onset) in the kept tail, for the log."""
        s = ch.buf
        n = len(s)
        i = n - 1
        # Walk back while s[i] == s[i - d] (only once per request: the answer is being cut).
        while i - d >= 0 and s[i] == s[i - d]:
            i -= 1
        span = (n - 1 - i) + d   # the characters equal to the ones d before, and the cycle's first copy
        if i - d < 0:
            span = n             # the loop started before the kept tail
        tokens = round(self._tokens_now())
        onset = max(0, tokens - round(self._tokens_in(ch, span)))
        return Verdict(reason="loop", period=max(1, round(period_tokens)), repeats=span // d, onset_tokens=onset,
                       cut_tokens=tokens, channel="reasoning" if in_reasoning else "content",
                       period_chars=d, text=s[n - d:][:200])


def scan(text: str, completion_tokens: int, cfg: GuardConfig | None = None, reasoning: str = "") -> Verdict | None:
    """A finished answer's verdict (a server that does not stream, or an answer that ended between
    checks): its reasoning's tail and its content's tail each checked once."""
    guard = LoopGuard(cfg)
    if reasoning:
        guard.feed(reasoning, completion_tokens, in_reasoning=True)
    guard.feed(text, completion_tokens, in_reasoning=False)
    return guard.flush()


def _back(marks: deque[tuple[int, float]], axis: int, span: float) -> float | None:
    """Along the (chars, tokens) marks, how far the other axis moved over the last ``span`` of ``axis``
    (0: chars, 1: tokens), linear between two marks; None if that reaches before the oldest mark."""
    other = 1 - axis
    now = prev = marks[-1]
    target = now[axis] - span
    for mark in reversed(marks):
        if mark[axis] <= target:
            if prev[axis] == mark[axis]:
                return float(now[other] - mark[other])
            at = mark[other] + (prev[other] - mark[other]) * (target - mark[axis]) / (prev[axis] - mark[axis])
            return now[other] - at
        prev = mark
    return None
