"""Operator actions on a live run (budget, pause, resume, retry failed), logged in Redis.

Every action takes effect on the next admission (reserve.lua reads the dataset's conf
each time), from any machine that reaches Redis, and is appended to the control log
(keys.CONTROL_LOG: who, when, what, old and new value) that `budgetq status` shows.
"""

from __future__ import annotations

import getpass
import socket
import time

import redis
from rq.registry import FailedJobRegistry

from shared import budget, jobs, keys
from shared.errors import BudgetqError
from shared.redis_conn import dataset_names
from shared.scripts import run


def who() -> str:
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = "unknown"
    return f"{user}@{socket.gethostname()}"


def log_action(conn: redis.Redis, action: str, dataset: str, old: object = "", new: object = "") -> None:
    conn.xadd(keys.CONTROL_LOG, {"ts": f"{time.time():.3f}", "who": who(), "action": action, "dataset": dataset,
                                 "old": str(old), "new": str(new)},
              maxlen=keys.CONTROL_LOG_MAXLEN, approximate=True)


def _require(conn: redis.Redis, dataset: str) -> None:
    if not conn.sismember(keys.DATASETS, dataset):
        known = ", ".join(dataset_names(conn)) or "none"
        raise BudgetqError(f"dataset {dataset!r} is not registered in this Redis (registered: {known})")


def _withdraw(conn: redis.Redis, dataset: str) -> int:
    n = run(conn, budget.withdraw(dataset))
    log_action(conn, "abort", dataset, new=f"{n} requests in flight")
    return n


def set_budget(conn: redis.Redis, dataset: str, tokens: int, abort_in_flight: bool = False) -> tuple[int, int]:
    """Set a dataset's budget; returns (old budget, requests aborted)."""
    _require(conn, dataset)
    old = int(conn.hget(keys.conf_key(dataset), "limit") or 0)
    conn.hset(keys.conf_key(dataset), "limit", tokens)
    log_action(conn, "budget_set", dataset, old, tokens)
    return old, _withdraw(conn, dataset) if abort_in_flight else 0


def set_paused(conn: redis.Redis, dataset: str, paused: bool, abort_in_flight: bool = False) -> int:
    """Pause or resume; returns requests aborted."""
    _require(conn, dataset)
    old = conn.hget(keys.conf_key(dataset), "paused") == b"1"
    conn.hset(keys.conf_key(dataset), "paused", "1" if paused else "0")
    log_action(conn, "pause" if paused else "resume", dataset, old, paused)
    return _withdraw(conn, dataset) if abort_in_flight else 0


def retry_failed(conn: redis.Redis, datasets: list[str]) -> dict[str, int]:
    """Put every failed job of these datasets back on its queue; returns how many per dataset."""
    out = {}
    for ds in datasets:
        _require(conn, ds)
        registry = jobs.registry(FailedJobRegistry, ds, conn)
        ids = registry.get_job_ids(cleanup=False)
        for job_id in ids:
            registry.requeue(job_id)
        if ids:
            conn.hincrby(keys.stats_key(ds), "retried_failed", len(ids))
            log_action(conn, "retry_failed", ds, new=len(ids))
        out[ds] = len(ids)
    return out
