"""What one job needs from the worker, built once in ``ConcurrentWorker.run`` and handed to
every job task (worker/jobflow.py): nothing else of the worker is reachable from a job."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Literal

from shared.scripts import Batcher
from worker.control import Control
from worker.estimator import LengthModel
from worker.recorder import Recorder
from worker.sglang_client import SGLangClient
from worker.tracked import JobTable


class Slots(asyncio.Semaphore):
    """The server-slot semaphore, also counting how many are held (and the peak)."""

    def __init__(self, n: int) -> None:
        super().__init__(n)
        self.held = 0
        self.peak = 0

    async def acquire(self) -> Literal[True]:
        await super().acquire()
        self.held += 1
        self.peak = max(self.peak, self.held)
        return True

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
