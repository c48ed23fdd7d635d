"""What a worker knows about the datasets, refreshed every ``worker.control_interval_s``.

Budgets and pauses are enforced atomically by reserve.lua on every admission; this loop
adds what a worker must do on its own: stop claiming from paused datasets, abort its
requests in flight once a soft budget is crossed or an operator withdrew admissions
(disconnecting makes SGLang abort them), and raise the reservations of its long-running
requests (worker/estimator.py) so admissions taper off near the budget.
"""

from __future__ import annotations

import asyncio
import logging
import time

import redis.asyncio as aredis

from budgetq.shared import budget, keys
from budgetq.shared.budget import DatasetState
from budgetq.shared.redis_conn import text
from budgetq.shared.scripts import Batcher
from budgetq.worker.estimator import LengthModel
from budgetq.worker.tracked import Abort, JobTable, Phase, Tracked

log = logging.getLogger("budgetq.worker")
# Only refine reservations once this many lengths are known for a dataset.
MIN_SAMPLES = 20


class Control:
    def __init__(self, aconn: aredis.Redis, batch: Batcher, length: LengthModel, jobs: JobTable,
                 wake: asyncio.Event, taper_estimate: str) -> None:
        self._aconn = aconn
        self._batch = batch
        self._length = length
        self._jobs = jobs       # read only: to abort requests and refine their reservations
        self._wake = wake       # set when a dataset becomes claimable again
        self._taper = taper_estimate
        self.states: dict[str, DatasetState] = {}
        self._paused: set[str] = set()
        self._waiting: set[str] = set()
        self._gates: dict[str, asyncio.Lock] = {}
        self._room: dict[str, asyncio.Event] = {}
        self.round_trips = 0

    # -- what the feeder and job tasks ask ----------------------------------------------
    def claimable(self) -> list[str]:
        return [n for n in self.states if n not in self._paused and n not in self._waiting]

    def mark_paused(self, ds: str) -> None:
        self._paused.add(ds)

    def is_waiting(self, ds: str) -> bool:
        return ds in self._waiting

    def mark_waiting(self, ds: str) -> None:
        self._waiting.add(ds)

    def clear_waiting(self, ds: str) -> None:
        self._waiting.discard(ds)
        self._wake.set()

    def gate(self, ds: str) -> asyncio.Lock:
        return self._gates.setdefault(ds, asyncio.Lock())

    def _event(self, ds: str) -> asyncio.Event:
        return self._room.setdefault(ds, asyncio.Event())

    async def wait_for_room(self, ds: str, timeout_s: float) -> None:
        ev = self._event(ds)
        ev.clear()
        try:
            await asyncio.wait_for(ev.wait(), timeout_s)
        except TimeoutError:
            pass

    def room_freed(self, ds: str) -> None:
        if ds in self._room:
            self._room[ds].set()

    def budget_crossed(self, ds: str) -> None:
        """Our commit crossed a soft budget: every admission was withdrawn, so drop our requests."""
        self._abort(ds, Abort.BUDGET)

    def _abort(self, ds: str, reason: Abort) -> None:
        doomed = [t for t in self._jobs.values() if t.ds == ds and t.phase is Phase.SENDING]
        for t in doomed:
            t.cancel(reason)
        if doomed:
            log.info("dataset %s: aborting %d requests in flight (%s)", ds, len(doomed), reason.value)

    # -- the periodic refresh -------------------------------------------------------------
    async def tick(self) -> None:
        names = sorted(text(n) for n in await self._aconn.smembers(keys.DATASETS))
        self.round_trips += 2
        sending: dict[str, list[Tracked]] = {}
        for t in self._jobs.values():
            if t.phase is Phase.SENDING:
                sending.setdefault(t.ds, []).append(t)
        async with self._aconn.pipeline(transaction=False) as p:
            for n in names:
                budget.queue_state_commands(p, n)
                p.hgetall(keys.hist_key(n))
                p.hmget(keys.resv_key(n), [t.claimed.job_id for t in sending.get(n, [])] or ["-"])
            replies = await p.execute()
        per = budget.STATE_REPLIES + 2
        states = {}
        for i, n in enumerate(names):
            chunk = replies[i * per:(i + 1) * per]
            st = budget.parse_state(n, chunk[:budget.STATE_REPLIES])
            states[n] = st
            hist = chunk[budget.STATE_REPLIES]
            self._length.set_histogram(n, st.max_tokens, hist)
            self._react(st)
            # A request whose admission ticket is gone (budget crossed in another worker,
            # withdrawn by an operator, or its lease lost) can no longer count: drop it.
            gone = [t for t, held in zip(sending.get(n, []), chunk[-1], strict=False) if held is None]
            for t in gone:
                t.cancel(Abort.WITHDRAWN)
            if gone:
                log.info("dataset %s: aborting %d requests in flight whose admission was withdrawn", n, len(gone))
        self.states = states
        await self._refine_reservations()

    def _react(self, st: DatasetState) -> None:
        ds = st.name
        if st.paused:
            self._paused.add(ds)
        elif ds in self._paused:
            self._paused.discard(ds)
            self._wake.set()
        if ds in self._waiting:
            self.room_freed(ds)  # commits in other workers may have made room: ask again

    async def _refine_reservations(self) -> None:
        """Raise each long-running request's reservation to its expected final length."""
        now = time.monotonic()
        refine = {ds for ds, st in self.states.items()
                  if st.mode == "soft" and self._length.samples(ds) >= MIN_SAMPLES}
        running: dict[str, list[tuple[Tracked, float]]] = {}
        for t in self._jobs.values():
            if t.phase is Phase.SENDING and t.ds in refine:
                running.setdefault(t.ds, []).append((t, t.generated(self._length, now)))
        # Requests in flight are lengths known to be at least g (censored): without them the
        # estimate leans on the short answers that finished first. Other workers' requests are
        # like ours: each of ours stands for in_flight / ours of them.
        if self._taper == "censored":
            for ds, mine in running.items():
                st = self.states[ds]
                self._length.set_running(ds, st.max_tokens, (g for _t, g in mine),
                                         weight=max(1.0, st.in_flight / len(mine)))
        per_ds: dict[str, dict[str, int]] = {}
        for ds, mine in running.items():
            st = self.states[ds]
            for t, gen in mine:
                if t.payload is None:  # cannot be SENDING without one; keeps the type checker sure
                    continue
                want = self._length.expected_length(ds, gen, t.payload.sampling.max_tokens)
                if st.count == "total":
                    want += t.prompt_tokens
                if want > t.reserved:
                    per_ds.setdefault(ds, {})[t.claimed.job_id] = want
                    t.reserved = want
        if per_ds:
            await asyncio.gather(*[self._batch(budget.adjust(ds, pairs)) for ds, pairs in per_ds.items()])
