"""Server faults by reason, per endpoint: counted by workers, read by ``budgetq status`` and ``produce``.

Why: a server that answers every request with an error (a proxy's HTML 500 page in front of a
dead SGLang, a 413 from a gateway, a refused port) used to look like a quiet run: the worker
retried, ejected the endpoint, and waited for its /health while the producer waited for rows.
Now each worker counts every failed answer by a short reason (``HTTP 500 text/html``,
``connection refused``, ``invalid request (HTTP 500)``) per endpoint, with the time of its
last fault and of its last success, and publishes them next to its status hash
(``keys.server_faults_key``, same TTL). ``diagnose`` folds the live workers' views into one
line: ``2/2 servers failing: HTTP 500 text/html``.

An endpoint is *failing* when every live worker that uses it has it ejected, or its most recent
answer anywhere was a fault that ends a streak of at least ``FAILING_STREAK`` (no success since):
one refused prompt (a 400 for a prompt too long) is counted but does not make a server failing.
Shared: the worker writes, status reads; neither imports the other.

Beside it, ``stall``: the line of a fleet where nothing can move at all, every server failing or
no live worker while prompts wait (``no worker is running: 262 prompts queued (...)``), which
otherwise looks as quiet as a server fault did.
"""

from __future__ import annotations

import errno
import html
import json
import re
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import redis

from budgetq.shared import keys
from budgetq.shared.logs import redact_url
from budgetq.shared.redis_conn import text

MESSAGE_CHARS = 200      # of the last fault's server message kept (an HTML page is cut)
FAILING_STREAK = 3       # faults in a row, no success between, that make an endpoint failing
_TITLE = re.compile(r"<title[^>]*>(.*?)</title>", re.IGNORECASE | re.DOTALL)
_TAG = re.compile(r"<[^>]+>")
_KINDS = {"text/html": "text/html", "text/plain": "text/plain", "application/json": "JSON"}


def brief(message: str) -> str:
    """A server message in one short line: an HTML page by its <title> (or its text without tags)."""
    if "<" in message and ">" in message:
        m = _TITLE.search(message)
        message = html.unescape(m.group(1) if m else _TAG.sub(" ", message))
    return " ".join(message.split())[:MESSAGE_CHARS]


def content_kind(content_type: str | None) -> str:
    """``text/html; charset=utf-8`` -> ``text/html``; JSON bodies -> ``JSON``; none -> ``no body type``."""
    base = (content_type or "").split(";", 1)[0].strip().lower()
    if not base:
        return "no body type"
    return _KINDS.get(base, "JSON" if base.endswith("+json") else base)


def http_reason(status: int, content_type: str | None, invalid: bool = False) -> str:
    """The reason of one error answer: ``HTTP 500 text/html``; a refused request: ``invalid request (HTTP 500)``."""
    if invalid:
        return f"invalid request (HTTP {status})"
    return f"HTTP {status} {content_kind(content_type)}"


def unreadable_reason(content_type: str | None) -> str:
    """A 200 whose body is not the JSON object the API promises (an HTML login page, a truncated body)."""
    return f"non-JSON answer ({content_kind(content_type)})"


def transport_reason(exc: BaseException) -> str:
    """A request that got no HTTP answer: refused, timed out, dropped."""
    # Imported here: only the worker calls this, and it has aiohttp loaded already; `budgetq status`
    # imports this module too and need not load aiohttp for it.
    import aiohttp

    name = type(exc).__name__
    cause = str(exc).lower()
    if isinstance(exc, TimeoutError) or "timeout" in name.lower():
        return "timeout"
    # aiohttp says "Connect call failed" for a refused port; the errno of the OSError it wraps says which.
    os_error = exc.os_error if isinstance(exc, aiohttp.ClientConnectorError) else exc
    if (isinstance(os_error, OSError) and os_error.errno == errno.ECONNREFUSED) or "refused" in cause:
        return "connection refused"
    if "ClientConnectorError" in name or "ConnectorError" in name:
        return "cannot connect"
    if "Disconnected" in name or "reset" in cause:
        return "connection dropped"
    if "Payload" in name:
        return "truncated answer"
    return name


@dataclass
class EndpointFaults:
    """One worker's counts for one endpoint."""

    counts: Counter[str] = field(default_factory=Counter)
    last_reason: str | None = None
    last_message: str | None = None
    last_fault_at: float | None = None
    last_ok_at: float | None = None
    streak: int = 0             # faults since the last success

    def fault(self, reason: str, message: str = "", now: float | None = None) -> None:
        self.counts[reason] += 1
        self.streak += 1
        self.last_reason, self.last_message = reason, brief(message)
        self.last_fault_at = time.time() if now is None else now

    def ok(self, now: float | None = None) -> None:
        self.last_ok_at = time.time() if now is None else now
        self.streak = 0

    def to_json(self, healthy: bool) -> dict[str, Any]:
        return {"healthy": healthy, "counts": dict(self.counts), "last_reason": self.last_reason,
                "last_message": self.last_message, "last_fault_at": self.last_fault_at,
                "last_ok_at": self.last_ok_at, "streak": self.streak}


def publish(pipe: Any, worker: str, endpoints: dict[str, dict[str, Any]], ttl_s: int) -> None:
    """Queue this worker's fault view (url -> ``EndpointFaults.to_json``) on ``pipe`` (sync or async)."""
    key = keys.server_faults_key(worker)
    pipe.set(key, json.dumps(endpoints), ex=max(1, ttl_s))


@dataclass
class EndpointView:
    """An endpoint as all live workers see it together."""

    url: str
    counts: Counter[str] = field(default_factory=Counter)
    workers: int = 0
    healthy_workers: int = 0
    last_reason: str | None = None
    last_message: str | None = None
    last_fault_at: float | None = None
    last_ok_at: float | None = None
    streak: int = 0             # the longest of the workers' current streaks

    @property
    def failing(self) -> bool:
        if self.workers and not self.healthy_workers:
            return True
        return (self.streak >= FAILING_STREAK and self.last_fault_at is not None
                and (self.last_ok_at is None or self.last_fault_at > self.last_ok_at))

    def to_json(self) -> dict[str, Any]:
        return {"url": self.url, "failing": self.failing, "counts": dict(self.counts), "workers": self.workers,
                "healthy_workers": self.healthy_workers, "last_reason": self.last_reason,
                "last_message": self.last_message, "last_fault_at": self.last_fault_at,
                "last_ok_at": self.last_ok_at}


def _fold(views: dict[str, EndpointView], url: str, e: dict[str, Any]) -> None:
    v = views.setdefault(url, EndpointView(url))
    v.workers += 1
    v.healthy_workers += 1 if e.get("healthy", True) else 0
    streak = e.get("streak")
    if isinstance(streak, int):
        v.streak = max(v.streak, streak)
    for reason, n in (e.get("counts") or {}).items():
        if isinstance(n, int | float):
            v.counts[str(reason)] += int(n)
    fault_at, ok_at = e.get("last_fault_at"), e.get("last_ok_at")
    if isinstance(fault_at, int | float) and (v.last_fault_at is None or fault_at > v.last_fault_at):
        v.last_fault_at, v.last_reason = float(fault_at), e.get("last_reason")
        v.last_message = e.get("last_message")
    if isinstance(ok_at, int | float) and (v.last_ok_at is None or ok_at > v.last_ok_at):
        v.last_ok_at = float(ok_at)


def read(conn: redis.Redis) -> list[EndpointView]:
    """Every endpoint some live worker reports, its faults summed over those workers (read-only)."""
    names = sorted(text(n) for n in conn.smembers(keys.WORKERS))
    raws = conn.mget([keys.server_faults_key(n) for n in names]) if names else []
    views: dict[str, EndpointView] = {}
    for raw in raws:
        try:
            eps = json.loads(text(raw)) if raw else {}
        except ValueError:
            continue
        for url, e in (eps.items() if isinstance(eps, dict) else []):
            if isinstance(e, dict):
                _fold(views, redact_url(str(url)), e)
    return sorted(views.values(), key=lambda v: v.url)


def diagnosis(views: list[EndpointView]) -> str | None:
    """One line saying which servers fail and why, or None when none does.

    ``2/2 servers failing: HTTP 500 text/html`` when they fail alike; otherwise each failing
    URL with its reason. The last server message follows when all failing servers gave the same."""
    failing = [v for v in views if v.failing]
    if not failing:
        return None
    reasons = {v.last_reason or "ejected" for v in failing}
    head = f"{len(failing)}/{len(views)} server{'s' if len(views) != 1 else ''} failing"
    if len(reasons) == 1:
        line = f"{head}: {reasons.pop()}"
    else:
        line = f"{head}: " + "; ".join(f"{v.url} {v.last_reason or 'ejected'}" for v in failing)
    messages = {v.last_message or "" for v in failing}
    if len(messages) == 1 and (message := messages.pop()):  # the same server message everywhere
        line += f" ({message})"
    return line


def no_worker(queued: int, running: int = 0) -> str:
    """The one line of a fleet with prompts waiting and no live worker to take them.

    ``running``: jobs still claimed by workers that are gone (their leases are renewed by nobody;
    the next worker's maintenance requeues them)."""
    line = f"no worker is running: {queued:,} prompt{'s' if queued != 1 else ''} queued"
    if running:
        line += f", {running:,} claimed by workers that are gone"
    return line + " (start `budgetq worker -c CONFIG`)"


def stall(views: list[EndpointView], workers: int, queued: int, running: int = 0) -> str | None:
    """Why no prompt can move at all, in one line, or None while something can.

    No live worker while prompts wait (``no_worker``), or every server some live worker uses
    failing (``diagnosis``). Some servers failing is not a stall: the others take the prompts."""
    if not workers and queued + running:
        return no_worker(queued, running)
    if views and all(v.failing for v in views):
        return diagnosis(views)
    return None


def diagnose(conn: redis.Redis) -> str | None:
    """``diagnosis(read(conn))``: what ``budgetq status`` and ``produce`` print."""
    return diagnosis(read(conn))
