"""The one retry policy: exponential backoff with full jitter, for HTTP and for Redis.

Redis outages (restart, failover, network blip) are waited out by every loop that talks
to Redis: redis-py retries a command for a few seconds on its own (see redis_conn), and
``retry_redis`` keeps going beyond that, logging once per outage instead of once per try.

Not tenacity or backoff: the policy is a few lines, and what it must do around them (one log
line per outage and one when it ends, a stop request that ends the wait at once, the same
jittered delays for the HTTP client's attempts) would be as long written as their hooks.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import redis

T = TypeVar("T")
log = logging.getLogger("budgetq.retry")

# Errors that mean "Redis is not reachable right now" (as opposed to a bad command).
REDIS_DOWN = (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError, ConnectionError)


def backoff_s(attempt: int, base_s: float, max_s: float) -> float:
    """Delay before retry number ``attempt`` (1-based): full jitter in [0.5, 1.5] x base x 2^(n-1)."""
    return min(max_s, base_s * 2 ** (attempt - 1)) * random.uniform(0.5, 1.5)


async def retry_redis(fn: Callable[[], Awaitable[T]], what: str, give_up_after_s: float | None = None,
                      stop: asyncio.Event | None = None) -> T:
    """Await ``fn()`` until Redis answers; re-raise after ``give_up_after_s`` or once ``stop`` is set."""
    started = time.monotonic()
    attempt = 0
    while True:
        try:
            result = await fn()
            if attempt:
                log.warning("redis reachable again (%s) after %.1f s", what, time.monotonic() - started)
            return result
        except REDIS_DOWN as exc:
            attempt += 1
            waited = time.monotonic() - started
            if (give_up_after_s is not None and waited > give_up_after_s) or (stop is not None and stop.is_set()):
                raise
            if attempt == 1:
                log.warning("redis unreachable (%s): %s; retrying", what, exc)
            pause = backoff_s(min(attempt, 6), 0.1, 2.0)
            if stop is None:
                await asyncio.sleep(pause)
            else:  # a stop request ends the wait at once, not after the backoff
                try:
                    await asyncio.wait_for(stop.wait(), timeout=pause)
                except TimeoutError:
                    pass
