"""What one job needs from the worker, built once in ``ConcurrentWorker.run`` and handed to
every job task (worker/jobflow.py): nothing else of the worker is reachable from a job."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Literal

from budgetq.shared.scripts import Batcher
from budgetq.worker.control import Control
from budgetq.worker.estimator import LengthModel
from budgetq.worker.recorder import Recorder
from budgetq.worker.sglang_client import SGLangClient
from budgetq.worker.tracked import JobTable


class Slots(asyncio.Semaphore):
    """The server-slot semaphore, also counting how many are held (and the peak); ``resize``
    changes how many there are while requests run (worker.concurrency: auto)."""

    def __init__(self, n: int) -> None:
        super().__init__(n)
        self.limit = n
        self.held = 0
        self.peak = 0
        self._retire = 0    # permits to take out of circulation as they come free (a shrink)

    async def acquire(self) -> Literal[True]:
        while True:
            await super().acquire()
            if self._retire == 0:
                break
            self._retire -= 1   # this permit is retired: the limit went down
        self.held += 1
        self.peak = max(self.peak, self.held)
        return True

    def resize(self, n: int) -> None:
        """``n`` slots from now on: more are free at once, fewer take effect as held ones are released."""
        grow = n - self.limit
        self.limit = n
        if grow < 0:
            self._retire -= grow
            return
        keep = min(grow, self._retire)    # permits not yet retired stay in circulation
        self._retire -= keep
        for _ in range(grow - keep):
            super().release()

    def release(self) -> None:
        self.held -= 1
        super().release()


@dataclass(frozen=True)
class JobContext:
    batch: Batcher          # every script call of a job (reserve, commit, release, requeue)
    client: SGLangClient    # the request itself
    slots: Slots            # a server slot, held from admission to the response
    length: LengthModel     # observes response lengths (the taper's estimate)
    control: Control        # per-dataset waiting / pausing / room; abort on a crossing
    recorder: Recorder      # how the job ended
    jobs: JobTable          # the job removes itself when done
    wake: asyncio.Event     # tells the feeder room was freed
