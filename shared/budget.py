"""Typed wrappers around the budget Lua scripts, plus the dataset registry in Redis.

The scripts' sentinel strings become an enum right here, so no caller compares strings.
Scripts are read from their .lua files once, at import, and registered per client
(redis-py re-sends them on NOSCRIPT, e.g. after a Redis restart).
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass
from importlib import resources
from typing import Any

import redis
import redis.asyncio as aredis

from shared import keys
from shared.config import DatasetConfig


def _load(name: str) -> str:
    return resources.files("shared").joinpath("lua", f"{name}.lua").read_text()


_RESERVE, _COMMIT, _RELEASE = _load("reserve"), _load("commit"), _load("release")


class Admission(enum.Enum):
    ADMIT = "ADMIT"
    DONE = "DONE"
    PAUSED = "PAUSED"
    EXHAUSTED = "EXHAUSTED"
    WAIT = "WAIT"


@dataclass(frozen=True)
class Reservation:
    status: Admission
    tokens: int


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


class AsyncBudget:
    """Budget operations for workers (redis.asyncio)."""

    def __init__(self, client: aredis.Redis) -> None:
        self._reserve = client.register_script(_RESERVE)
        self._commit = client.register_script(_COMMIT)
        self._release = client.register_script(_RELEASE)

    async def reserve(self, ds: str, job_id: str, max_tokens: int) -> Reservation:
        status, tokens = await self._reserve(keys=keys.budget_keys(ds), args=[job_id, max_tokens])
        return Reservation(Admission(_text(status)), int(tokens))

    async def commit(self, ds: str, job_id: str, tokens: int, row_json: str) -> bool:
        """True if counted now; False if the prompt had already been committed."""
        status, _used = await self._commit(keys=keys.budget_keys(ds), args=[job_id, tokens, row_json, ds])
        return _text(status) == "COMMITTED"

    async def release(self, ds: str, job_id: str) -> int:
        return int(await self._release(keys=keys.budget_keys(ds), args=[job_id]))


class SyncBudget:
    """The same operations for the producer, CLI and tests (blocking redis-py)."""

    def __init__(self, client: redis.Redis) -> None:
        self.client = client
        self._reserve = client.register_script(_RESERVE)
        self._commit = client.register_script(_COMMIT)
        self._release = client.register_script(_RELEASE)

    def reserve(self, ds: str, job_id: str, max_tokens: int) -> Reservation:
        status, tokens = self._reserve(keys=keys.budget_keys(ds), args=[job_id, max_tokens])
        return Reservation(Admission(_text(status)), int(tokens))

    def commit(self, ds: str, job_id: str, tokens: int, row_json: str) -> bool:
        status, _used = self._commit(keys=keys.budget_keys(ds), args=[job_id, tokens, row_json, ds])
        return _text(status) == "COMMITTED"

    def release(self, ds: str, job_id: str) -> int:
        return int(self._release(keys=keys.budget_keys(ds), args=[job_id]))


def register_dataset(client: redis.Redis, ds: DatasetConfig) -> None:
    """Write a dataset's budget settings; keeps counters (a restarted producer continues)."""
    pipe = client.pipeline()
    pipe.sadd(keys.DATASETS, ds.name)
    pipe.hset(keys.conf_key(ds.name), mapping={
        "limit": ds.budget, "mode": ds.mode, "prior_mean": ds.prior_mean,
        "max_tokens": ds.max_tokens, "registered_at": f"{time.time():.3f}",
    })
    pipe.hsetnx(keys.conf_key(ds.name), "paused", "0")
    pipe.execute()


@dataclass(frozen=True)
class DatasetState:
    name: str
    limit: int
    mode: str
    paused: bool
    used: int
    reserved: int
    in_flight: int
    max_tokens: int
    stats: dict[str, int]
    # Added for status/monitor (defaults keep older callers working).
    count: str = "completion"
    keep: str = "all"
    prior_mean: int = 0
    registered_at: float | None = None

    @property
    def exhausted(self) -> bool:
        """True once no new request for this dataset can be admitted by the budget."""
        if self.mode == "strict":
            return self.used + self.max_tokens > self.limit
        return self.used >= self.limit


def dataset_state(client: redis.Redis, name: str) -> DatasetState:
    pipe = client.pipeline(transaction=False)
    pipe.hgetall(keys.conf_key(name))
    pipe.get(keys.used_key(name))
    pipe.get(keys.reserved_key(name))
    pipe.hlen(keys.resv_key(name))
    pipe.hgetall(keys.stats_key(name))
    conf, used, reserved, in_flight, stats = pipe.execute()
    conf = {_text(k): _text(v) for k, v in conf.items()}
    stats_i = {_text(k): int(float(v)) for k, v in stats.items()}
    return DatasetState(
        name=name, limit=int(conf.get("limit", 0)), mode=conf.get("mode", "soft"),
        paused=conf.get("paused") == "1", used=int(used or 0), reserved=int(reserved or 0),
        in_flight=int(in_flight), max_tokens=int(conf.get("max_tokens", 0)), stats=stats_i,
        count=conf.get("count", "completion"), keep=conf.get("keep", "all"),
        prior_mean=int(float(conf.get("prior_mean", 0))),
        registered_at=float(conf["registered_at"]) if conf.get("registered_at") else None,
    )


def incr_stat(client: redis.Redis, name: str, field: str, by: int = 1) -> None:
    client.hincrby(keys.stats_key(name), field, by)
