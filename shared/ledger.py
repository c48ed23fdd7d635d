"""The ledger of a dataset: where every prompt that entered Redis is *now*, derived from Redis.

Each prompt the producer enqueued (or that ``reconcile`` adopted from disk) is, at every
moment, in exactly one state, read from where RQ and budgetq keep it, never from a counter
that could drift:

    queued     in the dataset's RQ queue: not started yet, paused, or requeued (worker
               stopped or died, request aborted in flight, budget raised, retry-failed)
    running    claimed by a worker (RQ's started registry, or a stock rq worker's
               intermediate list): waiting for a server slot, at the server, or being
               committed; a claimed job whose prompt is already committed counts as a row
    rows       committed: counted toward the budget, a row of out/<ds>.jsonl (once collected)
    truncated  committed and kept aside as cut by max_tokens (keep: complete)
    discarded  ended discarded: the degeneration guard or a quality gate refused its answer
               (out/<ds>.discarded.jsonl, with its reason; by reason in keys.discards_key). A
               prompt sent again (retry_discarded) is running, or queued, until its retry ends
    skipped    RQ's canceled registry: not sent because the budget was exhausted; requeued
               (back to queued) as soon as the budget admits it again
    failed     RQ's failed registry: its attempts ran out; ``budgetq retry-failed`` requeues it

    entered = enqueued + adopted, and  queued + running + rows + truncated + discarded + skipped
    + failed == entered  ("balanced"; ``unaccounted`` = entered - that sum: a job deleted by hand, a
    failed or skipped job whose hash expired after KEEP_S, Redis data lost).

Alongside, never enqueued: ``invalid`` (bad rows) and ``filtered`` (left out by the
dataset's filter), as the producer recorded them; ``unread``, the rows of the file the producer
has not read (yet, or at all: reading stops once the budget is reached), so that every row of
the file has a place:

    source_rows == entered + invalid + filtered + unread

With ``samples: N`` (docs/datasets.md "Samples per prompt") every valid row is N answers, each its
own job: the states, ``entered`` and ``unread`` count answers, ``invalid`` and ``filtered`` rows, and

    source_rows x samples == entered + (invalid + filtered) x samples + unread

(``unread`` = what the file's rows leave after the rest, 0 once every row is read, None while the file's size is
unknown; ``unread_estimated`` while source_rows is a large file's estimate or the dataset has a
``limit``); and ``aborted``, how many requests were aborted in flight (each went back to the
queue, so it is in ``queued`` or later states).

Read-only, with ``@read`` commands only (status works with a read-only ACL user): one
pipeline for the queue, registries and counters, a second for which claimed jobs are already
committed and the row counters (read together, so a commit between the two is seen by both).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import redis

from budgetq.shared import keys
from budgetq.shared.jobs import Ending
from budgetq.shared.redis_conn import text
from budgetq.shared.stats import Conf, Stat

STATES = ("queued", "running", "rows", "truncated", "discarded", "skipped", "failed")
# Counters of the stats hash the ledger reads: in the first pipeline, then with the done check.
_ENTRY = (Stat.ENQUEUED, Stat.ADOPTED, Stat.ABORTED, Stat.INVALID, Stat.FILTERED)
_DONE = (Stat.COMMITTED, Stat.TRUNCATED, Stat.DISCARDED)
# Fields of the conf hash that say how many rows the file has and whether they are all read.
_SOURCE = (Conf.SOURCE_ROWS, Conf.SOURCE_ESTIMATED, Conf.SOURCE_LIMIT, Conf.SOURCE_ENDED, Conf.SAMPLES)
_FIRST = 7  # replies per dataset in the first pipeline


def _int(v: Any) -> int:
    try:
        return int(float(text(v))) if v is not None else 0
    except ValueError:
        return 0


def read_ledgers(conn: redis.Redis, names: Iterable[str]) -> dict[str, dict[str, Any]]:
    """The ledger of each named dataset (keys: ``STATES``, entered, enqueued, adopted, accounted,
    unaccounted, balanced, aborted, invalid, filtered, source_rows, unread, unread_estimated)."""
    names = list(names)
    pipe = conn.pipeline(transaction=False)
    for ds in names:
        pipe.llen(keys.rq_queue_key(ds))
        pipe.llen(keys.rq_intermediate_key(ds))
        pipe.zrange(keys.rq_wip_key(ds), 0, -1)
        pipe.zcard(keys.rq_registry_key(ds, Ending.CANCELED))
        pipe.zcard(keys.rq_registry_key(ds, Ending.FAILED))
        pipe.hmget(keys.stats_key(ds), list(_ENTRY))
        pipe.hmget(keys.conf_key(ds), list(_SOURCE))
    first = pipe.execute()
    pipe = conn.pipeline(transaction=False)
    claimed: list[list[str]] = []
    for i, ds in enumerate(names):
        ids = [text(m).rsplit(":", 1)[0] for m in first[i * _FIRST + 2]]
        claimed.append(ids)
        if ids:
            pipe.smismember(keys.done_key(ds), ids)
        pipe.hmget(keys.stats_key(ds), list(_DONE))
    second = iter(pipe.execute())
    out = {}
    for i, ds in enumerate(names):
        queued, parked, _wip, skipped, failed, entry, source = first[i * _FIRST: (i + 1) * _FIRST]
        done_claimed = sum(1 for hit in next(second) if hit) if claimed[i] else 0
        committed, truncated, discarded = (_int(v) for v in next(second))
        enqueued, adopted, aborted, invalid, filtered = (_int(v) for v in entry)
        states = {"queued": int(queued), "running": len(claimed[i]) - done_claimed + int(parked),
                  "rows": committed, "truncated": truncated, "discarded": discarded, "skipped": int(skipped),
                  "failed": int(failed)}
        accounted = sum(states.values())
        entered = enqueued + adopted
        # A dataset whose Redis state predates the ledger has no entry counters: no balance to check.
        tracked = entry[0] is not None or entry[1] is not None or accounted == 0
        out[ds] = {**states, "entered": entered, "enqueued": enqueued, "adopted": adopted,
                   "accounted": accounted, "unaccounted": entered - accounted if tracked else None,
                   "balanced": entered == accounted if tracked else None,
                   "aborted": aborted, "invalid": invalid, "filtered": filtered,
                   **_unread(source, entered, invalid, filtered)}
    return out


def _unread(source: list[Any], entered: int, invalid: int, filtered: int) -> dict[str, Any]:
    """The rows of the file not read: what its row count leaves after the rows that have a state."""
    rows, estimated, limit, ended, samples_text = (text(v) if v is not None else None for v in source)
    samples = max(1, _int(samples_text)) if samples_text else 1  # answers per valid row
    if rows is None or rows == "":
        return {"source_rows": None, "unread": 0 if ended == "1" else None, "unread_estimated": False,
                "samples": samples}
    total = _int(rows)
    unread = 0 if ended == "1" else max(0, (total - invalid - filtered) * samples - entered)
    if limit and ended != "1":  # at most `limit` valid prompts are ever sent
        unread = min(unread, max(0, _int(limit) * samples - entered))
    return {"source_rows": total, "unread": unread, "samples": samples,
            "unread_estimated": ended != "1" and (estimated == "1" or bool(limit))}


def read_ledger(conn: redis.Redis, ds: str) -> dict[str, Any]:
    return read_ledgers(conn, [ds])[ds]


def is_settled(ledger: dict[str, Any]) -> bool:
    """Nothing queued or running: every prompt that entered has ended (row, truncated, discarded, skipped,
    failed)."""
    return ledger["queued"] == 0 and ledger["running"] == 0
