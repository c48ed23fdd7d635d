"""A claimed job as the worker tracks it: its phase, and how it is cancelled. A leaf module:
the runner, the job flow and control all read it, and it imports none of them."""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from dataclasses import dataclass, field
from typing import Protocol

from budgetq.shared.jobs import Claimed, Skip
from budgetq.shared.schema import JobPayload


class DecodeRate(Protocol):
    """What ``Tracked.generated`` needs of worker/estimator.py's LengthModel (tracked.py stays a leaf)."""

    def generated_so_far(self, elapsed_s: float) -> float: ...


class Phase(enum.Enum):
    PENDING = "pending"        # claimed, waiting for a slot or its reservation
    PARKED = "parked"          # the budget may fit it once requests in flight finish
    SENDING = "sending"        # admitted, request at the server
    COMMITTING = "committing"  # response in hand, being counted


class Abort(enum.Enum):
    """Why a job's task was cancelled."""

    BUDGET = "budget"          # our commit crossed a soft budget: every admission was withdrawn
    WITHDRAWN = "withdrawn"    # its admission is gone (crossed elsewhere, operator, lost lease)
    SHUTDOWN = "shutdown"      # the worker is stopping: requeue it

    @property
    def skip(self) -> Skip:
        """How a request aborted in flight for this reason is recorded (not for SHUTDOWN)."""
        return Skip.ABORTED_BUDGET if self is Abort.BUDGET else Skip.ABORTED_WITHDRAWN


@dataclass
class Tracked:
    claimed: Claimed
    ds: str
    phase: Phase = Phase.PENDING
    payload: JobPayload | None = None
    task: asyncio.Task | None = None
    started_at: float = field(default_factory=time.time)
    admitted_at: float = 0.0   # when its request (of a regenerate: all job, its current one) was sent
    # The request's tokens so far as its stream says (worker/sglang_stream.py ``Watch``); None while nothing
    # was streamed (server.stream false, or no chunk yet): then they are estimated from elapsed time.
    streamed: int | None = None
    reserved: int = 0
    prompt_tokens: int = 0
    abort_reason: Abort | None = None
    reported: bool = False     # said once that it has been held long (``report_long_held``)
    # run_job sets ``started`` at its first step. A task cancelled before that step never enters the
    # coroutine (its finally, which takes the job off the table and requeues it, would never run), so
    # such a cancel is only noted, and run_job acts on it when it starts.
    started: bool = False
    cancel_requested: bool = False

    @property
    def job_id(self) -> str:
        return self.claimed.job_id

    def progressed(self, tokens: int) -> None:
        """The stream's tokens so far (called after every read of its socket)."""
        self.streamed = tokens

    def new_request(self) -> None:
        """A request of this job is being sent: its own clock and progress start now."""
        self.admitted_at = time.monotonic()
        self.streamed = None

    def generated(self, length: DecodeRate, now: float | None = None) -> float:
        """Tokens its running request has made: what the stream said, else elapsed time x the decode rate.

        The stream's count is exact and current: the estimate is wrong in both directions (a request
        queued behind others has made none yet, a short one at a fast server more than the mean rate),
        and the end game's taper reserves by it (worker/control.py, worker/estimator.py)."""
        if self.streamed is not None:
            return float(self.streamed)
        return length.generated_so_far((time.monotonic() if now is None else now) - self.admitted_at)

    def cancel(self, reason: Abort, force: bool = False) -> None:
        """Cancel this job's task; a result being committed is only interrupted when forced."""
        if self.task is None or self.task.done() or (self.phase is Phase.COMMITTING and not force):
            return
        if self.abort_reason is None:
            self.abort_reason = reason
        if not self.started:
            self.cancel_requested = True
            return
        self.task.cancel()


# Registry member ("<job id>:<execution id>") -> job being handled; the runner adds, the job
# flow removes, control reads (to abort and to refine reservations).
JobTable = dict[str, Tracked]


LONG_HELD_S = 120.0


def report_long_held(jobs: JobTable, log: logging.Logger, now: float | None = None) -> None:
    """One INFO line per job held longer than LONG_HELD_S: its phase and the line its task waits at (a long
    generation is normal; a job that never ends is not, and this names where it waits)."""
    now = time.time() if now is None else now
    for t in jobs.values():
        if t.reported or now - t.started_at < LONG_HELD_S or t.task is None:
            continue
        t.reported = True
        frames = t.task.get_stack()
        at = f"{frames[-1].f_code.co_qualname} ({frames[-1].f_code.co_filename}:{frames[-1].f_lineno})" if frames \
            else "?"
        log.info("job %s: %s for %.0f s, waiting in %s", t.job_id, t.phase.value, now - t.started_at, at)
