"""The arithmetic of budgets in what the operator has (pure: no Redis, no clock).

- ``water_fill``: split a total by weight, each share held within [floor, cap]: a dataset that
  is capped (its own budget) or ran out of prompts gives what it cannot spend to the others in
  proportion to their weights.
- ``byte_shares``: the same split for disk: features.max_bytes over the datasets that capture hidden
  states, each held within [bytes written, its own features_max_bytes].
- ``admitted_floor``: the least a dataset's share may be (what it admitted, up to its limit).
- ``prompts_allow``: an upper estimate of what a dataset's prompts let it count in all, so a dataset
  short of prompts gives its shortfall to the others early (before it runs out), never too much.
- ``deadline_total``: how many tokens the budgets can count by a deadline, from the fleet's
  measured rate and how long the last responses take (``tail_s``).
- ``RateMeter`` and ``Latencies``: the smoothed tok/s and the response-time quantile they need.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class Claim:
    """One dataset's part in a split."""

    name: str
    weight: float
    floor: int = 0           # already counted or in flight: a share is never below it
    cap: int | None = None   # the most it can use (own budget, or what its prompts allow); None: no cap


def admitted_floor(used: int, reserved: int, limit: int) -> int:
    """A dataset's floor in the split: what it has admitted (counted + in flight), never above its
    current limit.

    Not above the limit, because past it is a soft budget's overshoot, and a floor there would
    charge that overshoot to the others. A soft request's reservation grows as it runs (adjust.lua)
    and the last answer lands up to ``max_tokens`` past the limit: a floor that followed either
    would raise this dataset's share to what it happened to use, and, the total being fixed, lower
    the share of whichever dataset still runs by as much. With ten datasets each over by a few
    hundred tokens, that was the last one's whole margin (tests/test_samples_auto.py: -1.1%). Kept
    at the limit, each soft share still ends in ``[share, share + max_tokens)``, and the total by the
    sum of those overshoots, never one dataset's shortfall. Nor does a limit move down because of
    this: the share is at least the floor, so a crossed dataset's limit stays where it was crossed.
    """
    return max(0, min(used + reserved, limit))


def _bounds(c: Claim) -> tuple[float, float]:
    lo = float(max(0, c.floor))
    hi = math.inf if c.cap is None else float(max(c.cap, c.floor))
    return lo, hi


def _level_sum(level: float, claims: list[Claim]) -> float:
    total = 0.0
    for c in claims:
        lo, hi = _bounds(c)
        total += min(max(c.weight * level, lo), hi)
    return total


def water_fill(total: int, claims: list[Claim]) -> dict[str, int]:
    """Shares ``min(max(weight x level, floor), cap)`` whose sum is ``total`` (whole tokens).

    If the floors alone exceed the total, each gets its floor; if the caps add up to less, each
    gets its cap. The level is exact (breakpoints of a piecewise-linear sum), then shares are
    rounded down and the remainder handed out by largest fraction, so the sum is exact.
    """
    if not claims:
        return {}
    if any(c.weight <= 0 or not math.isfinite(c.weight) for c in claims):
        raise ValueError("water_fill: weights must be finite and > 0")
    total = max(0, int(total))
    floors = sum(_bounds(c)[0] for c in claims)
    caps = sum(_bounds(c)[1] for c in claims)
    if floors >= total:
        return {c.name: int(_bounds(c)[0]) for c in claims}
    if caps <= total:
        return {c.name: int(_bounds(c)[1]) for c in claims}
    # The sum rises with the level, linearly between breakpoints: find the segment holding total.
    points = sorted({b / c.weight for c in claims for b in _bounds(c) if math.isfinite(b)} | {0.0})
    lo_level = 0.0
    hi_level: float | None = None
    for p in points:
        if _level_sum(p, claims) >= total:
            hi_level = p
            break
        lo_level = p
    if hi_level is None:  # beyond the last breakpoint only uncapped claims still grow
        slope = sum(c.weight for c in claims if c.cap is None)
        level = lo_level + (total - _level_sum(lo_level, claims)) / slope
    else:
        s_lo, s_hi = _level_sum(lo_level, claims), _level_sum(hi_level, claims)
        frac = 0.0 if s_hi == s_lo else (total - s_lo) / (s_hi - s_lo)
        level = lo_level + frac * (hi_level - lo_level)
    exact = {c.name: min(max(c.weight * level, _bounds(c)[0]), _bounds(c)[1]) for c in claims}
    shares = {n: int(math.floor(v + 1e-9)) for n, v in exact.items()}
    left = total - sum(shares.values())
    # Hand the rounding remainder to those below their cap, largest fraction first.
    order = sorted(claims, key=lambda c: (-(exact[c.name] - shares[c.name]), c.name))
    while left > 0:
        gave = False
        for c in order:
            if left <= 0:
                break
            if shares[c.name] + 1 <= _bounds(c)[1]:
                shares[c.name] += 1
                left -= 1
                gave = True
        if not gave:
            break
    return shares


def byte_shares(total: int | None, weights: dict[str, float], caps: dict[str, int | None],
                written: dict[str, int]) -> dict[str, int | None]:
    """Each dataset's disk budget for hidden states: ``total`` (features.max_bytes) water-filled by weight as
    the token budgets are, a share never below what is written nor above the dataset's own cap
    (datasets[].features_max_bytes; a dataset done capturing is capped at what it wrote, so the rest goes
    to the others). Without a total, each dataset's own cap (None: unbounded)."""
    if total is None:
        return {n: caps.get(n) for n in weights}
    shares = water_fill(total, [Claim(n, w, floor=written.get(n, 0), cap=caps.get(n)) for n, w in weights.items()])
    return {n: shares[n] for n in weights}


# prompts_allow's margins: the measured mean is biased low while the long answers still run (short
# ones finish first), so it is raised by BIAS; Z standard deviations of the sum cover the spread.
ALLOW_BIAS = 1.15
ALLOW_Z = 3.0


def prompts_allow(used: int, reserved: int, in_flight: int, left: int, mean: float, sd: float,
                  max_tokens: int | None) -> int:
    """An upper estimate of the tokens a dataset can count in all, from what it counted, what is in
    flight (``in_flight`` requests holding ``reserved``) and the ``left`` prompts not sent yet (queued,
    skipped but reopenable, unread), each expected at ``mean`` (counted tokens per answer) +- ``sd``.

    It is a cap in the split (``water_fill``): a short dataset keeps what it can spend and the rest
    goes to the others from the start. It errs high on purpose: what it overstates reaches the
    others later, when the dataset runs out and its cap becomes exactly what it used (a dataset that
    had reached its share then reopens); what it understated would have let the others run past
    their final shares, which cannot be taken back. ``max_tokens`` (None: unknown, e.g. count: total)
    bounds each answer, so the estimate never exceeds what the prompts could possibly give.
    """
    n = max(0, in_flight) + max(0, left)
    if n == 0:
        return max(0, used)
    m = max(1.0, mean) * ALLOW_BIAS
    est = used + max(reserved, in_flight * m) + max(0, left) * m + ALLOW_Z * max(0.0, sd) * math.sqrt(n)
    est += m  # one more answer: a crossing result lands past the estimate by up to one response
    if max_tokens:
        est = min(est, used + n * max_tokens)
    return int(math.ceil(est))


def deadline_total(counted: int, in_flight: int, rate_tok_s: float, now: float, deadline: float,
                   tail_s: float) -> int:
    """Tokens the budgets will have counted by ``deadline``: what is counted, what is in flight,
    and what the fleet makes at ``rate_tok_s`` until admissions stop, ``tail_s`` before it."""
    admit_for = max(0.0, deadline - now - max(0.0, tail_s))
    return int(counted + in_flight + max(0.0, rate_tok_s) * admit_for)


def phase(now: float, deadline: float | None, tail_s: float) -> str:
    """none (no deadline), run (admitting), drain (admissions stopped: the last responses finish),
    over (the deadline has passed: what still runs is aborted)."""
    if deadline is None:
        return "none"
    if now >= deadline:
        return "over"
    if now >= deadline - max(0.0, tail_s):
        return "drain"
    return "run"


class RateMeter:
    """Counted tokens per second over a sliding window, from samples of a running total.

    The window starts at the first sample that shows progress, so the first wave (nothing can
    finish before the first responses) does not pull the rate down; ``rate`` is None until
    ``min_results`` results and a fifth of the window have been seen.
    """

    def __init__(self, window_s: float, min_results: int = 20) -> None:
        self.window_s = window_s
        self.min_results = min_results
        self._samples: deque[tuple[float, int, int]] = deque()
        self._base: tuple[int, int] | None = None

    def add(self, now: float, counted: int, results: int) -> None:
        if self._base is None:
            self._base = (counted, results)
        if not self._samples and counted <= self._base[0]:
            self._base = (counted, results)  # no progress yet: keep waiting for the first result
            return
        if self._samples and now <= self._samples[-1][0]:
            return
        self._samples.append((now, counted, results))
        while len(self._samples) > 2 and self._samples[1][0] <= now - self.window_s:
            self._samples.popleft()

    def rate(self) -> float | None:
        if len(self._samples) < 2 or self._base is None:
            return None
        t0, c0, _r0 = self._samples[0]
        t1, c1, r1 = self._samples[-1]
        span = t1 - t0
        if r1 - self._base[1] < self.min_results or span < min(self.window_s / 5, 60.0) or span <= 0:
            return None
        return max(0.0, (c1 - c0) / span)


class Latencies:
    """The most recent response times (seconds), and their quantiles."""

    def __init__(self, keep: int = 2000) -> None:
        self._values: deque[float] = deque(maxlen=keep)

    def add(self, seconds: float) -> None:
        if math.isfinite(seconds) and seconds >= 0:
            self._values.append(seconds)

    def __len__(self) -> int:
        return len(self._values)

    def quantile(self, q: float) -> float | None:
        if not self._values:
            return None
        xs = sorted(self._values)
        k = min(len(xs) - 1, max(0, math.ceil(q * len(xs)) - 1))
        return xs[k]
