"""``capture: features``: ``budgetq produce`` captures the hidden states of those datasets' rows as they commit.

This is the features pass of ``budgetq features --follow`` (features_pass.py ``FeaturesPass``, not a
copy), run in a thread of the producer: tokenizing rows and writing shards (hundreds of MB, fsynced) then
never hold up enqueueing or collecting generation results. The producer's loop calls three hooks
(producer/run/producer.py):

- ``tick()``: starts the thread at the first tick;
- ``done(drain)``: asked once generation is complete. The first call writes the last generation results
  (``drain``) and tells the pass to stop following: it reads each file to its end once more and ends as a
  plain ``budgetq features`` does. True once every committed row of those datasets has its hidden states
  on disk, or failed (reported), or was refused by the disk guard; also once the pass stopped on an error;
- ``close()``: after the loop (a stop request too): the pass writes what it collected and releases its lock.

Restart-safe as the pass is: a produce killed and started again on the same host takes the dead one's lock
over at once (elsewhere once it lapses, 30 s), skips rows on disk, and collects results already in Redis.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable

from budgetq.hidden_states.collect.features_pass import FeaturesPass
from budgetq.hidden_states.collect.lock import LOCK_TTL_S
from budgetq.hidden_states.collect.report import Report
from budgetq.shared import keys
from budgetq.shared.config import Config
from budgetq.shared.redis_conn import connect
from budgetq.shared.retry import REDIS_DOWN

log = logging.getLogger("budgetq.capture")
WAITING_LOG_S = 30.0      # while generation is done and hidden states are not: a line this often
CLOSE_WAIT_S = 10.0       # a stop waits this long for the pass's last shard (the producer stops within 15 s)


class Capture:
    def __init__(self, cfg: Config) -> None:
        self.names = [ds.name for ds in cfg.datasets if ds.capture == "features"]
        self.report: Report | None = None
        self.error: str | None = None          # the pass stopped on an error (generation went on)
        self._thread: threading.Thread | None = None
        self._ending = False
        self._logged_at = 0.0
        self.fp: FeaturesPass | None = None
        if not self.names:
            return
        # Built here, not in the thread, so a second collector stops `produce` at once with its one-line
        # error. A fixed owner: a start retried through a Redis blip in this process finds its own locks,
        # and so does a restarted container whose producer has the same hostname and pid.
        owner = f"{socket.gethostname()}:{os.getpid()}:produce"
        self.fp = FeaturesPass(cfg, connect(cfg.redis_url), self.names, follow=True, owner=owner)
        log.info("capture: hidden states of %s are captured as rows commit (features jobs on %s)",
                 ", ".join(self.names), ", ".join(keys.features_queue_name(n) for n in self.names))

    @property
    def active(self) -> bool:
        return self.fp is not None

    # -- hooks ---------------------------------------------------------------------------
    def tick(self) -> None:
        if self.fp is not None and self._thread is None:
            self._thread = threading.Thread(target=self._run, name="budgetq-capture", daemon=True)
            self._thread.start()

    def done(self, drain: Callable[[], object]) -> bool:
        if self.fp is None:
            return True
        self.tick()
        if not self._ending:
            try:
                drain()  # the last rows are in out/<ds>.jsonl before the pass reads it the last time
            except REDIS_DOWN:
                return False  # the next loop tries again (the producer's tick reports the outage)
            self.fp.end_follow()
            self._ending = True
            self._logged_at = time.monotonic()
        if self._thread is None or not self._thread.is_alive():
            return True
        if time.monotonic() - self._logged_at > WAITING_LOG_S:
            self._logged_at = time.monotonic()
            self._log_waiting()
        return False

    def close(self) -> None:
        if self.fp is None:
            return
        if self._thread is None:  # stopped before the first tick: only the locks to give back
            self.fp.release()
            return
        self.fp.stop.set()
        self._thread.join(CLOSE_WAIT_S)
        if self._thread.is_alive():
            log.warning("capture: the features pass is still writing after %.0f s; stopping without it (its "
                        "results stay in Redis and `budgetq produce` again writes them)", CLOSE_WAIT_S)

    # -- the thread ----------------------------------------------------------------------
    def _run(self) -> None:
        assert self.fp is not None
        outage = False
        while True:
            try:
                self.report = self.fp.run()
                return
            except REDIS_DOWN as exc:
                # The pass's state is in memory and on disk; run() again continues it.
                if self.fp.stop.is_set():
                    return
                if not outage:
                    log.warning("capture: redis unreachable (%s); the features pass waits and retries", exc)
                    outage = True
                time.sleep(1.0)
            except Exception as exc:  # noqa: BLE001 - generation goes on; the summary and exit status say so
                self.error = f"{type(exc).__name__}: {exc}"
                log.error("capture: the features pass stopped: %s; generation goes on, and `budgetq produce` "
                          "(or `budgetq features`) again captures the rest (its lock lapses in %d s)",
                          self.error, LOCK_TTL_S)
                return

    def _log_waiting(self) -> None:
        assert self.fp is not None
        try:
            pipe = self.fp.conn.pipeline(transaction=False)
            for name in self.names:
                pipe.llen(keys.rq_queue_key(keys.features_name(name)))
                pipe.zcard(keys.rq_wip_key(keys.features_name(name)))
            counts = pipe.execute()
        except REDIS_DOWN:
            return
        queued, started = sum(counts[0::2]), sum(counts[1::2])
        log.warning("capture: generation is complete; waiting for hidden states (%d features jobs queued, %d "
                    "running). `budgetq worker` serves them with a dataset's capture: features in its config "
                    "(or run `budgetq features-worker`)", queued, started)

    # -- summary -------------------------------------------------------------------------
    def summary(self) -> dict[str, dict]:
        """Per dataset: samples on disk, this run's captures, failures, invalid rows (the pass's report
        once it ended, else what it has counted so far)."""
        if self.fp is None:
            return {}
        if self.report is not None:
            return self.report.datasets
        return {p.ds.name: {"samples_on_disk": len(p.store.ids), "captured": p.captured, "enqueued": p.enqueued,
                            "invalid": len(p.invalid), "failed": 0, "bytes_on_disk": p.store.bytes_on_disk}
                for p in self.fp.passes}

    @property
    def problems(self) -> list[str]:
        """What keeps the capture from being complete: an error, the disk guard, failed jobs (one line each)."""
        out = []
        if self.error:
            out.append(f"the features pass stopped: {self.error}")
        if self.report is not None:
            if self.report.stopped_by:
                out.append(f"admissions stopped: {self.report.stopped_by}")
            for name, failed in self.report.failed.items():
                if failed:
                    out.append(f"{name}: {len(failed)} features jobs failed, e.g. {failed[0]}")
        return out
