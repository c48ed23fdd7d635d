"""Response lengths: lognormal, deterministic per (seed, rid) so retries and policies see the same length.

budgetq sends a fresh rid per attempt, ``<job id>.<12 hex>`` (worker/sglang_client.py); the
draw ignores that suffix, so every attempt of a job, in every run, gets the same length and
benchmarks compare policies on the same responses. (A real server samples each attempt anew;
the simulator trades that for reproducible measurements.)
"""

from __future__ import annotations

import hashlib
import math
import random
import re
from statistics import NormalDist

_UNIT = NormalDist()
_ATTEMPT = re.compile(r"\.[0-9a-f]{12}$")


def draw_key(rid: str) -> str:
    """The part of a rid a length depends on: without budgetq's per-attempt suffix."""
    return _ATTEMPT.sub("", rid)


def rid_uniform(seed: int, rid: str) -> float:
    """A uniform in (0, 1) that depends only on the seed and the rid (not on arrival order)."""
    digest = hashlib.blake2b(f"{seed}\x00{rid}".encode(), digest_size=8).digest()
    return (int.from_bytes(digest, "big") + 0.5) / 2.0**64


class LengthModel:
    """Lognormal lengths with a given mean, optionally a different mean per rid prefix."""

    def __init__(self, seed: int, mean: float, sigma: float, means: dict[str, float] | None = None) -> None:
        self.seed = seed
        self.mean = mean
        self.sigma = sigma
        # Longest prefix first, so "A1-x=..." beats "A1-=..." for a rid "A1-x-7".
        self.means = sorted((means or {}).items(), key=lambda kv: -len(kv[0]))
        self._rng = random.Random(seed)

    def mean_for(self, rid: str | None) -> float:
        if rid:
            for prefix, mean in self.means:
                if rid.startswith(prefix):
                    return mean
        return self.mean

    def draw(self, rid: str | None) -> int:
        """Tokens the simulated model wants to write for ``rid`` (>= 1), before any max_tokens cap.

        With a rid the draw is a pure function of (seed, rid); without one it comes from the seeded
        random stream, so it depends on arrival order.
        """
        u = rid_uniform(self.seed, draw_key(rid)) if rid else self._rng.random() or 0.5
        sigma = self.sigma
        # lognormal with E[X] = mean: mu = ln(mean) - sigma^2 / 2
        mu = math.log(self.mean_for(rid)) - sigma * sigma / 2
        return max(1, round(math.exp(mu + sigma * _UNIT.inv_cdf(u))))
