"""One claimed job's life inside the concurrent worker.

claimed -> (wait for a server slot) -> reserve -> request -> commit -> RQ bookkeeping, where
reserve may say: DONE (already committed: finish), EXHAUSTED (skip), PAUSED (requeue and
hold), WAIT (park without holding a slot; one parked job per dataset asks again as room
frees). A task is cancelled with a reason: "budget" / "withdrawn" (its admission is gone:
release, skip) or "shutdown" (requeue at the front, release).
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from shared import budget, jobs
from shared.budget import Admission, Outcome, Released, Reservation
from shared.errors import BadResponseError, FatalRequestError, RetryableRequestError
from shared.jobs import Claimed
from shared.retry import retry_redis
from shared.schema import JobPayload
from worker import turns  # regenerate: all: a job may send one request per user turn
from worker.process import build_row, estimate_prompt_tokens

if TYPE_CHECKING:
    from worker.runner import ConcurrentWorker

log = logging.getLogger("budgetq.worker")


class Phase(enum.Enum):
    PENDING = "pending"        # claimed, waiting for a slot or its reservation
    PARKED = "parked"          # the budget may fit it once requests in flight finish
    SENDING = "sending"        # admitted, request at the server
    COMMITTING = "committing"  # response in hand, being counted


@dataclass
class Tracked:
    claimed: Claimed
    ds: str
    phase: Phase = Phase.PENDING
    payload: JobPayload | None = None
    task: asyncio.Task | None = None
    started_at: float = field(default_factory=time.time)
    admitted_at: float = 0.0
    reserved: int = 0
    prompt_tokens: int = 0
    abort_reason: str | None = None

    def cancel(self, reason: str, force: bool = False) -> None:
        """Cancel this job's task; a result being committed is only interrupted when forced."""
        if self.task is None or self.task.done() or (self.phase is Phase.COMMITTING and not force):
            return
        if self.abort_reason is None:
            self.abort_reason = reason
        self.task.cancel()


async def run_job(w: ConcurrentWorker, t: Tracked) -> None:
    try:
        try:
            t.payload = JobPayload.model_validate(t.claimed.payload())
        except Exception as exc:  # a bad payload fails this prompt only
            log.warning("job %s: unreadable payload: %s", t.claimed.job_id, exc)
            await w.end(t, "failed", error=f"unreadable job payload: {exc}", stat="failed")
            return
        t.prompt_tokens = estimate_prompt_tokens(t.payload)
        res = await _admit(w, t)
        if res.status is Admission.ADMIT:
            await _send(w, t, res)
        elif res.status is Admission.DONE:
            await w.end(t, "finished", {"status": "already_done"}, stat="already_done")
        elif res.status is Admission.EXHAUSTED:
            await w.end(t, "canceled", skipped="budget exhausted", stat="skipped")
        elif res.status is Admission.PAUSED:
            w.control.mark_paused(t.ds)
            await _requeue(w, t)
    except asyncio.CancelledError:
        await asyncio.shield(_on_cancel(w, t))
    except Exception as exc:  # noqa: BLE001 - a bug must fail one job, never the worker
        log.exception("job %s: unexpected error", t.claimed.job_id)
        if await asyncio.shield(_release(w, t)) is Released.RELEASED:
            await w.end(t, "failed", error=f"{type(exc).__name__}: {exc}", stat="failed")
    finally:
        w.jobs.pop(t.claimed.member, None)
        w.wake.set()


async def _reserve(w: ConcurrentWorker, t: Tracked) -> Reservation:
    call = budget.reserve(t.ds, t.claimed.job_id, t.payload.sampling.max_tokens, t.prompt_tokens,
                          requests=t.payload.requests)  # regenerate: all: every turn reserved
    return await retry_redis(lambda: w.batch(call), f"reserve {t.claimed.job_id}")


async def _try_reserve(w: ConcurrentWorker, t: Tracked) -> Reservation:
    """Take a server slot and ask for a reservation; the slot is kept only if admitted."""
    await w.slots.acquire()
    try:
        res = await _reserve(w, t)
    except BaseException:
        w.slots.release()
        raise
    if res.status is not Admission.ADMIT:
        w.slots.release()
    return res


async def _admit(w: ConcurrentWorker, t: Tracked) -> Reservation:
    """A non-WAIT reservation; holds a server slot when it is ADMIT."""
    while True:
        if w.control.is_waiting(t.ds):
            return await _admit_parked(w, t)
        res = await _try_reserve(w, t)
        if res.status is not Admission.WAIT:
            return res
        w.control.mark_waiting(t.ds)


async def _admit_parked(w: ConcurrentWorker, t: Tracked) -> Reservation:
    """Near a soft budget: one job per dataset asks again whenever room may have freed."""
    t.phase = Phase.PARKED
    w.wake.set()  # a parked job does not count against claiming: let the feeder use its room
    async with w.control.gate(t.ds):
        t.phase = Phase.PENDING
        delay = 0.02
        while True:
            res = await _try_reserve(w, t)
            if res.status is not Admission.WAIT:
                w.control.clear_waiting(t.ds)
                return res
            t.phase = Phase.PARKED
            await w.control.wait_for_room(t.ds, delay)
            t.phase = Phase.PENDING
            delay = min(delay * 2, 0.5)


async def _send(w: ConcurrentWorker, t: Tracked, res: Reservation) -> None:
    t.phase, t.admitted_at, t.reserved = Phase.SENDING, time.monotonic(), res.tokens
    job_id = t.claimed.job_id
    try:
        try:
            out = await turns.send(w.client, t.payload, job_id,  # regenerate: all: each turn timed alone
                                   on_turn=lambda _k: setattr(t, "admitted_at", time.monotonic()))
        finally:
            w.slots.release()
    except (FatalRequestError, RetryableRequestError, BadResponseError) as exc:
        log.warning("job %s failed: %s", job_id, exc)
        if await _release(w, t) is Released.RELEASED:
            await w.end(t, "failed", error=str(exc), stat="failed")
        return
    t.phase = Phase.COMMITTING
    turns.observe(w.length, out)  # per request, also for a conversation
    row = build_row(t.payload, out, w.client.model).model_dump_json()
    call = budget.commit(t.ds, job_id, out.prompt_tokens, out.completion_tokens, out.finish_reason, row,
                         lengths=turns.lengths(out))  # regenerate: all: per-request lengths
    outcome = await retry_redis(lambda: w.batch(call), f"commit {job_id}")
    w.control.room_freed(t.ds)
    if outcome is Outcome.CROSSED:
        w.control.budget_crossed(t.ds)
    if outcome.kept:
        await w.end(t, "finished", {"status": outcome.value.lower(), "completion_tokens": out.completion_tokens})
    elif outcome is Outcome.DUPLICATE:
        await w.end(t, "finished", {"status": "duplicate"})
    else:  # REJECTED: its admission was withdrawn while it ran
        await w.end(t, "canceled", skipped="admission withdrawn before the result arrived", stat="skipped")


async def _release(w: ConcurrentWorker, t: Tracked, generated: int = 0) -> Released:
    call = budget.release(t.ds, t.claimed.job_id, generated, member=t.claimed.member)
    out = await retry_redis(lambda: w.batch(call), f"release {t.claimed.job_id}", give_up_after_s=60)
    w.control.room_freed(t.ds)
    if out.status is Released.NOT_OURS:
        log.warning("job %s: our lease ran out (it was requeued and may run elsewhere): dropping our copy",
                    t.claimed.job_id)
    elif out.status is Released.ALREADY_DONE:
        await w.end(t, "finished", {"status": "already_done"}, stat="already_done")
    return out.status


async def _requeue(w: ConcurrentWorker, t: Tracked) -> None:
    call = jobs.requeue(t.ds, t.claimed.member, t.claimed.job_id)
    await retry_redis(lambda: w.batch(call), f"requeue {t.claimed.job_id}", give_up_after_s=60)
    w.control.room_freed(t.ds)


async def _on_cancel(w: ConcurrentWorker, t: Tracked) -> None:
    reason = t.abort_reason or "shutdown"
    try:
        if reason == "shutdown" or t.payload is None:
            await _requeue(w, t)  # the maintenance pass would do it too, a lease later
            return
        # The budget was crossed or the operator withdrew admissions: this request is dropped.
        generated = 0
        if t.phase is Phase.SENDING:
            generated = int(w.length.generated_so_far(time.monotonic() - t.admitted_at))
        if await _release(w, t, generated) is Released.RELEASED:
            await w.end(t, "canceled", skipped=f"aborted in flight: {reason}", stat="aborted")
    except Exception as exc:  # noqa: BLE001 - Redis gone: the lease will expire and it is requeued
        log.warning("job %s: could not settle after cancel (%s): %s", t.claimed.job_id, reason, exc)
