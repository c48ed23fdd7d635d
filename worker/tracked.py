"""A claimed job as the worker tracks it: its phase, and how it is cancelled. A leaf module:
the runner, the job flow and control all read it, and it imports none of them."""

from __future__ import annotations

import asyncio
import enum
import time
from dataclasses import dataclass, field

from budgetq.shared.jobs import Claimed, Skip
from budgetq.shared.schema import JobPayload


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
    admitted_at: float = 0.0
    reserved: int = 0
    prompt_tokens: int = 0
    abort_reason: Abort | None = None

    @property
    def job_id(self) -> str:
        return self.claimed.job_id

    def cancel(self, reason: Abort, force: bool = False) -> None:
        """Cancel this job's task; a result being committed is only interrupted when forced."""
        if self.task is None or self.task.done() or (self.phase is Phase.COMMITTING and not force):
            return
        if self.abort_reason is None:
            self.abort_reason = reason
        self.task.cancel()


# Registry member ("<job id>:<execution id>") -> job being handled; the runner adds, the job
# flow removes, control reads (to abort and to refine reservations).
JobTable = dict[str, Tracked]
