"""One status snapshot of a budgetq deployment, read from Redis.

The single source for ``budgetq status`` (text and ``--json``), the web monitor's page and
JSON API, its Prometheus ``/metrics``, and the producer's progress display. Read-only: it
never writes to Redis and never runs RQ's registry cleanup, so it is safe to call every
second from many places (and works with a read-only Redis ACL user).

The schema is documented field by field in docs/operations.md; ``SCHEMA_VERSION`` changes
only when a field is removed or changes meaning (adding a field does not).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import redis

from budgetq.shared import features_bytes, keys, presence, run_plan, server_faults, server_kind
from budgetq.shared.budget import DatasetState, dataset_state
from budgetq.shared.config import Config
from budgetq.shared.durations import format_duration as format_duration  # re-exported: its old home
from budgetq.shared.durations import format_eta as format_eta
from budgetq.shared.ends import Stop, dataset_eta, prompts_left, stop_reason
from budgetq.shared.ledger import is_settled, read_ledgers
from budgetq.shared.logs import redact_url
from budgetq.shared.redis_conn import dataset_names, describe, stream_entries, text
from budgetq.shared.stats import discards_by_reason

# 2: counts.duplicate -> duplicate_result; a done dataset's tok_s is null; ledger.
# 3: a held dataset's state is "held" (it was "paused") and its paused is the operator's pause only;
#    failed_registry removed (it was ledger.failed); eta_s is null while paused, held or stalled.
# 4: eta_s is the time to the first of the dataset's ends (budget, prompts, deadline: shared/ends.py),
#    where it was to the budget alone; stop, eta_by, prompts_left and ledger.unread added.
# 5: ledger.discarded (a state: the guard or a gate refused the answer); counts.discarded and
#    counts.discard_retried; tokens.spent (= generated), tokens.kept (the rows' completion tokens),
#    tokens.truncated and tokens.discarded; discarded_by_reason; budget_counts (kept | spent).
SCHEMA_VERSION = 5
TOK_S_WINDOW_S = 60          # tok/s is averaged over this many seconds
HISTORY_S = 600              # the tokens-over-time series covers this many seconds
CONTROL_ENTRIES = 10         # operator actions shown
AUTO_ENTRIES = 5             # the producer's automatic budget moves shown, apart
# Moves an earlier version logged with people's actions: left out of them when read.
_LEGACY_AUTO = {"budget_total", "budget_deadline"}
# Event counters of the stats hash (how often each thing happened, cumulative), always present
# in a snapshot (0 when missing). Where the prompts are now is the ledger (shared/ledger.py).
COUNT_FIELDS = ("committed", "truncated", "skipped", "failed", "invalid", "duplicate_result", "aborted",
                "rejected", "requeued", "retried", "recovered", "reopened", "retried_failed", "enqueued",
                "adopted", "filtered", "discarded", "discard_retried", "lost_commit")
# Token counters of the stats hash -> their names in a snapshot's "tokens" object. spent: every token
# the servers generated (= generated); kept: the rows' completion tokens; what the budget counts is
# "counted" (kept, or spent, per the dataset's budget_counts: docs/budget.md "Spent and kept").
TOKEN_FIELDS = {"sum_tokens": "counted", "generated_tokens": "generated", "wasted_tokens": "wasted",
                "kept_tokens": "kept", "truncated_tokens": "truncated", "discarded_tokens": "discarded"}


def _num(v: Any, kind: type = int, default: Any = 0) -> Any:
    """A number from a Redis field written by another process; a missing or bad one -> default."""
    try:
        x = float(text(v)) if v is not None else math.nan
    except ValueError:
        return default
    if math.isnan(x) or math.isinf(x):
        return default
    return int(x) if kind is int else x


def configured_server_urls(cfg: Config) -> list[str]:
    """The SGLang URLs to list even before a worker reports them: only if someone set them (the
    built-in default would show a server nobody runs)."""
    return cfg.server.urls if "server" in cfg.model_fields_set else []


def server_now(conn: redis.Redis) -> float:
    """Redis' clock: rate buckets are keyed on it, so ours must not drift from it."""
    sec, usec = conn.time()
    return sec + usec / 1e6


def _bucket(t: float) -> int:
    return int(t // keys.RATE_BUCKET_S) * keys.RATE_BUCKET_S


@dataclass(frozen=True)
class Fleet:
    """What generation runs on: the live workers and the servers' faults as they see them."""

    workers: int
    faults: list[server_faults.EndpointView]


# A worker that has not refreshed its hash for this long (and three of its publish intervals) is
# taken for gone, before its hash expires (2 x heartbeat_ttl_s, a minute by default): a killed
# worker then shows in `status` and produce's stall line within seconds, not a minute.
SILENT_S = 10.0


def is_live(fields: dict[str, str], pttl_ms: int) -> bool:
    """Whether a worker hash (and its remaining TTL, ms) belongs to a worker still publishing. The
    age comes from the TTL the worker set at its last publish (its ``expire_s``): Redis's clock,
    whatever the hosts' clocks say. A hash without ``expire_s`` (an older worker) is live while it exists."""
    if not fields or pttl_ms == -2:
        return False
    expire_s = _num(fields.get("expire_s"), float, None)
    if expire_s is None or pttl_ms < 0:
        return True
    silent_s = expire_s - pttl_ms / 1000
    return silent_s <= max(SILENT_S, 3 * (_num(fields.get("publish_s"), float, 1.0) or 1.0))


def _worker_hashes(conn: redis.Redis) -> list[tuple[str, dict[str, str]]]:
    """(name, fields) of every live worker."""
    names = sorted(text(n) for n in conn.smembers(keys.WORKERS))
    if not names:
        return []
    pipe = conn.pipeline(transaction=False)
    for n in names:
        pipe.hgetall(keys.worker_key(n))
        pipe.pttl(keys.worker_key(n))
    replies = pipe.execute()
    out = []
    for i, name in enumerate(names):
        fields = {text(k): text(v) for k, v in replies[2 * i].items()}
        if is_live(fields, int(replies[2 * i + 1])):
            out.append((name, fields))
    return out


def live_workers(conn: redis.Redis) -> int:
    """Workers still publishing (as ``worker_snapshots`` counts them)."""
    return len(_worker_hashes(conn))


def read_fleet(conn: redis.Redis) -> Fleet:
    return Fleet(live_workers(conn), server_faults.read(conn))


def fleet_stall(fleet: Fleet, ledgers: Iterable[dict[str, Any]]) -> str | None:
    """Why no prompt of these datasets can move at all, in one line (shared/server_faults.py ``stall``)."""
    ledgers = list(ledgers)
    return server_faults.stall(fleet.faults, fleet.workers, sum(led["queued"] for led in ledgers),
                               sum(led["running"] for led in ledgers))


def _state(st: DatasetState, ledger: dict[str, Any], paused: bool) -> str:
    # A hold first: while the output disk refuses rows, `resume` would not help, the hold's reason does.
    if st.hold:
        return "held"
    if paused:
        return "paused"
    if st.exhausted:
        return "draining" if st.in_flight else "done"
    if st.source_ended and is_settled(ledger):
        return "done"  # every row read, and every prompt has ended
    if st.in_flight or not is_settled(ledger):
        return "running"
    return "idle"


def _rate(st: DatasetState, buckets: dict[int, int], now: float) -> float:
    """Tokens per second over the last TOK_S_WINDOW_S (from this run's registration on, if later)."""
    start = _bucket(now) - TOK_S_WINDOW_S
    since: float = start
    if st.registered_at is not None and st.registered_at > start:
        start, since = _bucket(st.registered_at), st.registered_at
    tokens = sum(v for t, v in buckets.items() if t >= start)
    return tokens / max(1.0, now - since)


def dataset_snapshots(conn: redis.Redis, names: Iterable[str], now: float,
                      history_s: int = HISTORY_S, fleet: Fleet | None = None) -> list[dict[str, Any]]:
    """Budget, progress, counters, tok/s, ETA and recent history of each named dataset.

    ``fleet``: the workers and server faults, if the caller has read them already (else read here):
    while the fleet is stalled no ETA is given, since nothing moves toward it. The stop reason and
    the ETA are shared/ends.py's (the ETA: the first of the budget, the prompts and the deadline)."""
    names = list(names)
    states = [dataset_state(conn, n) for n in names]
    ledgers = read_ledgers(conn, names)
    deadline = run_plan.read_settings(conn).deadline
    deadline_stopped = run_plan.deadline_stopped(conn, now)
    producer_gone = presence.read(conn) is None
    stalled = fleet_stall(fleet if fleet is not None else read_fleet(conn), ledgers.values()) is not None
    n_hist = max(history_s, TOK_S_WINDOW_S + keys.RATE_BUCKET_S) // keys.RATE_BUCKET_S
    last = _bucket(now)
    fields = [last - i * keys.RATE_BUCKET_S for i in range(n_hist - 1, -1, -1)]
    pipe = conn.pipeline(transaction=False)
    for n in names:
        pipe.hmget(keys.rate_key(n), [str(f) for f in fields])
        pipe.hgetall(keys.discards_key(n))
    replies = pipe.execute()
    out = []
    for i, st in enumerate(states):
        rate_vals, discards = replies[2 * i], replies[2 * i + 1]
        # DatasetState.paused also covers a hold (workers treat both alike); status tells them apart.
        paused = st.operator_paused
        ledger = ledgers[st.name]
        state = _state(st, ledger, paused)
        buckets = {t: _num(v) for t, v in zip(fields, rate_vals, strict=True)}
        # The last minute's committed tokens: it falls to 0 within a minute of the last commit, so a
        # stopped dataset shows what its requests still in flight bring, then nothing.
        tok_s: float | None = _rate(st, buckets, now)
        remaining = max(0, st.limit - st.used)
        eta: float | None = None
        eta_by: str | None = None
        stop = stop_reason(st, ledger, deadline_stopped, producer_gone)
        if state == "done":
            tok_s = None  # nothing more will come: no rate, no ETA (the last minute's rate would lie)
        elif state not in ("paused", "held") and not stalled and stop is not Stop.INTERRUPTED:
            # (paused, held, stalled or no producer: nothing is admitted, or can run, or is enqueued)
            end = dataset_eta(st, ledger, tok_s, None if deadline is None else deadline - now)
            eta, eta_by = end.seconds, end.by
        committed = st.stats.get("committed", 0)
        history = [[t, buckets[t]] for t in fields if t > last - history_s]
        out.append({
            "dataset": st.name,
            "state": state,
            "mode": st.mode,
            "count": st.count,
            "keep": st.keep,
            "paused": paused,
            "hold": st.hold or None,
            "exhausted": st.exhausted,
            "budget": st.limit,
            "used": st.used,
            "remaining": remaining,
            "used_pct": round(100.0 * st.used / st.limit, 3) if st.limit else None,
            "reserved": st.reserved,
            "in_flight": st.in_flight,
            "queued": ledger["queued"],
            "max_tokens": st.max_tokens,
            "prior_mean": st.prior_mean,
            "mean_tokens": round(st.stats.get("sum_tokens", 0) / committed, 1) if committed else None,
            "counts": {f: st.stats.get(f, 0) for f in COUNT_FIELDS},
            "budget_counts": st.budget_counts,
            "tokens": {**{name: st.stats.get(f, 0) for f, name in TOKEN_FIELDS.items()},
                       "spent": st.stats.get("generated_tokens", 0)},
            "discarded_by_reason": discards_by_reason(discards),
            "tok_s": None if tok_s is None else round(tok_s, 2),
            "eta_s": None if eta is None else round(eta, 1),
            "eta_by": eta_by,
            "stop": str(stop),
            "prompts_left": prompts_left(ledger),
            "registered_at": st.registered_at,
            "history": history,
            "ledger": ledger,
        })
    return out


def _server_view(e: dict[str, Any]) -> dict[str, Any]:
    """What a worker found the server to be: its kind (shared/server_kind.py; null until asked), the
    model its requests name, and its own load as a worker last read it."""
    kind = e.get("kind") if e.get("kind") in server_kind.KINDS else None
    raw = e.get("load") if isinstance(e.get("load"), dict) else None
    load = None if raw is None else {
        "running": _num(raw.get("running"), int, None), "waiting": _num(raw.get("waiting"), int, None),
        "kv_cache_use": _num(raw.get("kv_cache_use"), float, None), "slots": _num(raw.get("slots"), int, None),
        "read_at": _num(raw.get("read_at"), float, None)}
    return {"kind": kind, "model": str(e["model"]) if e.get("model") is not None else None, "load": load}


def worker_snapshots(conn: redis.Redis, now: float) -> list[dict[str, Any]]:
    """Live workers (a name whose hash has expired, or gone silent, is a dead worker and is left out)."""
    out = []
    for name, h in _worker_hashes(conn):
        try:
            eps = json.loads(h.get("endpoints") or "{}")
        except ValueError:
            eps = {}
        endpoints = {}
        for url, e in (eps.items() if isinstance(eps, dict) else []):
            e = e if isinstance(e, dict) else {}
            endpoints[redact_url(str(url))] = {
                "healthy": bool(e.get("healthy", False)),
                "in_flight": _num(e.get("in_flight")),
                "failures": _num(e.get("failures")),
                "ejected_since": _num(e.get("ejected_since"), float, None),
                # prefix routing: prompt tokens answered and those the server had cached
                "prompt_tokens": _num(e.get("prompt_tokens")),
                "cached_tokens": _num(e.get("cached_tokens")),
                **_server_view(e),
            }
        started = _num(h.get("started_at"), float, None)
        out.append({
            "name": name,
            "host": h.get("host"),
            "pid": _num(h.get("pid"), int, None),
            "started_at": started,
            "uptime_s": None if started is None else round(max(0.0, now - started), 1),
            "concurrency": _num(h.get("concurrency")),
            "in_flight": _num(h.get("in_flight")),
            "processed": _num(h.get("processed")),
            "endpoints": endpoints,
        })
    return out


def endpoint_summary(workers: list[dict[str, Any]], configured: Iterable[str] = ()) -> list[dict[str, Any]]:
    """Endpoints as the live workers see them: healthy if any worker sees it healthy, in flight summed.
    A configured URL no live worker reports is listed with ``healthy: null`` (unknown)."""
    agg: dict[str, dict[str, Any]] = {}

    def fresh(url: str) -> dict[str, Any]:
        return {"url": url, "healthy": None, "in_flight": 0, "failures": 0, "workers": 0, "healthy_workers": 0,
                "ejected_since": None, "prompt_tokens": 0, "cached_tokens": 0, "kind": None, "model": None,
                "load": None}

    for url in configured:
        agg.setdefault(redact_url(url), fresh(redact_url(url)))
    for w in workers:
        for url, e in w["endpoints"].items():
            a = agg.setdefault(url, fresh(url))
            a["kind"] = a["kind"] or e.get("kind")
            a["model"] = a["model"] or e.get("model")
            load = e.get("load")   # the server's own numbers: the latest read of any worker, not a sum
            if load and (a["load"] is None or (load["read_at"] or 0) > (a["load"]["read_at"] or 0)):
                a["load"] = load
            a["prompt_tokens"] += e["prompt_tokens"]   # over the live workers' lifetimes
            a["cached_tokens"] += e["cached_tokens"]
            a["workers"] += 1
            a["in_flight"] += e["in_flight"]
            a["failures"] += e["failures"]
            if e["healthy"]:
                a["healthy_workers"] += 1
            elif e["ejected_since"] is not None:
                prev = a["ejected_since"]
                a["ejected_since"] = e["ejected_since"] if prev is None else min(prev, e["ejected_since"])
            a["healthy"] = a["healthy_workers"] > 0
    return sorted(agg.values(), key=lambda a: a["url"])


def control_entries(conn: redis.Redis, n: int = CONTROL_ENTRIES, auto: bool = False) -> list[dict[str, Any]]:
    """The last ``n`` operator actions (people's), newest first; ``auto``: the producer's
    automatic budget moves instead (shared/control.py log_action)."""
    out: list[dict[str, Any]] = []
    stream = keys.CONTROL_AUTO_LOG if auto else keys.CONTROL_LOG
    # people's log may still hold an earlier version's pace steps: read past them
    for eid, fields in stream_entries(conn.xrevrange(stream, count=n if auto else 10 * n)):
        f = {text(k): text(v) for k, v in fields.items()}
        if not auto and f.get("action") in _LEGACY_AUTO:
            continue
        out.append({"id": text(eid), "ts": _num(f.get("ts"), float, None), "who": f.get("who"),
                    "action": f.get("action"), "dataset": f.get("dataset"), "old": f.get("old"),
                    "new": f.get("new")})
        if len(out) == n:
            break
    return out


def snapshot(conn: redis.Redis, redis_url: str, server_urls: Iterable[str] = (),
             history_s: int = HISTORY_S, control_n: int = CONTROL_ENTRIES) -> dict[str, Any]:
    """Everything an operator watches, as one JSON-able dict (schema: docs/operations.md)."""
    now = server_now(conn)
    workers = worker_snapshots(conn, now)
    faults = server_faults.read(conn)  # per endpoint, by reason; the one-line why of a stalled fleet
    fleet = Fleet(len(workers), faults)
    datasets = dataset_snapshots(conn, dataset_names(conn), now, history_s, fleet)
    return {
        "schema": SCHEMA_VERSION,
        "generated_at": round(now, 3),
        "redis": describe(redis_url),  # host:port/db, never the user or password
        "redis_tls": urlsplit(redis_url).scheme == "rediss",
        "history_s": history_s,
        "totals": {
            "budget": sum(d["budget"] for d in datasets),
            "used": sum(d["used"] for d in datasets),
            "reserved": sum(d["reserved"] for d in datasets),
            "in_flight": sum(d["in_flight"] for d in datasets),
            "queued": sum(d["queued"] for d in datasets),
            "tok_s": round(sum(d["tok_s"] or 0.0 for d in datasets), 2),
            "workers": len(workers),
            "worker_slots": sum(w["concurrency"] for w in workers),
        },
        "datasets": datasets,
        "workers": workers,
        "endpoints": endpoint_summary(workers, server_urls),
        "server_faults": [v.to_json() for v in faults],
        "diagnosis": server_faults.diagnosis(faults),
        "stall": fleet_stall(fleet, (d["ledger"] for d in datasets)),
        "producer": (producer := presence.read(conn)),  # host, pid, started_at; null: none runs
        "producer_absent": presence.absent_line(producer, datasets),  # the one line status and the monitor show
        "control": control_entries(conn, control_n),
        "control_auto": control_entries(conn, AUTO_ENTRIES, auto=True),
        "plan": run_plan.status_part(conn, now),  # deadline and total (docs/budget.md); None without
        "features": features_bytes.read(conn, [d["dataset"] for d in datasets]),  # hidden states' disk budget
    }
