"""The simulated engine: a continuous-batching capacity model driven by events, and its accounting.

Time model. Up to ``max_running_requests`` requests hold a slot; the rest wait in a FIFO queue. A slot's
request is prefilled (one pipeline for all: TTFT grows with the prompts ahead of it), then decodes. With B
requests decoding the aggregate rate is ``peak * B / (B + half_batch)`` tokens/s, so each one decodes at
``peak / (B + half_batch)``: the batch's throughput saturates while each request slows down.

Event-driven. Every decoding request advances at the same rate, so one number V(t) -- the tokens
any decoding request has gained since time 0 -- describes them all. A request that starts decoding
at V0 with a target of n tokens finishes when V reaches V0 + n: a heap keyed by that value orders
the finishes. V is brought up to date only when something happens (arrival, prefill end, finish,
abort), and one timer sleeps until the next finish or prefill end: O(log n) per event.
"""

from __future__ import annotations

import asyncio
import heapq
import math
import time
from collections import deque

from budgetq.simulator.metrics import E2E_BUCKETS, TTFT_BUCKETS, Histogram
from budgetq.simulator.prefix_cache import PrefixCache
from budgetq.simulator.settings import SimSettings
from budgetq.simulator.texts import Script

__all__ = ["DONE", "Engine", "RequestRecord", "SimSettings"]

QUEUED, PREFILL, DECODE, DONE = range(4)
FINISH, CUT = 0, 1   # kinds of heap events


class RequestRecord:
    """One request that reached the engine: its timeline and the tokens it got."""

    __slots__ = ("rid", "endpoint", "arrived", "prompt_tokens", "input_ids_head", "target", "natural_finish",
                 "reasoning_target", "state", "completion_tokens", "finish", "finished", "admitted", "first_token",
                 "v_start", "done", "waiter", "dropped", "seq", "abort_message", "_t_arrived", "cut_at", "cut",
                 "client_gone", "sampling", "cached_tokens", "script", "shape", "loop_onset", "max_chunk_tokens")

    def __init__(self, rid: str, prompt_tokens: int, target: int, natural_finish: str = "stop",
                 endpoint: str = "", input_ids_head: list[int] | None = None, reasoning_target: int = 0) -> None:
        self.rid = rid
        self.endpoint = endpoint
        self.arrived = time.time()
        self.prompt_tokens = prompt_tokens
        self.input_ids_head = input_ids_head
        self.target = target
        self.natural_finish = natural_finish
        self.reasoning_target = reasoning_target
        self.state = QUEUED
        self.completion_tokens = 0
        self.finish = ""
        self.finished: float | None = None
        self.admitted: float | None = None
        self.first_token: float | None = None
        self.v_start = 0.0
        self.done: asyncio.Future | None = None
        self.waiter: asyncio.Future | None = None     # a stream waiting for its next tick
        self.dropped = False
        self.seq = 0
        self.abort_message = ""
        self._t_arrived = 0.0
        self.cut_at: int | None = None   # a drop fault closes the connection after this many tokens
        self.cut = False                 # ... and has: the request goes on until SGLang would notice
        self.client_gone = False
        self.sampling: dict | None = None  # the effective sampling parameters (chat: after defaults)
        self.cached_tokens = 0             # prompt tokens found in the prefix cache: no prefill for them
        self.script: Script | None = None  # the words it writes (simulator/texts.py); set by the runner
        self.shape = "normal"              # normal | loop | empty | unclosed (texts.Shape)
        self.loop_onset: int | None = None # loop: the tokens before its cycle starts
        self.max_chunk_tokens = 0          # a stream's largest chunk but its last (docs/simulator.md)

    def to_json(self) -> dict:
        return {"rid": self.rid, "endpoint": self.endpoint, "arrived": self.arrived, "admitted": self.admitted,
                "first_token": self.first_token, "finished": self.finished, "finish": self.finish,
                "prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "target_tokens": self.target, "reasoning_tokens": min(self.completion_tokens, self.reasoning_target),
                "input_ids_head": self.input_ids_head, "sampling": self.sampling, "client_gone": self.client_gone,
                "cached_tokens": self.cached_tokens, "shape": self.shape, "loop_onset": self.loop_onset,
                "max_chunk_tokens": self.max_chunk_tokens}


class Engine:
    """Shares an aggregate token rate among running requests; the rest wait in a FIFO queue."""

    def __init__(self, settings: SimSettings) -> None:
        self.s = settings
        self._loop: asyncio.AbstractEventLoop | None = None
        self._queue: deque[RequestRecord] = deque()
        self._prefill: deque[tuple[float, RequestRecord]] = deque()   # FIFO, so ends are in order
        self._prefill_free = 0.0
        self._heap: list[tuple[float, int, int, RequestRecord]] = []  # (V at event, seq, kind, request)
        self._decoding: dict[int, RequestRecord] = {}
        self._inflight: dict[int, RequestRecord] = {}
        # rid -> request, from submit until it ends: SGLang's rid_to_state (duplicate rids are refused).
        self.live_rids: dict[str, RequestRecord] = {}
        self._seq = 0
        self._v = 0.0
        self._t = 0.0
        self._timer: asyncio.TimerHandle | None = None
        self.records: deque[RequestRecord] = deque(maxlen=settings.keep_records)
        kv = settings.max_total_num_tokens or settings.max_running_requests * 4096
        self.prefix_cache = PrefixCache(kv) if settings.radix_cache else None
        self.reset_counters()

    def reset_counters(self) -> None:
        self.records.clear()
        self.running = sum(1 for r in self._inflight.values() if r.state in (PREFILL, DECODE))
        self.queued = sum(1 for r in self._inflight.values() if r.state == QUEUED)
        self.requests = 0
        self.completed = 0
        self.aborted = 0
        self.dropped = 0
        self.orphaned = 0              # ended by itself after its client had gone (not yet noticed)
        self.orphaned_tokens = 0
        self.prompt_tokens = 0
        self.cached_tokens = 0         # of prompt_tokens, found in the prefix cache (no prefill)
        self._done_tokens = 0          # tokens of requests no longer decoding (kept or not)
        self.aborted_tokens = 0
        self.dropped_tokens = 0
        self.peak_running = self.running
        self.peak_queued = self.queued
        self.ttft = Histogram(TTFT_BUCKETS)
        self.e2e = Histogram(E2E_BUCKETS)

    # --- time -----------------------------------------------------------------------------------

    def _lp(self) -> asyncio.AbstractEventLoop:
        assert self._loop is not None, "the engine has not seen a request yet"
        return self._loop

    def _now(self) -> float:
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
            self._t = self._loop.time()
        return self._loop.time()

    def rate_per_request(self, decoding: int | None = None) -> float:
        """Tokens/s (simulated time scaled by speed-up) each decoding request gains."""
        b = len(self._decoding) if decoding is None else decoding
        return self.s.peak_tok_s * self.s.speedup / (max(b, 1) + self.s.half_batch)

    def throughput(self) -> float:
        """Aggregate decode tokens/s right now, in simulated time (what SGLang's gen_throughput shows)."""
        b = len(self._decoding)
        return self.s.peak_tok_s * b / (b + self.s.half_batch) if b else 0.0

    def _advance(self, now: float) -> None:
        if self._decoding:
            self._v += self.rate_per_request() * (now - self._t)
        self._t = now

    def _v_at(self, now: float) -> float:
        return self._v + (self.rate_per_request() * (now - self._t) if self._decoding else 0.0)

    def tokens_now(self, rec: RequestRecord) -> int:
        """Tokens ``rec`` has so far (streaming reads this between events)."""
        if rec.state == DECODE:
            return min(rec.target, int(self._v_at(self._now()) - rec.v_start + 1e-6))
        return rec.completion_tokens

    # --- requests -------------------------------------------------------------------------------

    def submit(self, rec: RequestRecord, drop_at: int | None = None) -> RequestRecord:
        """Queue ``rec``; with ``drop_at`` it stops after that many tokens and counts as dropped."""
        now = self._now()
        rec._t_arrived = now
        self.records.append(rec)
        self.requests += 1
        self.prompt_tokens += rec.prompt_tokens
        self.cached_tokens += rec.cached_tokens
        if drop_at is not None:
            rec.dropped = True
            rec.cut_at = min(drop_at, rec.target)
        if self.s.instant:  # no time passes, so a dropped request ends at its drop point
            rec.admitted = rec.first_token = time.time()
            self._close(rec, (rec.cut_at or 0) if rec.dropped else rec.target,
                        "drop" if rec.dropped else rec.natural_finish, now)
            return rec
        self.live_rids[rec.rid] = rec
        self._seq += 1
        rec.seq = self._seq
        self._inflight[rec.seq] = rec
        rec.done = self._lp().create_future()
        self._queue.append(rec)
        self.queued += 1
        self.peak_queued = max(self.peak_queued, self.queued)
        self._admit(now)
        self._schedule()
        return rec

    async def wait(self, rec: RequestRecord) -> None:
        """Until ``rec`` is finished, aborted or its connection cut. Cancelling the caller is a
        client disconnect (see ``disconnect``)."""
        if rec.state == DONE or rec.cut:
            return
        assert rec.done is not None
        try:
            await asyncio.shield(rec.done)
        except asyncio.CancelledError:
            self.disconnect(rec, stream=False)
            raise

    def disconnect(self, rec: RequestRecord, stream: bool) -> None:
        """The client went away: abort ``rec`` when SGLang would notice, not at once.

        Non-streaming: at the next state-wait poll, every ``disconnect_poll_s`` from arrival
        (tokenizer_manager._stream_one_response). Streaming: ``stream_abort_s`` after the
        disconnect (create_abort_task). Until then the request keeps its slot, its rid and
        generates. One timer per disconnected request only: the normal path has none."""
        if rec.state == DONE or rec.client_gone:
            return
        rec.client_gone = True
        delay = 0.0
        if not self.s.instant:
            now = self._now()
            if stream:
                delay = self.s.stream_abort_s / self.s.speedup
            elif self.s.disconnect_poll_s > 0:
                poll = self.s.disconnect_poll_s / self.s.speedup
                elapsed = now - rec._t_arrived
                delay = max(1, math.ceil(elapsed / poll - 1e-9)) * poll - elapsed
        if delay <= 0:
            self._abort_disconnected(rec)
        else:
            self._lp().call_later(delay, self._abort_disconnected, rec)

    def _abort_disconnected(self, rec: RequestRecord) -> None:
        # SGLang sends AbortReq(rid) for it; the scheduler aborts by prefix (rids starting with this one go too)
        if rec.state != DONE:
            self.abort_rid(rec.rid)

    def abort(self, rec: RequestRecord) -> None:
        """Stop ``rec`` now: tokens made so far stay counted as generated and count as aborted."""
        if rec.state == DONE:
            return
        now = self._now()
        tokens = 0
        rec.abort_message = "Abort in waiting queue" if rec.state == QUEUED else "Aborted"
        if rec.state == QUEUED:
            self.queued -= 1               # removed lazily from the deque
        elif rec.state == PREFILL:
            self.running -= 1
        else:
            self._advance(now)
            tokens = min(rec.target, int(self._v - rec.v_start + 1e-6))
            del self._decoding[rec.seq]
            self.running -= 1
        self._close(rec, tokens, "drop" if rec.cut else "abort", now)
        self._admit(now)
        self._schedule()

    def abort_rid(self, rid: str) -> int:
        """SGLang's /abort_request: nothing unless ``rid`` is in flight, then every rid starting with it."""
        if rid not in self.live_rids:
            return 0
        live = list(self._inflight.values())
        hits = [r for r in live if r.rid.startswith(rid)]
        for r in hits:
            self.abort(r)
        return len(hits)

    def abort_all(self) -> int:
        live = list(self._inflight.values())
        for r in live:
            self.abort(r)
        return len(live)

    def _close(self, rec: RequestRecord, tokens: int, finish: str, now: float) -> None:
        rec.state = DONE
        rec.completion_tokens = tokens
        rec.finish = finish
        rec.finished = time.time()
        self._done_tokens += tokens
        if finish == "abort":
            self.aborted += 1
            self.aborted_tokens += tokens
        elif finish == "drop":
            self.dropped += 1
            self.dropped_tokens += tokens
            self.aborted_tokens += tokens
        elif rec.client_gone:
            # It ended by itself before SGLang noticed the disconnect: nobody got it, so it is waste.
            self.orphaned += 1
            self.orphaned_tokens += tokens
            self.aborted_tokens += tokens
        else:
            self.completed += 1
            self.e2e.observe(now - rec._t_arrived)
        self._inflight.pop(rec.seq, None)
        if self.live_rids.get(rec.rid) is rec:
            del self.live_rids[rec.rid]
        if rec.done is not None and not rec.done.done():
            rec.done.set_result(None)
        if rec.waiter is not None and not rec.waiter.done():
            rec.waiter.set_result(None)

    def _cut(self, rec: RequestRecord) -> None:
        """A drop fault's moment: wake the handler (it closes the connection); generation goes on."""
        if rec.cut:
            return
        rec.cut = True
        for fut in (rec.done, rec.waiter):
            if fut is not None and not fut.done():
                fut.set_result(None)
        if rec.done is not None:
            # A fresh future for the end itself (nobody waits on it: the handler is gone).
            rec.done = self._lp().create_future()

    # --- the event loop of the model ------------------------------------------------------------

    def _admit(self, now: float) -> None:
        limit = self.s.max_running_requests
        while self._queue and self.running < limit:
            rec = self._queue.popleft()
            if rec.state != QUEUED:
                continue
            self.queued -= 1
            self.running += 1
            start = max(now, self._prefill_free)
            # Cached prompt tokens need no prefill (SGLang computes only the uncached extend part).
            end = start + (rec.prompt_tokens - rec.cached_tokens) / (self.s.prefill_tok_s * self.s.speedup)
            self._prefill_free = end
            rec.state = PREFILL
            rec.admitted = time.time()
            self._prefill.append((end, rec))
        self.peak_running = max(self.peak_running, self.running)

    def _on_timer(self) -> None:
        self._timer = None
        now = self._lp().time()
        self._advance(now)
        # Finished decodes first (they free slots), with a tolerance of a microsecond of decoding.
        done_v = self._v + self.rate_per_request() * 1e-6
        heap = self._heap
        while heap and (heap[0][3].state != DECODE or heap[0][0] <= done_v):
            _, _, kind, rec = heapq.heappop(heap)
            if rec.state != DECODE or rec.seq not in self._decoding:
                continue
            if kind == CUT:
                self._cut(rec)
                continue
            del self._decoding[rec.seq]
            self.running -= 1
            self._close(rec, rec.target, "drop" if rec.dropped else rec.natural_finish, now)
        while self._prefill and (self._prefill[0][1].state != PREFILL or self._prefill[0][0] <= now + 1e-9):
            _, rec = self._prefill.popleft()
            if rec.state != PREFILL:
                continue
            rec.first_token = time.time()
            self.ttft.observe(now - rec._t_arrived)
            if rec.target <= 0:
                self.running -= 1
                self._close(rec, 0, "drop" if rec.dropped else rec.natural_finish, now)
                continue
            rec.state = DECODE
            rec.v_start = self._v
            self._decoding[rec.seq] = rec
            heapq.heappush(heap, (self._v + rec.target, rec.seq, FINISH, rec))
            if rec.cut_at is not None:
                if rec.cut_at <= 0:
                    self._cut(rec)
                else:
                    heapq.heappush(heap, (self._v + rec.cut_at, rec.seq, CUT, rec))
        self._admit(now)
        self._schedule()

    def _schedule(self) -> None:
        """Point the one timer at the next prefill end or decode finish."""
        heap = self._heap
        while heap and heap[0][3].state != DECODE:
            heapq.heappop(heap)
        while self._prefill and self._prefill[0][1].state != PREFILL:
            self._prefill.popleft()
        when = math.inf
        if heap:
            when = self._t + (heap[0][0] - self._v) / self.rate_per_request()
        if self._prefill:
            when = min(when, self._prefill[0][0])
        if self._timer is not None:
            if abs(self._timer.when() - when) < 1e-7:
                return
            self._timer.cancel()
            self._timer = None
        if when != math.inf:
            self._timer = self._lp().call_at(when, self._on_timer)

    # --- reporting ------------------------------------------------------------------------------

    def generated_tokens(self) -> int:
        """Every token made so far, kept or wasted, including those of requests still decoding."""
        return self._done_tokens + sum(self.tokens_now(r) for r in self._decoding.values())

    def stats(self) -> dict:
        names = ("running", "queued", "requests", "completed", "aborted", "dropped", "orphaned", "orphaned_tokens",
                 "aborted_tokens", "dropped_tokens", "prompt_tokens", "cached_tokens", "peak_running", "peak_queued")
        return {**{n: getattr(self, n) for n in names}, "generated_tokens": self.generated_tokens(),
                "gen_throughput": self.throughput()}
