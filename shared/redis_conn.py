"""Redis connections with the project's settings, made in one place; waiting for Redis; its errors in one line.

Timeouts (any of them can be overridden in the URL, e.g. ``redis://host:6379/0?socket_timeout=30``; on a
``redis+sentinel://`` URL, which redis-py never parses, they apply to the master's connections and to the
sentinels', and any other option in its query is refused in one line):

- ``socket_connect_timeout`` 5 s: a host that drops SYNs (firewall) fails in 5 s.
- ``socket_timeout`` 10 s: a server that accepts but never answers (hung, SIGSTOPped,
  ``rediss://`` against a plain port) fails each command in 10 s instead of blocking forever.
  budgetq sends no blocking command (no BLPOP, no XREAD BLOCK: the collector reads with
  XRANGE), and its Lua scripts touch at most a few hundred keys (milliseconds), so 10 s is
  far above any legitimate reply time, even on a loaded machine.

redis-py retries a command on a dropped connection by itself (up to ~6 s with jittered
backoff; our scripts are idempotent, so such a retry never counts anything twice), but not
on a timeout (a hung server would cost 9 x 10 s per command) nor on a refused password.
Longer outages are handled by the callers' loops (shared.retry.retry_redis) and, at start,
by ``wait_ready`` / ``await_ready`` (up to ``redis_wait_s``).

Redis Sentinel: ``redis+sentinel://[USER:PASSWORD@]HOST:PORT[,HOST:PORT...]/SERVICE/DB`` names
the sentinels and the master's service name; every client made here then asks the sentinels
where the master is at each (re)connection, so after a failover the next reconnect (the
retries above) reaches the promoted replica. USER:PASSWORD are the master's (and replicas');
the sentinels are asked without a password.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, cast
from urllib.parse import parse_qs, unquote, urlsplit

import redis
import redis.asyncio as aredis
import redis.asyncio.retry as aretry
import redis.asyncio.sentinel as asentinel
import redis.sentinel
from redis.backoff import ExponentialWithJitterBackoff, NoBackoff
from redis.retry import Retry

from budgetq.shared import keys
from budgetq.shared.errors import BudgetqError, ConfigError
from budgetq.shared.retry import REDIS_DOWN, backoff_s

log = logging.getLogger("budgetq.redis")
CONNECT_TIMEOUT_S = 5.0
SOCKET_TIMEOUT_S = 10.0
_RETRY_ON = (redis.ConnectionError,)
_SCHEMES = ("redis", "rediss", "unix")
SENTINEL_SCHEME = "redis+sentinel"


def _retryable(exc: Exception) -> bool:
    # AuthenticationError is a ConnectionError in redis-py: retrying a wrong password only delays the error.
    return not isinstance(exc, redis.AuthenticationError)


class _SyncRetry(Retry):
    def call_with_retry(self, do, fail, is_retryable=None, with_failure_count=False):
        return super().call_with_retry(do, fail, lambda e: _retryable(e) and (is_retryable is None or
                                                                           is_retryable(e)), with_failure_count)


class _AsyncRetry(aretry.Retry):
    async def call_with_retry(self, do, fail, is_retryable=None, with_failure_count=False):
        return await super().call_with_retry(do, fail, lambda e: _retryable(e) and (is_retryable is None or
                                                                                 is_retryable(e)),
                                             with_failure_count)


def _backoff() -> ExponentialWithJitterBackoff:
    return ExponentialWithJitterBackoff(base=0.05, cap=1.0)


def check_url(url: str) -> None:
    """Raise ConfigError naming the (redacted) URL and what is wrong with it, before redis-py sees it."""
    from budgetq.shared.logs import redact_url

    shown = redact_url(url)
    if url.startswith(SENTINEL_SCHEME + "://"):
        parse_sentinel(url)
        _timeouts(url)  # its query (timeouts only, numbers above 0): one line now, not at the first connection
        return
    try:
        parts = urlsplit(url)
        port = parts.port  # ValueError for a non-numeric or out-of-range port
    except ValueError as exc:
        raise ConfigError(f"redis_url {shown!r}: {exc}") from None
    if parts.scheme not in _SCHEMES:
        raise ConfigError(f"redis_url {shown!r}: the scheme must be redis://, rediss:// (TLS), unix:// or "
                          f"redis+sentinel://")
    if parts.scheme == "unix":
        if not parts.path:
            raise ConfigError(f"redis_url {shown!r}: no socket path (unix:///path/to/redis.sock)")
        return
    if not parts.hostname:
        raise ConfigError(f"redis_url {shown!r}: no host (redis://HOST:PORT/DB)")
    if port == 0:
        raise ConfigError(f"redis_url {shown!r}: port 0")
    db = parts.path.strip("/")
    if db and not db.isdigit():
        raise ConfigError(f"redis_url {shown!r}: the path must be a database number, e.g. /0 (got /{db})")
    try:
        redis.connection.parse_url(url)
    except ValueError as exc:
        raise ConfigError(f"redis_url {shown!r}: {exc}") from None


@dataclass(frozen=True)
class SentinelUrl:
    """A parsed ``redis+sentinel://`` URL."""

    sentinels: list[tuple[str, int]]
    service: str
    db: int
    username: str | None
    password: str | None

    def master_kwargs(self) -> dict[str, Any]:
        return {"db": self.db, "username": self.username, "password": self.password}


def parse_sentinel(url: str) -> SentinelUrl:
    """``redis+sentinel://[USER:PASSWORD@]HOST:PORT[,HOST:PORT...]/SERVICE/DB``; ConfigError (one line,
    the password masked) when it is not that."""
    from budgetq.shared.logs import redact_url

    def bad(why: str) -> ConfigError:
        return ConfigError(f"redis_url {redact_url(url)!r}: {why} "
                           f"(after redis+sentinel:// comes [USER:PASSWORD@]HOST:PORT[,HOST:PORT...]/SERVICE/DB)")

    rest = url[len(SENTINEL_SCHEME) + 3:].split("?", 1)[0]
    netloc, _, path = rest.partition("/")
    creds, _, hosts = netloc.rpartition("@")
    username = password = None
    if creds:
        user, colon, pw = creds.partition(":")
        username, password = (unquote(user) or None), (unquote(pw) if colon else None)
    sentinels = []
    for item in hosts.split(","):
        host, colon, port = item.strip().rpartition(":")
        host = host.strip("[]")
        if not colon or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise bad(f"{item.strip() or 'an empty host'!r} is not HOST:PORT")
        sentinels.append((host, int(port)))
    service, _, db = path.strip("/").partition("/")
    if not service:
        raise bad("no SERVICE (the master's name in the sentinels' config)")
    if db and not db.isdigit():
        raise bad(f"the database must be a number (got /{db})")
    return SentinelUrl(sentinels, unquote(service), int(db or 0), username, password)


def _timeouts(url: str) -> dict[str, Any]:
    sentinel = url.startswith(SENTINEL_SCHEME + "://")
    # blank values kept on a sentinel URL only: redis-py's from_url ignores a blank one (so do we there)
    query = parse_qs(url.split("?", 1)[1] if "?" in url else "", keep_blank_values=sentinel)
    kw: dict[str, Any] = {"socket_connect_timeout": CONNECT_TIMEOUT_S, "socket_timeout": SOCKET_TIMEOUT_S}
    if not sentinel:
        # redis-py's from_url reads these from the URL itself
        return {k: v for k, v in kw.items() if k not in query}
    # A sentinel URL never reaches from_url: its timeouts go to the master's (and the sentinels') connections
    # here, and anything else in its query would be dropped without a word: refused instead.
    from budgetq.shared.logs import redact_url

    for name, values in query.items():
        if name not in kw:
            raise ConfigError(f"redis_url {redact_url(url)!r}: {name!r} is not an option of a redis+sentinel:// "
                              f"URL (it takes socket_timeout and socket_connect_timeout, in seconds)")
        try:
            seconds = float(values[-1])
        except ValueError:
            seconds = float("nan")
        if not 0 < seconds < float("inf"):
            raise ConfigError(f"redis_url {redact_url(url)!r}: {name} must be a number of seconds above 0 "
                              f"(got {values[-1]!r})")
        kw[name] = seconds
    return kw


def connect(url: str) -> redis.Redis:
    """A blocking client (producer, CLI, RQ bookkeeping). Works with redis://, rediss://, user:password@."""
    check_url(url)
    kw: dict[str, Any] = {"retry": _SyncRetry(_backoff(), retries=8, supported_errors=_RETRY_ON),
                          "health_check_interval": 15, **_timeouts(url)}
    if url.startswith(SENTINEL_SCHEME + "://"):
        return _sentinel_master(url, kw)
    return redis.Redis.from_url(url, **kw)


def _sentinel_kwargs(kw: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in kw.items() if k in ("socket_timeout", "socket_connect_timeout")}


def _sentinel_master(url: str, kw: dict[str, Any]) -> redis.Redis:
    s = parse_sentinel(url)
    sentinel = redis.sentinel.Sentinel(s.sentinels, sentinel_kwargs=_sentinel_kwargs(kw), **kw)
    return sentinel.master_for(s.service, **s.master_kwargs())


def connect_once(url: str, timeout_s: float = 3.0) -> redis.Redis:
    """A client that fails fast: short socket timeouts and no retries (``budgetq check``)."""
    kw: dict[str, Any] = {"socket_connect_timeout": timeout_s, "socket_timeout": timeout_s,
                          "retry": Retry(NoBackoff(), 0), "retry_on_error": []}
    if url.startswith(SENTINEL_SCHEME + "://"):
        return _sentinel_master(url, kw)
    return redis.Redis.from_url(url, **kw)


def aconnect(url: str, max_connections: int = 32) -> aredis.Redis:
    """An asyncio client on a *blocking* pool: with hundreds of tasks, a plain pool would
    raise MaxConnectionsError instead of waiting for a free connection."""
    check_url(url)
    kw: dict[str, Any] = {"health_check_interval": 15, **_timeouts(url),
                          "retry": _AsyncRetry(_backoff(), retries=8, supported_errors=_RETRY_ON)}
    if url.startswith(SENTINEL_SCHEME + "://"):
        # redis-py's sentinel pool is not a blocking one; the Batcher coalesces every task's calls
        # into a few pipelines, so it opens a few connections, not one per task.
        s = parse_sentinel(url)
        sentinel = asentinel.Sentinel(s.sentinels, sentinel_kwargs=_sentinel_kwargs(kw), **kw)
        return sentinel.master_for(s.service, **s.master_kwargs())
    pool = aredis.BlockingConnectionPool.from_url(url, max_connections=max_connections, timeout=30, **kw)
    # from_pool: the client owns its pool, so aclose() closes the pool's connections too (a client
    # built with connection_pool= leaves them open: unclosed transports when the loop ends).
    return aredis.Redis.from_pool(pool)


# XRANGE / XREVRANGE replies of a client without decode_responses (every client of ours): redis-py
# types them loosely (str | bytes | None), this is what they are.
StreamEntries = list[tuple[bytes, dict[bytes, bytes]]]


def stream_entries(reply: Any) -> StreamEntries:
    return cast(StreamEntries, reply or [])


def text(value: Any) -> str:
    """A Redis reply (bytes from a client without decode_responses) as str."""
    return value.decode() if isinstance(value, bytes) else str(value)


def dataset_names(conn: redis.Redis) -> list[str]:
    """The registered datasets (every run's, not only this config's), sorted."""
    return sorted(text(n) for n in conn.smembers(keys.DATASETS))


def describe(url: str) -> str:
    """host:port/db of a Redis URL, without user or password (safe to log)."""
    if url.startswith(SENTINEL_SCHEME + "://"):
        rest = url.split("://", 1)[1].split("?")[0].rsplit("@", 1)[-1]
        hosts, _, path = rest.partition("/")
        return f"sentinel {hosts} master {path.strip('/') or '?'}"
    try:
        parts = urlsplit(url)
        if parts.scheme == "unix":
            return parts.path
        return f"{parts.hostname or 'localhost'}:{parts.port or 6379}/{parts.path.strip('/') or '0'}"
    except ValueError:
        rest = url.split("://", 1)[-1].split("@")[-1]
        return rest.split("?")[0]


def is_fatal(exc: BaseException) -> bool:
    """An error that waiting will not fix: a refused password, a database that does not exist."""
    return isinstance(exc, redis.AuthenticationError) or (
        isinstance(exc, redis.ResponseError) and ("DB index" in str(exc) or "NOAUTH" in str(exc)
                                                  or "WRONGPASS" in str(exc)))


def explain(exc: BaseException, url: str) -> str:
    """One line for a Redis error: what went wrong, at which host (never the password), and what to do."""
    from budgetq.shared.logs import redact

    where = describe(url)
    text = redact(str(exc)) or type(exc).__name__
    low = text.lower()
    if "hello must be called" in low or "noauth" in low or "authentication required" in low:
        return (f"Redis at {where} requires a password: put it in the URL (redis://:PASSWORD@host:port/db, "
                f"or redis://USER:PASSWORD@... for an ACL user), best via BUDGETQ_REDIS_URL")
    if isinstance(exc, redis.AuthenticationError) or "wrongpass" in low:
        return f"Redis at {where} refused the user name or password ({text})"
    if "db index is out of range" in low:
        return f"redis_url: database {where.rsplit('/', 1)[-1]} does not exist on Redis at {where} ({text})"
    if isinstance(exc, redis.TimeoutError):
        return (f"Redis at {where} did not answer within the socket timeout ({text}): a hung server, a firewall, "
                f"or rediss:// (TLS) against a plain port?")
    if isinstance(exc, redis.sentinel.MasterNotFoundError):
        # redis-py's message holds the repr of every sentinel client it asked: keep its last error
        last = text.rsplit("> - ", 1)[1] if "> - " in text else "they answered, naming no master of that service"
        return f"cannot reach Redis at {where}: no sentinel named the master (last: {last})"
    if isinstance(exc, redis.BusyLoadingError):
        return f"Redis at {where} is still loading its data ({text})"
    if isinstance(exc, redis.ConnectionError | ConnectionError):
        return f"cannot reach Redis at {where}: {text}"
    return f"Redis at {where}: {type(exc).__name__}: {text}"


def _pause_or_raise(exc: redis.RedisError, url: str, what: str, started: float, attempt: int,
                    wait_s: float) -> float:
    """How long to wait before ping ``attempt + 1``; raises (one line) when waiting will not help."""
    if is_fatal(exc) or not isinstance(exc, REDIS_DOWN):
        raise BudgetqError(explain(exc, url)) from None
    waited = time.monotonic() - started
    if waited >= wait_s:
        raise BudgetqError(_gave_up(exc, url, waited, wait_s)) from None
    _log_waiting(what, url, exc, attempt, wait_s)
    return min(backoff_s(min(attempt, 6), 0.2, 5.0), wait_s - waited)


def wait_ready(conn: redis.Redis, url: str, wait_s: float, what: str,
               stop: Callable[[], bool] | None = None) -> bool:
    """Ping until Redis answers, with backoff and a log line, for up to ``wait_s`` (0: one try).

    Returns False if ``stop()`` became true first; raises BudgetqError (one line) when giving up
    or at once on an error that waiting will not fix (password, database number).
    """
    started, attempt = time.monotonic(), 0
    while True:
        try:
            conn.ping()
            if attempt:
                log.warning("%s: Redis at %s answers after %.1f s", what, describe(url), time.monotonic() - started)
            return True
        except redis.RedisError as exc:
            attempt += 1
            deadline = time.monotonic() + _pause_or_raise(exc, url, what, started, attempt, wait_s)
            while time.monotonic() < deadline:
                if stop is not None and stop():
                    return False
                time.sleep(min(0.1, max(0.0, deadline - time.monotonic())))
        if stop is not None and stop():
            return False


async def await_ready(ping: Callable[[], Awaitable[Any]], url: str, wait_s: float, what: str,
                      stop: asyncio.Event | None = None) -> bool:
    """``wait_ready`` for asyncio callers (``ping`` is e.g. ``aconn.ping``); returns False once ``stop`` is set."""
    started, attempt = time.monotonic(), 0
    while stop is None or not stop.is_set():
        try:
            if not await _unless_stopped(ping(), stop):
                return False
            if attempt:
                log.warning("%s: Redis at %s answers after %.1f s", what, describe(url), time.monotonic() - started)
            return True
        except redis.RedisError as exc:
            attempt += 1
            pause = _pause_or_raise(exc, url, what, started, attempt, wait_s)
            if stop is None:
                await asyncio.sleep(pause)
            else:
                try:
                    await asyncio.wait_for(stop.wait(), timeout=pause)
                except TimeoutError:
                    pass
    return False


async def _unless_stopped(aw: Awaitable[Any], stop: asyncio.Event | None) -> bool:
    """Await ``aw``; False (and ``aw`` cancelled) if ``stop`` is set first: a ping to a silent
    server must not hold a stop request for a whole socket timeout."""
    task = asyncio.ensure_future(aw)
    if stop is None:
        await task
        return True
    stopper = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({task, stopper}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopper.cancel()
    if not task.done():
        task.cancel()
        return False
    task.result()
    return True


def _gave_up(exc: BaseException, url: str, waited: float, wait_s: float) -> str:
    return explain(exc, url) + (f" (gave up after {waited:.0f} s; redis_wait_s {wait_s:g})" if wait_s else "")


def _log_waiting(what: str, url: str, exc: BaseException, attempt: int, wait_s: float) -> None:
    # The first try, then every 8th (a few per minute at the capped backoff): enough to see it is alive.
    if attempt == 1 or attempt % 8 == 0:
        log.warning("%s: waiting for Redis (up to %g s in all): %s", what, wait_s, explain(exc, url))
