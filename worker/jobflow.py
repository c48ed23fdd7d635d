"""One claimed job's life inside the concurrent worker: every decision about a job is here.

claimed -> (wait for a server slot) -> reserve -> request -> commit -> record its end, where
reserve may say: DONE (already committed: finish), EXHAUSTED (skip), PAUSED (requeue and
hold), WAIT (park without holding a slot; one parked job per dataset asks again as room
frees). A task is cancelled with an ``Abort``: BUDGET / WITHDRAWN (its admission is gone:
release, record it aborted) or SHUTDOWN (requeue at the front, release).

A job sees only its ``JobContext`` (worker/context.py); it calls down into control, the
recorder and shared/, and nothing calls back into it: the runner only starts ``run_job``.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import secrets
import time

from budgetq.shared import budget, jobs
from budgetq.shared.budget import Admission, Outcome, Released, Reservation
from budgetq.shared.errors import BadResponseError, FatalRequestError, RetryableRequestError
from budgetq.shared.jobs import Ending, JobEnd, ResultStatus, Skip
from budgetq.shared.retry import retry_redis
from budgetq.shared.schema import JobPayload
from budgetq.worker import discard, quality, turns  # turns: regenerate: all may send one request per user turn
from budgetq.worker.context import JobContext
from budgetq.worker.process import build_row, estimate_prompt_tokens
from budgetq.worker.sglang_stream import WATCH, Watch
from budgetq.worker.tracked import Abort, Phase, Tracked

log = logging.getLogger("budgetq.worker")
# What a kept result is recorded as (RQ's return value), by what commit did with it.
_KEPT = {Outcome.COMMITTED: ResultStatus.COMMITTED, Outcome.CROSSED: ResultStatus.CROSSED,
         Outcome.TRUNCATED: ResultStatus.TRUNCATED}


async def run_job(ctx: JobContext, t: Tracked) -> None:
    t.started = True
    try:
        if t.cancel_requested:  # cancelled before this first step (worker/tracked.py Tracked.cancel)
            raise asyncio.CancelledError
        try:
            payload = t.payload = JobPayload.model_validate(t.claimed.payload())
        except Exception as exc:  # a bad payload fails this prompt only
            log.warning("job %s: unreadable payload: %s", t.job_id, exc)
            await ctx.recorder.end(t, JobEnd.failed(f"unreadable job payload: {exc}"))
            return
        t.prompt_tokens = estimate_prompt_tokens(payload)
        attempt = 1
        res = await _admit(ctx, t, payload)
        # retry_discarded: a discarded answer's commit gave its ticket back (RETRY); the prompt asks for a new
        # admission and goes again with another seed, at most that many times in this job run.
        while res.status is Admission.ADMIT:
            if not await _send(ctx, t, payload, res, attempt):
                return
            attempt += 1
            payload = t.payload = discard.another_seed(payload, t.job_id, attempt)
            t.phase = Phase.PENDING
            res = await _admit(ctx, t, payload)
        if res.status is Admission.DONE:
            await ctx.recorder.end(t, JobEnd.done(ResultStatus.ALREADY_DONE))
        elif res.status is Admission.EXHAUSTED:
            await ctx.recorder.end(t, JobEnd.skip(Skip.EXHAUSTED))
        elif res.status is Admission.PAUSED:
            ctx.control.mark_paused(t.ds)
            await _requeue(ctx, t)
    except asyncio.CancelledError:
        await asyncio.shield(_on_cancel(ctx, t))
    except Exception as exc:  # noqa: BLE001 - a bug must fail one job, never the worker
        log.exception("job %s: unexpected error", t.job_id)
        await asyncio.shield(_release_and_end(ctx, t, JobEnd.failed(f"{type(exc).__name__}: {exc}")))
    finally:
        ctx.jobs.pop(t.claimed.member, None)
        ctx.wake.set()


async def _reserve(ctx: JobContext, t: Tracked, payload: JobPayload) -> Reservation:
    call = budget.reserve(t.ds, t.job_id, payload.sampling.max_tokens, t.prompt_tokens,
                          requests=payload.requests)  # regenerate: all: every turn reserved
    return await retry_redis(lambda: ctx.batch(call), f"reserve {t.job_id}")


async def _try_reserve(ctx: JobContext, t: Tracked, payload: JobPayload) -> Reservation:
    """Take a server slot and ask for a reservation; the slot is kept only if admitted."""
    await ctx.slots.acquire()
    try:
        res = await _reserve(ctx, t, payload)
    except BaseException:
        ctx.slots.release()
        raise
    if res.status is not Admission.ADMIT:
        ctx.slots.release()
    return res


async def _admit(ctx: JobContext, t: Tracked, payload: JobPayload) -> Reservation:
    """A non-WAIT reservation; holds a server slot when it is ADMIT."""
    while True:
        if ctx.control.is_waiting(t.ds):
            return await _admit_parked(ctx, t, payload)
        res = await _try_reserve(ctx, t, payload)
        if res.status is not Admission.WAIT:
            return res
        ctx.control.mark_waiting(t.ds)


async def _admit_parked(ctx: JobContext, t: Tracked, payload: JobPayload) -> Reservation:
    """Near a soft budget: one job per dataset asks again whenever room may have freed."""
    t.phase = Phase.PARKED
    ctx.wake.set()  # a parked job does not count against claiming: let the feeder use its room
    async with ctx.control.gate(t.ds):
        t.phase = Phase.PENDING
        delay = 0.02
        while True:
            res = await _try_reserve(ctx, t, payload)
            if res.status is not Admission.WAIT:
                ctx.control.clear_waiting(t.ds)
                return res
            t.phase = Phase.PARKED
            await ctx.control.wait_for_room(t.ds, delay)
            t.phase = Phase.PENDING
            delay = min(delay * 2, 0.5)


def _quality(ctx: JobContext, ds: str) -> discard.Quality:
    """The dataset's guard, gates and retry_discarded, from its conf as the control loop last read it."""
    st = ctx.control.states.get(ds)
    return discard.settings(getattr(st, "quality", "") if st is not None else "")


async def _send(ctx: JobContext, t: Tracked, payload: JobPayload, res: Reservation, attempt: int = 1) -> bool:
    """Send, then commit what came back. True: the answer was discarded and the prompt goes again."""
    t.phase, t.admitted_at, t.reserved = Phase.SENDING, time.monotonic(), res.tokens
    t.streamed = None
    job_id = t.job_id
    q = _quality(ctx, t.ds)
    if q.gates is not None and q.gates.validator:
        try:  # before the request: an answer no validator can judge would be generated for nothing
            await quality.load(q.gates.validator, q.gates.validator_timeout_s)
        except quality.ValidatorError as exc:
            ctx.slots.release()
            _log_validator_once(str(exc))
            await _release_and_end(ctx, t, JobEnd.failed(str(exc)))
            return False
    watch = WATCH.set(Watch(guard=q.make_guard(), on_progress=t.progressed))
    try:
        try:
            out = await turns.send(ctx.client, payload, job_id,  # regenerate: all: each turn timed alone
                                   on_turn=lambda _k: t.new_request())
        finally:
            WATCH.reset(watch)
            ctx.slots.release()
    except (FatalRequestError, RetryableRequestError, BadResponseError) as exc:
        log.warning("job %s failed: %s", job_id, exc)
        await _release_and_end(ctx, t, JobEnd.failed(str(exc)))
        return False
    t.phase = Phase.COMMITTING
    turns.observe(ctx.length, out)  # per request, also for a conversation
    row = build_row(payload, out, ctx.client.model).model_dump_json()
    why = await discard.reason(out, q)  # its validator was imported before the request
    retry = False
    if why is not None:
        retry = attempt <= q.retry_discarded
        row = discard.discard_row(row, why[0], why[1], out, attempt, retry, secrets.token_hex(4))
        _log_discard(t, why, out, retry)
    call = budget.commit(t.ds, job_id, out.prompt_tokens, out.completion_tokens, out.finish_reason, row,
                         lengths=turns.lengths(out),  # regenerate: all: per-request lengths
                         discard=why[0] if why is not None else None, retry=retry)
    outcome = await retry_redis(lambda: ctx.batch(call), f"commit {job_id}")
    ctx.control.room_freed(t.ds)
    if outcome is Outcome.CROSSED:
        ctx.control.budget_crossed(t.ds)
    if outcome in _KEPT:
        await ctx.recorder.end(t, JobEnd.done(_KEPT[outcome], out.completion_tokens))
    elif outcome is Outcome.RETRY:
        return True
    elif outcome is Outcome.DISCARDED and why is not None:
        # Finished (the prompt is done, in the ledger's discarded state), not failed: nothing to retry.
        await ctx.recorder.end(t, JobEnd(Ending.FINISHED, {"status": "discarded", "reason": why[0],
                                                           "completion_tokens": out.completion_tokens},
                                            committed=True))
    elif outcome is Outcome.DUPLICATE:
        await ctx.recorder.end(t, JobEnd.done(ResultStatus.DUPLICATE))
    else:  # REJECTED: its admission was withdrawn while it ran
        await ctx.recorder.end(t, JobEnd.skip(Skip.WITHDRAWN))
    return False


def _log_discard(t: Tracked, why: tuple[str, dict], out: turns.Result, retry: bool) -> None:
    """The decision, once per answer: a loop with where it began and where it was cut."""
    reason, d = why
    again = "; sent again with another seed" if retry else ""
    if reason == "loop":
        log.info("dataset %s: job %s cut in a loop: period %s tokens, %s repeats, onset at %s tokens, cut at %s%s",
                 t.ds, t.job_id, d.get("period"), d.get("repeats"), d.get("onset_tokens"),
                 d.get("cut_tokens", out.completion_tokens), again)
    else:
        log.info("dataset %s: job %s discarded (%s), %d tokens%s", t.ds, t.job_id, reason, out.completion_tokens,
                 again)


@functools.lru_cache(maxsize=64)
def _log_validator_once(why: str) -> None:
    # once per process and message: every job of the dataset fails the same way, before its request
    log.error("%s: this worker fails the dataset's jobs without sending them (`budgetq retry-failed` once it "
              "imports)", why)


async def _release_and_end(ctx: JobContext, t: Tracked, end: JobEnd, generated: int = 0) -> None:
    """Give the reservation back, then record ``end``: unless the job is no longer ours (its
    lease ran out; its new holder records it) or another copy of it was committed meanwhile."""
    call = budget.release(t.ds, t.job_id, generated, member=t.claimed.member)
    out = await retry_redis(lambda: ctx.batch(call), f"release {t.job_id}", give_up_after_s=60)
    ctx.control.room_freed(t.ds)
    if out.status is Released.NOT_OURS:
        log.warning("job %s: our lease ran out (it was requeued and may run elsewhere): dropping our copy",
                    t.job_id)
    elif out.status is Released.ALREADY_DONE:
        await ctx.recorder.end(t, JobEnd.done(ResultStatus.ALREADY_DONE))
    else:
        await ctx.recorder.end(t, end)


async def _requeue(ctx: JobContext, t: Tracked) -> None:
    call = jobs.requeue(t.ds, t.claimed.member, t.job_id)
    await retry_redis(lambda: ctx.batch(call), f"requeue {t.job_id}", give_up_after_s=60)
    ctx.control.room_freed(t.ds)


async def _on_cancel(ctx: JobContext, t: Tracked) -> None:
    reason = t.abort_reason or Abort.SHUTDOWN
    try:
        if reason is Abort.SHUTDOWN or t.payload is None:
            await _requeue(ctx, t)  # the maintenance pass would do it too, a lease later
            return
        # The budget was crossed or the operator withdrew admissions: this request is dropped.
        generated = 0
        if t.phase is Phase.SENDING:
            generated = int(t.generated(ctx.length))
        await _release_and_end(ctx, t, JobEnd.skip(reason.skip), generated)
    except Exception as exc:  # noqa: BLE001 - Redis gone: the lease will expire and it is requeued
        log.warning("job %s: could not settle after cancel (%s): %s", t.job_id, reason.value, exc)
