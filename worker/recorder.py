"""Recording what happened: how each job ended (one finish.lua call, batched) and the stats
counters gathered outside job endings (retries), written in one round trip every flush.

The job flow calls down into this module; it never calls back up into the job flow.
"""

from __future__ import annotations

import logging
from collections import Counter

import redis.asyncio as aredis

from budgetq.shared import jobs, keys
from budgetq.shared.jobs import Finished, JobEnd
from budgetq.shared.retry import retry_redis
from budgetq.shared.scripts import Batcher
from budgetq.shared.stats import Stat
from budgetq.worker.tracked import Tracked

log = logging.getLogger("budgetq.worker")


class Recorder:
    def __init__(self, batch: Batcher, aconn: aredis.Redis, worker_name: str) -> None:
        self._batch = batch
        self._aconn = aconn
        self._worker = worker_name
        self.processed = 0
        self.outcomes: Counter[str] = Counter()   # for the exit log: committed, failed, ...
        self.pending: Counter[tuple[str, Stat]] = Counter()  # not yet written
        self.round_trips = 0  # flushes; job endings ride on the batcher's round trips

    async def end(self, t: Tracked, end: JobEnd) -> bool:
        """Record how a job ended (RQ status finished, failed or canceled) and count it; one
        script call, coalesced with the others of this loop turn. False if we no longer hold
        the job (its lease ran out and it was requeued): its new holder records it."""
        call = jobs.finish(t.ds, t.claimed, end, t.started_at, self._worker)
        done = await retry_redis(lambda: self._batch(call), f"finish {t.job_id}", give_up_after_s=60)
        if done is Finished.LOST_COMMIT:
            # The commit was acknowledged, then lost with the master that acknowledged it (a failover
            # to a replica that lacked it): finish.lua put the job back to run again.
            log.warning("job %s: its commit is not in Redis (lost in a failover): requeued to run again; "
                        "`budgetq reconcile` sets used to the rows on disk once the run ends", t.job_id)
        recorded = done is Finished.RECORDED
        if recorded:
            self.processed += 1
            self.outcomes[end.outcome] += 1
        return recorded

    def count(self, ds: str, stat: Stat, by: int = 1) -> None:
        self.pending[(ds, stat)] += by

    async def flush(self) -> None:
        """Write the counters gathered since the last flush; kept for the next one if it fails."""
        if not self.pending:
            return
        incr, self.pending = self.pending, Counter()
        try:
            async with self._aconn.pipeline(transaction=False) as p:
                for (ds, stat), n in incr.items():
                    p.hincrby(keys.stats_key(ds), stat, n)
                await p.execute()
            self.round_trips += 1
        except BaseException:
            self.pending.update(incr)
            raise
