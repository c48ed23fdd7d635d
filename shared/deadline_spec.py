"""Deadlines written by people: ``12h``, ``1h30m``, ``2026-12-05T08:00:00Z`` (a leaf module: the
config model validates with it, shared/run_plan.py stores what it gives)."""

from __future__ import annotations

import math
import re
import time
from datetime import UTC, datetime

_DURATION = re.compile(r"^\s*(?:(\d+(?:\.\d+)?)d)?\s*(?:(\d+(?:\.\d+)?)h)?\s*(?:(\d+(?:\.\d+)?)m)?\s*"
                       r"(?:(\d+(?:\.\d+)?)s)?\s*$", re.IGNORECASE | re.ASCII)
_NONE = {"", "none", "null", "off"}
MAX_WEIGHT = 1e6


class PlanError(ValueError):
    """A deadline, total or weight that cannot be used; the message names the value."""


def parse_duration_s(value: str) -> float | None:
    """``12h``, ``90m``, ``1h30m``, ``45s``, ``2d`` -> seconds; None if it is not a duration."""
    m = _DURATION.match(value)
    if not m or not any(m.groups()):
        return None
    d, h, mi, s = (float(g) if g else 0.0 for g in m.groups())
    return d * 86400 + h * 3600 + mi * 60 + s


def parse_deadline(value: str | float | None, now: float) -> float | None:
    """A deadline as unix seconds: a duration from ``now`` ("12h", "+90m") or an ISO time
    ("2026-12-05T08:00:00Z"; without a zone: UTC); None for none/null/off."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise PlanError(f"deadline {value!r}: expected a duration like 12h or an ISO time")
    if isinstance(value, int | float):
        raise PlanError(f"deadline {value!r}: give a unit (e.g. {value}s, 12h) or an ISO time")
    raw = str(value).strip()
    if raw.lower() in _NONE:
        return None
    dur = parse_duration_s(raw.removeprefix("+"))
    if dur is not None:
        if dur <= 0 or not math.isfinite(dur) or dur > 366 * 86400:
            raise PlanError(f"deadline {raw!r}: a duration must be > 0 and at most 366 days")
        return now + dur
    try:
        when = datetime.fromisoformat(raw.replace("Z", "+00:00").replace("z", "+00:00"))
    except ValueError:
        raise PlanError(f"deadline {raw!r}: expected a duration (12h, 90m, 1h30m, 45s) or an ISO time "
                        "(2026-12-05T08:00:00Z)") from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return when.timestamp()


def check_deadline_spec(value: str | None) -> str | None:
    """Validate a config's deadline without fixing it to a time (config load)."""
    parse_deadline(value, time.time())
    return value


def format_when(ts: float | None) -> str:
    if ts is None:
        return "none"
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
