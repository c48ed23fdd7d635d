"""Lua scripts: loaded once from shared/lua/*.lua, called by SHA, from sync, async or batched code.

A script call is a plain value (``ScriptCall``: script, keys, args, and how to read the
reply), built by the typed functions in shared/budget.py and shared/jobs.py. One call can
then run on a blocking client (``run``), an asyncio client (``arun``), or be coalesced
with other calls made in the same event-loop turn into one pipeline round trip
(``Batcher``), so the hot path pays one round trip for many jobs.
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
    return resources.files("shared").joinpath("lua", f"{name}.lua").read_text()


class _Script:
    def __init__(self, name: str) -> None:
        self.name = name
        self.source = _load(name)
        self.sha = hashlib.sha1(self.source.encode()).hexdigest()


SCRIPTS: dict[str, _Script] = {n: _Script(n) for n in (
    "reserve", "commit", "release", "adjust", "withdraw", "adopt", "claim", "requeue", "finish")}


@dataclass(frozen=True)
class ScriptCall(Generic[T]):
    script: str
    keys: list[str]
    args: list[Any]
    parse: Callable[[Any], T]

    @property
    def _evalsha(self) -> tuple:
        return (SCRIPTS[self.script].sha, len(self.keys), *self.keys, *self.args)


def run(client: redis.Redis | redis.client.Pipeline, call: ScriptCall[T]) -> T:
    """Run one call on a blocking client; (re)loads the script if Redis lost it (restart)."""
    try:
        raw = client.evalsha(*call._evalsha)
    except NoScriptError:
        client.script_load(SCRIPTS[call.script].source)
        raw = client.evalsha(*call._evalsha)
    return call.parse(raw)


async def arun(client: aredis.Redis, call: ScriptCall[T]) -> T:
    try:
        raw = await client.evalsha(*call._evalsha)
    except NoScriptError:
        await client.script_load(SCRIPTS[call.script].source)
        raw = await client.evalsha(*call._evalsha)
    return call.parse(raw)


def run_many(client: redis.Redis, calls: list[ScriptCall]) -> list[Any]:
    """Run calls in one pipeline round trip (blocking); each result is parsed or an exception."""
    if not calls:
        return []
    raws = _pipe(client, calls)
    if any(isinstance(r, NoScriptError) for r in raws):
        for s in {c.script for c in calls}:
            client.script_load(SCRIPTS[s].source)
        again = [i for i, r in enumerate(raws) if isinstance(r, NoScriptError)]
        for i, r in zip(again, _pipe(client, [calls[i] for i in again]), strict=True):
            raws[i] = r
    return [_parse(c, r) for c, r in zip(calls, raws, strict=True)]


def _pipe(client: redis.Redis, calls: list[ScriptCall]) -> list[Any]:
    with client.pipeline(transaction=False) as p:
        for c in calls:
            p.evalsha(*c._evalsha)
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
        self.round_trips = 0
        self.calls = 0

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
            asyncio.get_running_loop().create_task(self._send(batch))

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
            raws = await self._apipe(calls)
            if any(isinstance(r, NoScriptError) for r in raws):
                for s in {c.script for c in calls}:
                    await self._client.script_load(SCRIPTS[s].source)
                again = [i for i, r in enumerate(raws) if isinstance(r, NoScriptError)]
                for i, r in zip(again, await self._apipe([calls[i] for i in again]), strict=True):
                    raws[i] = r
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

    async def _apipe(self, calls: list[ScriptCall]) -> list[Any]:
        self.round_trips += 1
        self.calls += len(calls)
        async with self._client.pipeline(transaction=False) as p:
            for c in calls:
                p.evalsha(*c._evalsha)
            return await p.execute(raise_on_error=False)
