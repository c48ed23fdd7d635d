"""Which job ids a dataset's Redis state may hold: only today's scheme, or also the old one.

Earlier versions named jobs ``<ds>-<clean>`` (shared.identity.legacy_job_id). A dataset's
conf hash records the scheme in field ``id_scheme``:
- absent: written by an earlier version (or never registered). If the dataset has any
  state (done set, queued, started, failed, skipped, finished, scheduled or deferred jobs)
  it becomes ``1+2``, else ``2``. Decided once, at the producer's start, with HSETNX.
- ``2``: every id in Redis is ``<ds>--<enc>``; only those are checked.
- ``1+2``: old ids may still be in the done set and in RQ's queues and registries. Nothing
  is rewritten (a worker may be committing an old-format job right now, and rewriting the
  done set under it would count that result twice); instead a prompt counts as done or
  live if its new *or* its old job id is, and an old-format job must belong to this
  dataset's queue (old ids collided across datasets: ``A`` + ``1-x0`` = ``A-1`` + ``x0``).
  Old-format jobs still queued, failed or skipped simply run to their end under their old
  id: they are one job per prompt already, so nothing runs twice and nothing counts twice.
"""

from __future__ import annotations

import logging

import redis
from rq.registry import (
    CanceledJobRegistry,
    DeferredJobRegistry,
    FailedJobRegistry,
    FinishedJobRegistry,
    ScheduledJobRegistry,
    StartedJobRegistry,
)

from budgetq.shared import keys
from budgetq.shared.identity import SCHEME, SCHEME_FIELD, SCHEME_MIGRATED
from budgetq.shared.redis_conn import text

log = logging.getLogger("budgetq.producer")

_REGISTRIES = (StartedJobRegistry, FailedJobRegistry, CanceledJobRegistry, FinishedJobRegistry,
               ScheduledJobRegistry, DeferredJobRegistry)


def has_state(conn: redis.Redis, ds: str) -> bool:
    """True if Redis holds anything of this dataset an earlier run wrote."""
    queue = keys.queue_name(ds)
    pipe = conn.pipeline(transaction=False)
    pipe.scard(keys.done_key(ds))
    pipe.llen(keys.rq_queue_key(ds))
    pipe.llen(keys.rq_intermediate_key(ds))
    for registry in _REGISTRIES:
        pipe.zcard(registry(queue, connection=conn).key)
    return any(pipe.execute())


def id_scheme(conn: redis.Redis, ds: str) -> str:
    """The dataset's scheme (``2`` or ``1+2``), deciding and storing it on first use."""
    current = conn.hget(keys.conf_key(ds), SCHEME_FIELD)
    if current is not None:
        return text(current)
    scheme = SCHEME_MIGRATED if has_state(conn, ds) else SCHEME
    conn.hsetnx(keys.conf_key(ds), SCHEME_FIELD, scheme)
    return text(conn.hget(keys.conf_key(ds), SCHEME_FIELD) or scheme)


def uses_legacy_ids(conn: redis.Redis, ds: str) -> bool:
    """Whether Redis may hold job ids of this dataset's old scheme (said once, in the log)."""
    legacy = id_scheme(conn, ds) == SCHEME_MIGRATED
    if legacy:
        log.info("dataset %s: Redis holds state of the previous job-id scheme; old job ids are "
                 "recognised too, so nothing already done, queued or failed runs again", ds)
    return legacy
