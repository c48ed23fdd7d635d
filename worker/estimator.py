"""How long will a request still running end up? The estimate behind tapering near the budget.

A request admitted a while ago is more likely a long one (the short ones have finished),
so its expected final length is E[L | L > g], g = tokens it has generated so far. The
worker raises each in-flight request's reservation to that value (adjust.lua). Near the
budget this stops admissions while the long requests finish, instead of letting hundreds of
requests overshoot together.

The length distribution is estimated with Kaplan-Meier over the histogram bins: completed
responses (the dataset's histogram in Redis, filled by commit.lua from every worker) are
events, and requests still running are *censored* observations (L > g). Why: early in a
run only the short answers have finished, so a histogram of completed lengths alone says
responses are short, the long ones in flight are under-reserved, too many requests are
admitted, and they are aborted at the crossing. On a 2M budget with 256 in flight that
bias threw away ~13% of the generated tokens (bench/end_game.py); counting the running
requests as "at least g" removes it. g is what the request's stream says it has made
(worker/tracked.py ``Tracked.generated``: exact, SGLang's meta_info / the usage so far); with
``server.stream: false`` it is estimated from elapsed time and the observed per-request decode
rate, which a request queued behind others (none made yet) or at a faster server gets wrong.

Written here rather than with lifelines' KaplanMeierFitter: that would bring pandas and scipy
into every worker for a product over 64 histogram bins, recomputed each control interval.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

from budgetq.shared import keys

# Bins of the histogram (commit.lua): width = max_tokens // BINS; a response cut at max_tokens
# lands in bin BINS (the cap's point mass).
BINS = keys.HIST_BINS
# With fewer completed samples than this at or beyond g, fall back to "between g and max".
MIN_TAIL = 5


@dataclass
class _Tail:
    """E[L | L > start of bin b] for every bin, from one Kaplan-Meier pass."""

    width: int
    max_tokens: int
    cond: list[float | None] = field(default_factory=list)  # None: too few events beyond


def kaplan_meier_tail(width: int, max_tokens: int, events: dict[int, int],
                      censored: dict[int, float]) -> _Tail:
    """Conditional mean lengths per bin; mass never observed to end goes to ``max_tokens``."""
    top = max([max_tokens // width, *events, *censored], default=0)
    d = [float(events.get(b, 0)) for b in range(top + 1)]
    c = [float(censored.get(b, 0.0)) for b in range(top + 1)]
    risk = [0.0] * (top + 2)
    later_events = [0.0] * (top + 2)
    for b in range(top, -1, -1):
        risk[b] = risk[b + 1] + d[b] + c[b]
        later_events[b] = later_events[b + 1] + d[b]
    surv = [1.0] * (top + 2)
    for b in range(top + 1):
        surv[b + 1] = surv[b] * (1 - d[b] / risk[b]) if risk[b] else surv[b]
    # Suffix sums of mass x length, so every bin's conditional mean is O(1).
    rest = surv[top + 1]  # never seen to end: runs to the cap
    num, den = [0.0] * (top + 2), [0.0] * (top + 2)
    num[top + 1], den[top + 1] = rest * max_tokens, rest
    for b in range(top, -1, -1):
        mass = surv[b] - surv[b + 1]
        num[b] = num[b + 1] + mass * min(max_tokens, (b + 0.5) * width)
        den[b] = den[b + 1] + mass
    cond: list[float | None] = []
    for b in range(top + 1):
        ok = later_events[b] >= MIN_TAIL and den[b] > 0
        cond.append(num[b] / den[b] if ok else None)
    return _Tail(width, max_tokens, cond)


class LengthModel:
    def __init__(self) -> None:
        self._hist: dict[str, tuple[int, dict[int, int]]] = {}
        self._tails: dict[str, _Tail] = {}
        self.rate_tok_s: float | None = None  # per-request decode speed, EWMA

    def set_histogram(self, ds: str, max_tokens: int, raw: dict) -> None:
        width = max(1, max_tokens // BINS)
        counts = {int(k): int(v) for k, v in raw.items()}
        self._hist[ds] = (width, counts)
        self._tails[ds] = kaplan_meier_tail(width, max_tokens, counts, {})

    def set_running(self, ds: str, max_tokens: int, generated: Iterable[float], weight: float = 1.0) -> None:
        """Count requests still running (tokens so far) as censored lengths, each ``weight``
        times (this worker sees only its own share of the dataset's requests in flight)."""
        width, counts = self._hist.get(ds, (max(1, max_tokens // BINS), {}))
        censored: dict[int, float] = {}
        for g in generated:
            b = int(g // width)
            censored[b] = censored.get(b, 0.0) + weight
        self._tails[ds] = kaplan_meier_tail(width, max_tokens, counts, censored)

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
        tail = self._tails.get(ds)
        est = None
        if tail is not None and tail.cond:
            b = min(int(generated // tail.width), len(tail.cond) - 1)
            est = tail.cond[b]
        if est is None:
            # Nothing (or little) seen this long yet: anywhere between here and max_tokens.
            est = (generated + max_tokens) / 2
        return min(max_tokens, max(1, math.ceil(max(est, generated))))
