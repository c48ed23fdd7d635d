"""Redis connections with the project's settings, made in one place.

redis-py retries a command on a dropped connection by itself (here up to ~6 s with jittered
backoff); our scripts are idempotent, so such a retry never counts anything twice. Longer
outages are handled by the callers' loops (shared.retry.retry_redis).
"""

from __future__ import annotations

import redis
import redis.asyncio as aredis
from redis.backoff import ExponentialWithJitterBackoff, NoBackoff
from redis.retry import Retry

_RETRY_ON = [redis.ConnectionError, redis.TimeoutError]


def _retry() -> Retry:
    return Retry(ExponentialWithJitterBackoff(base=0.05, cap=1.0), retries=8)


def connect(url: str) -> redis.Redis:
    """A blocking client (producer, CLI, RQ bookkeeping). Works with redis://, rediss://, user:password@."""
    return redis.Redis.from_url(url, retry=_retry(), retry_on_error=_RETRY_ON, health_check_interval=15)


def connect_once(url: str, timeout_s: float = 3.0) -> redis.Redis:
    """A client that fails fast: short socket timeouts and no retries (``budgetq check``)."""
    return redis.Redis.from_url(url, socket_connect_timeout=timeout_s, socket_timeout=timeout_s,
                                retry=Retry(NoBackoff(), 0), retry_on_error=[])


def aconnect(url: str, max_connections: int = 32) -> aredis.Redis:
    """An asyncio client on a *blocking* pool: with hundreds of tasks, a plain pool would
    raise MaxConnectionsError instead of waiting for a free connection."""
    pool = aredis.BlockingConnectionPool.from_url(url, max_connections=max_connections, timeout=30,
                                                  health_check_interval=15, retry=_retry(),
                                                  retry_on_error=_RETRY_ON)
    return aredis.Redis(connection_pool=pool)


def describe(url: str) -> str:
    """host:port/db of a Redis URL, without user or password (safe to log)."""
    rest = url.split("://", 1)[-1].split("@")[-1]
    return rest.split("?")[0]
