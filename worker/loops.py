"""The worker's background loops (control, heartbeat, maintenance, stats, servers, status): each
calls its function every interval; they stop together, in bounded time.

Stopping cancels each loop and also tells it to end at its next turn: a loop whose cancellation
was swallowed on the way (inside a library) would otherwise run on, and the worker wait for it
forever. Seen once here: a stopped worker's loops never ended, 40 s later, with nothing logged.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from budgetq.shared.retry import REDIS_DOWN

log = logging.getLogger("budgetq.worker")
STOP_S = 5.0  # how long stopping waits for the loops before it goes on without them


class Loops:
    def __init__(self, owner: str) -> None:
        self.owner = owner
        self.tasks: list[asyncio.Task] = []
        self._stopping = False

    def every(self, interval_s: float, fn: Callable[[], Awaitable[Any]], what: str) -> None:
        self.tasks.append(asyncio.create_task(self._every(interval_s, fn, what), name=what))

    def run(self, coro: Coroutine[Any, Any, Any], what: str) -> None:
        self.tasks.append(asyncio.create_task(coro, name=what))

    async def _every(self, interval_s: float, fn: Callable[[], Awaitable[Any]], what: str) -> None:
        while not self._stopping:
            await asyncio.sleep(interval_s)
            if self._stopping:
                return
            try:
                await fn()
                if self._stopping and (task := asyncio.current_task()) is not None and task.cancelling():
                    log.warning("worker %s: the %s loop's cancellation was swallowed in %s; it ends anyway",
                                self.owner, what, getattr(fn, "__qualname__", fn))
            except REDIS_DOWN as exc:
                log.warning("worker %s: %s skipped, redis unreachable: %s", self.owner, what, exc)
            except Exception:  # a bug in a background loop must not kill the worker silently
                log.exception("worker %s: %s failed", self.owner, what)

    async def stop(self, timeout_s: float = STOP_S) -> None:
        self._stopping = True
        for t in self.tasks:
            t.cancel()
        if not self.tasks:
            return
        _done, pending = await asyncio.wait(self.tasks, timeout=timeout_s)
        if pending:
            log.warning("worker %s: background loops still running %g s after the stop, left behind: %s",
                        self.owner, timeout_s, ", ".join(sorted(t.get_name() for t in pending)))
