"""How long will a request still running end up? The estimate behind tapering near the budget.

A request admitted a while ago is more likely a long one (the short ones have finished),
so its expected final length is E[L | L > g], g = tokens it has generated so far. The
worker raises each in-flight request's reservation to that value (adjust.lua). Near the
budget this stops admissions while the long requests finish, instead of letting hundreds of
requests overshoot together. Lengths come from the dataset's histogram in Redis (filled
by commit.lua); g is estimated from elapsed time and the observed per-request decode rate.
"""

from __future__ import annotations

import math

# Bins of the histogram (commit.lua): width = max_tokens // 64.
BINS = 64
# With fewer completed samples than this beyond g, fall back to "somewhere between g and max".
MIN_TAIL = 5


class LengthModel:
    def __init__(self) -> None:
        self._hist: dict[str, tuple[int, dict[int, int]]] = {}
        self.rate_tok_s: float | None = None  # per-request decode speed, EWMA

    def set_histogram(self, ds: str, max_tokens: int, raw: dict) -> None:
        width = max(1, max_tokens // BINS)
        counts = {int(k): int(v) for k, v in raw.items()}
        self._hist[ds] = (width, counts)

    def samples(self, ds: str) -> int:
        """How many completed lengths the dataset's histogram holds."""
        return sum(self._hist.get(ds, (1, {}))[1].values())

    def observe(self, completion_tokens: int, latency_s: float) -> None:
        """Learn the per-request decode rate from a finished request."""
        if completion_tokens < 16 or latency_s <= 0:
            return
        r = completion_tokens / latency_s
        self.rate_tok_s = r if self.rate_tok_s is None else 0.9 * self.rate_tok_s + 0.1 * r

    def generated_so_far(self, elapsed_s: float) -> float:
        return 0.0 if self.rate_tok_s is None else elapsed_s * self.rate_tok_s

    def expected_length(self, ds: str, generated: float, max_tokens: int) -> int:
        """E[L | L > generated], capped at max_tokens."""
        width, counts = self._hist.get(ds, (1, {}))
        n = 0
        total = 0.0
        for b, c in counts.items():
            center = (b + 0.5) * width
            if center > generated:
                n += c
                total += c * center
        if n >= MIN_TAIL:
            est = total / n
        else:
            # Nothing (or little) seen this long yet: anywhere between here and max_tokens.
            est = (generated + max_tokens) / 2
        return min(max_tokens, max(1, math.ceil(max(est, generated))))
