"""A run's budgets in what the operator has: a deadline and a total, split by weight (Redis side).

The settings live in one Redis hash (keys.PLAN) so that another shell can change them live
(`budgetq budget deadline|total|weight`) and a restarted producer finds the same deadline and
shares. The producer's control loop (producer/run/budget_loop.py) turns them into each dataset's
``limit``, the one ledger workers already obey, and publishes what it measured and projects
(keys.PLAN_STATE, JSON) for `budgetq status`, the monitor and `budgetq plan`.

A config value is applied when it differs from the one the last producer applied (the
``cfg:`` fields); otherwise the value in Redis stands, so a live change survives a restart
and a relative deadline ("12h") is not restarted by one.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

import redis

from budgetq.shared import keys
from budgetq.shared.deadline_spec import MAX_WEIGHT, PlanError, format_when, parse_deadline
from budgetq.shared.redis_conn import text

__all__ = ["MAX_WEIGHT", "PlanError", "PlanSettings", "format_when", "parse_deadline", "parse_weight"]

def parse_weight(value: str | float) -> float:
    try:
        w = float(value)
    except (TypeError, ValueError):
        raise PlanError(f"weight {value!r}: not a number") from None
    if not math.isfinite(w) or w <= 0 or w > MAX_WEIGHT:
        raise PlanError(f"weight {value!r}: must be > 0 and at most {MAX_WEIGHT:g}")
    return w


@dataclass
class PlanSettings:
    """What the operator asked for; each dataset's weight defaults to 1."""

    deadline: float | None = None
    total_budget: int | None = None
    weights: dict[str, float] = field(default_factory=dict)

    @property
    def managed(self) -> bool:
        """Whether limits are computed (a deadline or a total) rather than taken from each budget."""
        return self.deadline is not None or self.total_budget is not None

    def weight(self, ds: str) -> float:
        return self.weights.get(ds, 1.0)


def _opt_float(v: Any) -> float | None:
    if v in (None, b"", ""):
        return None
    try:
        x = float(text(v))
    except ValueError:
        return None
    return x if math.isfinite(x) else None


def read_settings(conn: redis.Redis) -> PlanSettings:
    raw = {text(k): text(v) for k, v in conn.hgetall(keys.PLAN).items()}
    weights = {}
    for k, v in raw.items():
        if k.startswith("weight:"):
            w = _opt_float(v)
            if w is not None and w > 0:
                weights[k.removeprefix("weight:")] = w
    total = _opt_float(raw.get("total_budget"))
    return PlanSettings(_opt_float(raw.get("deadline")), None if total is None else int(total), weights)


def _log(conn: redis.Redis, action: str, dataset: str, old: object, new: object) -> None:
    from budgetq.shared.control import log_action  # control imports the ledger; keep this module light

    log_action(conn, action, dataset, old, new)


def set_deadline(conn: redis.Redis, deadline: float | None) -> float | None:
    """Set (or clear, None) the deadline; returns the old one."""
    old = read_settings(conn).deadline
    conn.hset(keys.PLAN, "deadline", "" if deadline is None else f"{deadline:.3f}")
    _log(conn, "deadline_set", "*", format_when(old), format_when(deadline))
    return old


def set_total(conn: redis.Redis, total: int | None) -> int | None:
    old = read_settings(conn).total_budget
    conn.hset(keys.PLAN, "total_budget", "" if total is None else str(total))
    _log(conn, "total_set", "*", old if old is not None else "none", total if total is not None else "none")
    return old


def set_weight(conn: redis.Redis, dataset: str, weight: float) -> float:
    old = read_settings(conn).weight(dataset)
    conn.hset(keys.PLAN, f"weight:{dataset}", repr(weight))
    _log(conn, "weight_set", dataset, f"{old:g}", f"{weight:g}")
    return old


def apply_config(conn: redis.Redis, deadline_spec: str | None, total: int | None, weights: dict[str, float],
                 now: float) -> list[str]:
    """Write the config's values where they differ from those the last producer applied.

    Returns what was applied (for the log). A relative deadline is fixed to a time here, once:
    a restart with the same config keeps it.
    """
    raw = {text(k): text(v) for k, v in conn.hgetall(keys.PLAN).items()}
    applied = []
    spec = "" if deadline_spec is None else str(deadline_spec)
    # Absent means "no config value applied yet": the same as none, so a run without a deadline
    # or total writes and logs nothing (and keeps what an operator set live).
    if raw.get("cfg:deadline", "") != spec:
        when = parse_deadline(deadline_spec, now)
        conn.hset(keys.PLAN, mapping={"deadline": "" if when is None else f"{when:.3f}", "cfg:deadline": spec})
        _log(conn, "deadline_set", "*", format_when(_opt_float(raw.get("deadline"))), format_when(when) + " (config)")
        applied.append(f"deadline {format_when(when)}")
    tspec = "" if total is None else str(total)
    if raw.get("cfg:total_budget", "") != tspec:
        conn.hset(keys.PLAN, mapping={"total_budget": tspec, "cfg:total_budget": tspec})
        _log(conn, "total_set", "*", raw.get("total_budget") or "none", (tspec or "none") + " (config)")
        applied.append(f"total {tspec or 'none'}")
    for ds, w in weights.items():
        wspec = repr(float(w))
        if raw.get(f"cfg:weight:{ds}") != wspec:
            conn.hset(keys.PLAN, mapping={f"weight:{ds}": wspec, f"cfg:weight:{ds}": wspec})
            if f"cfg:weight:{ds}" in raw:
                _log(conn, "weight_set", ds, raw.get(f"weight:{ds}", "1"), f"{w:g} (config)")
            applied.append(f"weight {ds} {w:g}")
    return applied


# -- the drain marker: once admissions stopped for a deadline, they stay stopped for it ------------
def drain_deadline(conn: redis.Redis) -> float | None:
    return _opt_float(conn.hget(keys.PLAN, "drain_for"))


def mark_drain(conn: redis.Redis, deadline: float | None) -> None:
    conn.hset(keys.PLAN, "drain_for", "" if deadline is None else f"{deadline:.3f}")


def deadline_stopped(conn: redis.Redis, now: float) -> bool:
    """The run has a deadline and admissions stopped for it: the drain began (the budget loop
    marked it) or the deadline has passed (shared/ends.py's ``deadline`` stop reason)."""
    deadline, drain_for = (_opt_float(v) for v in conn.hmget(keys.PLAN, ["deadline", "drain_for"]))
    return deadline is not None and (now >= deadline or drain_for == deadline)


# -- what the control loop measured and projects --------------------------------------------------
def write_state(conn: redis.Redis, state: dict[str, Any]) -> None:
    conn.set(keys.PLAN_STATE, json.dumps(state, separators=(",", ":")))


def read_state(conn: redis.Redis) -> dict[str, Any] | None:
    raw = conn.get(keys.PLAN_STATE)
    if not raw:
        return None
    try:
        state = json.loads(raw)
    except ValueError:
        return None
    return state if isinstance(state, dict) else None


def status_part(conn: redis.Redis, now: float) -> dict[str, Any] | None:
    """The ``plan`` object of a status snapshot (docs/operations.md): None when the run has
    neither a deadline nor a total. Read-only."""
    if not conn.exists(keys.PLAN):
        return None
    s = read_settings(conn)
    if not s.managed:
        return None
    state = read_state(conn) or {}
    return {"deadline": s.deadline, "deadline_in_s": None if s.deadline is None else round(s.deadline - now, 1),
            "total_budget": s.total_budget, "weights": s.weights, "phase": state.get("phase"),
            "tok_s": state.get("tok_s"), "tail_s": state.get("tail_s"), "measured_at": state.get("at"),
            "datasets": state.get("datasets", {})}
