"""Lua scripts: loaded once from shared/lua/*.lua, called by SHA, from sync, async or batched code.

A script call is a plain value (``ScriptCall``: script, keys, args, and how to read the
reply), built by the typed functions in shared/budget.py and shared/jobs.py. One call can
then run on a blocking client (``run``), an asyncio client (``arun``), or be coalesced
with other calls made in the same event-loop turn into one pipeline round trip
(``Batcher``), so the hot path pays one round trip for many jobs.

Item scripts (reserve, commit, finish: the three every prompt goes through) go further: their
ARGV is the arguments shared by every item, then one fixed-size group per item, and they
reply with one reply per item. Calls of such a script with the same keys and shared
arguments (the same dataset) are merged into one EVALSHA: the dataset's settings are read
once and its counters written once for the whole group, which is what makes one Redis core
carry tens of thousands of prompts a second (docs/benchmarks.md "Ceiling"). A merged call is
one atomic script run: its items are applied in order, as the separate calls would be.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources
from typing import Any, Generic, TypeVar

import redis
import redis.asyncio as aredis
from redis.exceptions import NoScriptError

T = TypeVar("T")


def _load(name: str) -> str:
    return resources.files("budgetq.shared").joinpath("lua", f"{name}.lua").read_text()


class _Script:
    def __init__(self, name: str) -> None:
        self.name = name
        self.source = _load(name)
        self.sha = hashlib.sha1(self.source.encode()).hexdigest()


SCRIPTS: dict[str, _Script] = {n: _Script(n) for n in (
    "reserve", "commit", "release", "adjust", "withdraw", "adopt", "claim", "requeue", "finish", "reopen",
    "features_mark")}


@dataclass(frozen=True)
class ScriptCall(Generic[T]):
    """``shared``: None for a plain script; for an item script, how many of ``args`` (the first
    ones) are shared by every item; the rest are this call's one item."""

    script: str
    keys: list[str]
    args: list[Any]
    parse: Callable[[Any], T]
    shared: int | None = None

    @property
    def _argv(self) -> list[Any]:
        """EVALSHA's arguments for this call on its own."""
        return [SCRIPTS[self.script].sha, len(self.keys), *self.keys, *self.args]

    @property
    def _merge_key(self) -> tuple | None:
        if self.shared is None:
            return None
        return (self.script, *self.keys, "", *self.args[: self.shared])


@dataclass
class _Evalsha:
    """One EVALSHA on the wire and the calls it answers (several when item calls were merged)."""

    script: str
    argv: list[Any]
    calls: list[ScriptCall]
    items: bool
    at: list[int]  # the calls' places in the list they came from

    def spread(self, raw: Any) -> list[Any]:
        """Its reply, one per call: an item script's reply list in order; an error to each."""
        if isinstance(raw, Exception) or not self.items:
            return [raw] * len(self.calls)
        if not isinstance(raw, list) or len(raw) != len(self.calls):
            err = redis.ResponseError(f"budgetq: {self.script}.lua answered {raw!r} for {len(self.calls)} items")
            return [err] * len(self.calls)
        return list(raw)


def _evalshas(calls: list[ScriptCall], merge: bool) -> list[_Evalsha]:
    """The EVALSHAs for ``calls``: with ``merge``, item calls of the same script, keys and shared
    arguments become one, at the place of the first of them (callers that merge are calls of
    independent jobs, whose relative order carries no meaning)."""
    out: list[_Evalsha] = []
    groups: dict[tuple, _Evalsha] = {}
    for i, c in enumerate(calls):
        key = c._merge_key
        if key is not None and merge and key in groups:
            e = groups[key]
            e.argv.extend(c.args[c.shared:])
            e.calls.append(c)
            e.at.append(i)
            continue
        e = _Evalsha(c.script, c._argv, [c], key is not None, [i])
        out.append(e)
        if key is not None:
            groups[key] = e
    return out


def _answers(n: int, evalshas: list[_Evalsha], raws: list[Any]) -> list[Any]:
    """The raw reply of each of the ``n`` calls, in their order."""
    out: list[Any] = [None] * n
    for e, raw in zip(evalshas, raws, strict=True):
        for i, r in zip(e.at, e.spread(raw), strict=True):
            out[i] = r
    return out


def _one(call: ScriptCall[T], raw: Any) -> T:
    value = _parse(call, _Evalsha(call.script, [], [call], call.shared is not None, [0]).spread(raw)[0])
    if isinstance(value, Exception):
        raise value
    return value


def run(client: redis.Redis | redis.client.Pipeline, call: ScriptCall[T]) -> T:
    """Run one call on a blocking client; (re)loads the script if Redis lost it (restart)."""
    try:
        raw = client.evalsha(*call._argv)
    except NoScriptError:
        client.script_load(SCRIPTS[call.script].source)
        raw = client.evalsha(*call._argv)
    return _one(call, raw)


async def arun(client: aredis.Redis, call: ScriptCall[T]) -> T:
    try:
        raw = await client.evalsha(*call._argv)
    except NoScriptError:
        await client.script_load(SCRIPTS[call.script].source)
        raw = await client.evalsha(*call._argv)
    return _one(call, raw)


def run_many(client: redis.Redis, calls: list[ScriptCall], merge: bool = False) -> list[Any]:
    """Run calls in one pipeline round trip (blocking); each result is parsed or an exception.

    ``merge``: the calls are of independent jobs (no call depends on another's effect), so item
    calls of one dataset may go as one EVALSHA."""
    if not calls:
        return []
    evalshas = _evalshas(calls, merge)
    raws = _pipe(client, evalshas)
    if any(isinstance(r, NoScriptError) for r in raws):
        for s in {e.script for e in evalshas}:
            client.script_load(SCRIPTS[s].source)
        again = [i for i, r in enumerate(raws) if isinstance(r, NoScriptError)]
        for i, r in zip(again, _pipe(client, [evalshas[i] for i in again]), strict=True):
            raws[i] = r
    return [_parse(c, r) for c, r in zip(calls, _answers(len(calls), evalshas, raws), strict=True)]


def _pipe(client: redis.Redis, evalshas: list[_Evalsha]) -> list[Any]:
    with client.pipeline(transaction=False) as p:
        for e in evalshas:
            p.evalsha(*e.argv)
        return p.execute(raise_on_error=False)


def _parse(call: ScriptCall, raw: Any) -> Any:
    if isinstance(raw, Exception):
        return raw
    return call.parse(raw)


class Batcher:
    """Coalesces the script calls made in one event-loop turn into one pipeline round trip.

    With hundreds of requests in flight, reservations and commits arrive in bursts; sending
    each on its own costs a round trip and a pool connection apiece.

    At most ``max_in_flight`` pipelines are on their way at once: calls made meanwhile wait for
    one to come back, then go together. Under load the batches grow by themselves instead of
    the round trips multiplying (half the worker's round trips and 5-12% less Redis CPU per
    prompt, at the same prompts/s: docs/benchmarks.md "Ceiling"); an idle worker's lone call
    still goes at once.
    """

    def __init__(self, client: aredis.Redis, max_batch: int = 256, max_in_flight: int = 1) -> None:
        self._client = client
        self._max = max_batch
        self._max_in_flight = max_in_flight
        self._in_flight = 0
        self._pending: list[tuple[ScriptCall, asyncio.Future]] = []
        self._scheduled = False
        # The pipelines on their way: the event loop keeps only weak references to tasks, and a
        # collected one would leave its callers waiting forever.
        self._sending: set[asyncio.Task] = set()
        self.round_trips = 0
        self.calls = 0
        self.evalshas = 0  # script runs sent: fewer than calls where item calls merged

    async def __call__(self, call: ScriptCall[T]) -> T:
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        self._pending.append((call, fut))
        self._schedule()
        return await fut

    def _schedule(self) -> None:
        if not self._scheduled and self._in_flight < self._max_in_flight:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._scheduled = False
        while self._pending and self._in_flight < self._max_in_flight:
            batch, self._pending = self._pending[: self._max], self._pending[self._max:]
            self._in_flight += 1
            task = asyncio.get_running_loop().create_task(self._send(batch))
            self._sending.add(task)
            task.add_done_callback(self._sending.discard)

    async def _send(self, batch: list[tuple[ScriptCall, asyncio.Future]]) -> None:
        try:
            await self._send_one(batch)
        finally:
            self._in_flight -= 1
            if self._pending:  # what came meanwhile goes now, together
                self._schedule()

    async def _send_one(self, batch: list[tuple[ScriptCall, asyncio.Future]]) -> None:
        calls = [c for c, _ in batch]
        try:
            # The calls of one batch come from independent jobs: item calls of a dataset merge.
            evalshas = _evalshas(calls, merge=True)
            raws = await self._apipe(evalshas)
            if any(isinstance(r, NoScriptError) for r in raws):
                for s in {e.script for e in evalshas}:
                    await self._client.script_load(SCRIPTS[s].source)
                again = [i for i, r in enumerate(raws) if isinstance(r, NoScriptError)]
                for i, r in zip(again, await self._apipe([evalshas[i] for i in again]), strict=True):
                    raws[i] = r
            raws = _answers(len(calls), evalshas, raws)
        except BaseException as exc:  # connection lost: every caller in the batch sees it
            for _, fut in batch:
                if not fut.done():
                    fut.set_exception(exc if isinstance(exc, Exception) else redis.ConnectionError(str(exc)))
            if not isinstance(exc, Exception):
                raise
            return
        for (call, fut), raw in zip(batch, raws, strict=True):
            if fut.done():  # the caller was cancelled meanwhile
                continue
            try:
                value = _parse(call, raw)
            except Exception as exc:  # noqa: BLE001 - a reply we cannot read fails that call only
                value = exc
            if isinstance(value, Exception):
                fut.set_exception(value)
            else:
                fut.set_result(value)

    async def _apipe(self, evalshas: list[_Evalsha]) -> list[Any]:
        self.round_trips += 1
        self.calls += sum(len(e.calls) for e in evalshas)
        self.evalshas += len(evalshas)
        async with self._client.pipeline(transaction=False) as p:
            for e in evalshas:
                p.evalsha(*e.argv)
            return await p.execute(raise_on_error=False)
