"""Operator actions on a live run (budget, pause, resume, retry failed), logged in Redis.

Every action takes effect on the next admission (reserve.lua reads the dataset's conf
each time), from any machine that reaches Redis, and is appended to the control log
(keys.CONTROL_LOG: who, when, what, old and new value) that `budgetq status` shows.

Nothing an action stops is lost (shared/ledger.py): requests aborted in flight go back to
the queue (requeue.lua, from the worker that held them); jobs skipped while the budget was
exhausted go back to the queue as soon as a raise or a resume makes it admit them again
(reopen.lua, here and in the producer); retry-failed moves failed jobs back the same way.
"""

from __future__ import annotations

import getpass
import socket
import time
from dataclasses import dataclass

import redis

from budgetq.shared import budget, jobs, keys
from budgetq.shared.budget import dataset_state
from budgetq.shared.errors import BudgetqError
from budgetq.shared.redis_conn import dataset_names
from budgetq.shared.scripts import run
from budgetq.shared.stats import Conf, Stat


def who() -> str:
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = "unknown"
    return f"{user}@{socket.gethostname()}"


# Actions whose old and new values are token counts (shown as 282.20k, as budgets are everywhere).
TOKEN_ACTIONS = frozenset({"budget_set", "budget_total", "budget_deadline", "total_set"})


def log_action(conn: redis.Redis, action: str, dataset: str, old: object = "", new: object = "",
               actor: str | None = None) -> None:
    """Append to the control log. A person's action (``actor`` None: ``user@host``) goes to
    ``CONTROL_LOG``; the producer's own moves name the producer and why (``producer (deadline
    pacing)``) and go to ``CONTROL_AUTO_LOG``, so they never push a person's action out."""
    stream = keys.CONTROL_LOG if actor is None else keys.CONTROL_AUTO_LOG
    conn.xadd(stream, {"ts": f"{time.time():.3f}", "who": actor or who(), "action": action, "dataset": dataset,
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


@dataclass(frozen=True)
class Change:
    """What a budget, pause or resume action did: ``aborted`` requests in flight (each goes back
    to the queue), ``requeued`` skipped jobs put back on the queue because the budget admits
    them again."""

    old: int | bool
    aborted: int = 0
    requeued: int = 0

    def describe(self) -> str:
        parts = []
        if self.aborted:
            parts.append(f"aborted {self.aborted} requests in flight (requeued: they run again once admitted)")
        if self.requeued:
            parts.append(f"requeued {self.requeued} skipped jobs")
        return "".join(f"; {p}" for p in parts)


def reopen_skipped(conn: redis.Redis, dataset: str) -> int:
    """If the budget admits new requests (not exhausted, not paused), put the jobs it skipped back
    on the queue; returns how many. Called after a raise or a resume, and by the producer."""
    st = dataset_state(conn, dataset)
    if st.exhausted or st.paused:
        return 0
    moved, _vanished = jobs.reopen_all(conn, dataset, jobs.Ending.CANCELED, Stat.REOPENED)
    return moved


def set_budget(conn: redis.Redis, dataset: str, tokens: int, abort_in_flight: bool = False) -> Change:
    """Set a dataset's budget; aborted requests and skipped jobs the new budget admits are requeued."""
    _require(conn, dataset)
    old = int(conn.hget(keys.conf_key(dataset), Conf.LIMIT) or 0)
    # (its own budget too: reached, it is what ended the dataset, even once a deadline passes)
    conn.hset(keys.conf_key(dataset), mapping={Conf.LIMIT: tokens, Conf.OWN_BUDGET: tokens})
    log_action(conn, "budget_set", dataset, old, tokens)
    aborted = _withdraw(conn, dataset) if abort_in_flight else 0
    return Change(old, aborted, reopen_skipped(conn, dataset))


def set_paused(conn: redis.Redis, dataset: str, paused: bool, abort_in_flight: bool = False) -> Change:
    """Pause or resume; a pause with ``abort_in_flight`` requeues the requests it aborts (held in
    the paused queue), a resume requeues skipped jobs the budget admits."""
    _require(conn, dataset)
    old = conn.hget(keys.conf_key(dataset), Conf.PAUSED) == b"1"
    conn.hset(keys.conf_key(dataset), Conf.PAUSED, "1" if paused else "0")
    log_action(conn, "pause" if paused else "resume", dataset, old, paused)
    aborted = _withdraw(conn, dataset) if abort_in_flight else 0
    return Change(old, aborted, 0 if paused else reopen_skipped(conn, dataset))


def retry_failed(conn: redis.Redis, datasets: list[str]) -> dict[str, int]:
    """Put every failed job of these datasets back on its queue; returns how many per dataset."""
    out = {}
    for ds in datasets:
        _require(conn, ds)
        moved, _vanished = jobs.reopen_all(conn, ds, jobs.Ending.FAILED, Stat.RETRIED_FAILED)
        if moved:
            log_action(conn, "retry_failed", ds, new=moved)
        out[ds] = moved
    return out
