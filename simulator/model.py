"""The simulated engine: response lengths, a capacity curve, and the accounting of work done."""

from __future__ import annotations

import asyncio
import math
import random
import time
from dataclasses import dataclass, field


@dataclass
class SimSettings:
    max_running_requests: int = 256
    # Aggregate decode speed at full batch, tokens/s (before speed-up), and the batch size
    # at which half of it is reached: tok/s(B) = peak * B / (B + half_batch).
    peak_tok_s: float = 20_000.0
    half_batch: float = 32.0
    prefill_tok_s: float = 50_000.0
    length_mean: float = 1500.0
    length_sigma: float = 0.8
    # rid prefix -> mean response length, so one simulator can mimic several datasets.
    length_means: dict[str, float] = field(default_factory=dict)
    speedup: float = 1.0
    error_rate: float = 0.0
    context_length: int = 32768
    seed: int = 0
    model: str = "sim-model"


@dataclass
class RequestRecord:
    rid: str
    arrived: float
    prompt_tokens: int
    completion_tokens: int = 0
    finished: float | None = None
    finish: str = ""


class Engine:
    """Shares an aggregate token rate among running requests; the rest wait in a queue."""

    TICK_S = 0.005

    def __init__(self, settings: SimSettings) -> None:
        self.s = settings
        self._rng = random.Random(settings.seed)
        self._slots = asyncio.Semaphore(settings.max_running_requests)
        self.running = 0
        self.queued = 0
        self.generated_tokens = 0
        self.aborted_tokens = 0
        self.records: list[RequestRecord] = []

    def draw_length(self, rid: str, max_tokens: int) -> int:
        mean = self.s.length_mean
        for prefix, m in self.s.length_means.items():
            if rid.startswith(prefix):
                mean = m
                break
        sigma = self.s.length_sigma
        # lognormal with E[X] = mean: mu = ln(mean) - sigma^2 / 2
        n = int(self._rng.lognormvariate(math.log(mean) - sigma * sigma / 2, sigma)) + 1
        return min(n, max_tokens)

    def rate_per_request(self) -> float:
        b = max(self.running, 1)
        return self.s.peak_tok_s * b / (b + self.s.half_batch) / b

    async def generate(self, rec: RequestRecord, target: int, on_tokens=None) -> None:
        """Advance ``rec`` to ``target`` tokens at the capacity model's pace.

        Cancellation (client disconnect) stops the work, as SGLang aborts; tokens made so far
        stay counted in ``generated_tokens`` so benchmarks can measure waste.
        """
        self.queued += 1
        try:
            await self._slots.acquire()
        finally:
            self.queued -= 1
        self.running += 1
        try:
            await asyncio.sleep(rec.prompt_tokens / self.s.prefill_tok_s / self.s.speedup)
            progress = 0.0
            last = time.monotonic()
            while rec.completion_tokens < target:
                await asyncio.sleep(self.TICK_S)
                now = time.monotonic()
                progress += self.rate_per_request() * (now - last) * self.s.speedup
                last = now
                step = min(int(progress), target - rec.completion_tokens)
                if step:
                    progress -= step
                    rec.completion_tokens += step
                    self.generated_tokens += step
                    if on_tokens is not None:
                        await on_tokens(rec.completion_tokens)
        except asyncio.CancelledError:
            rec.finish = "abort"
            self.aborted_tokens += rec.completion_tokens
            raise
        finally:
            self.running -= 1
            self._slots.release()
            rec.finished = time.time()

    def stats(self) -> dict:
        return {
            "running": self.running, "queued": self.queued, "requests": len(self.records),
            "generated_tokens": self.generated_tokens, "aborted_tokens": self.aborted_tokens,
        }
