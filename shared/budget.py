"""The budget: typed calls of the budget Lua scripts, dataset registration and state.

The scripts' sentinel strings become enums right here, so no caller compares strings.
Each function returns a ``ScriptCall`` that runs through shared.scripts (blocking, async,
or batched with others into one round trip).
"""

from __future__ import annotations

import enum
import json
import time
from dataclasses import dataclass
from typing import Any

import redis
import redis.asyncio as aredis

from budgetq.shared import keys
from budgetq.shared.config import DatasetConfig
from budgetq.shared.redis_conn import text
from budgetq.shared.scripts import ScriptCall
from budgetq.shared.stats import Conf


class Admission(enum.Enum):
    ADMIT = "ADMIT"
    DONE = "DONE"
    PAUSED = "PAUSED"
    EXHAUSTED = "EXHAUSTED"
    WAIT = "WAIT"


class Outcome(enum.Enum):
    """What commit did with a result."""

    COMMITTED = "COMMITTED"
    CROSSED = "CROSSED"
    TRUNCATED = "TRUNCATED"
    DUPLICATE = "DUPLICATE"
    REJECTED = "REJECTED"
    DISCARDED = "DISCARDED"   # refused by the guard or a gate: side file, prompt done
    RETRY = "RETRY"           # refused, to be sent again (retry_discarded): ticket given back, not done

    @property
    def kept(self) -> bool:
        return self in (Outcome.COMMITTED, Outcome.CROSSED, Outcome.TRUNCATED)


class Released(enum.Enum):
    """What release did with a reservation."""

    RELEASED = "RELEASED"          # given back (0 tokens if the job held none)
    NOT_OURS = "NOT_OURS"          # the caller's lease ran out: the job was requeued, maybe running elsewhere
    ALREADY_DONE = "ALREADY_DONE"  # another copy of the job committed it


@dataclass(frozen=True)
class Release:
    status: Released
    tokens: int


@dataclass(frozen=True)
class Reservation:
    status: Admission
    tokens: int


# reserve.lua (soft mode): until this many results are in, a fresh reservation is never below
# the dataset's prior mean (short answers finish first, so an early mean is biased low) ...
PRIOR_UNTIL = 50
# ... and the end-game margin (conf end_margin_z) waits for this many, to have a spread to use.
MARGIN_AFTER = 20


def reserve(ds: str, job_id: str, max_tokens: int, prompt_tokens: int = 0,
            requests: int = 1) -> ScriptCall[Reservation]:
    """``requests``: how many requests the job sends (regenerate: all, one per user turn)."""
    # KEYS 7-9 (results, hist, rate) are not reserve's: every key passed is an argument Redis builds.
    return ScriptCall("reserve", keys.budget_keys(ds)[:6],
                      [PRIOR_UNTIL, MARGIN_AFTER, job_id, max_tokens, prompt_tokens, requests],
                      lambda r: Reservation(Admission(text(r[0])), int(r[1])), shared=2)


def commit(ds: str, job_id: str, prompt_tokens: int, completion_tokens: int, finish_reason: str,
           row_json: str, lengths: list[int] | None = None, discard: str | None = None,
           retry: bool = False) -> ScriptCall[Outcome]:
    """Count a result once; the dataset's conf decides what counts (count, keep, budget_counts).

    ``lengths``: each request's completion tokens when the result took several (regenerate:
    all), so the length statistics stay per request. ``discard``: the reason the guard or a
    quality gate refused the answer (it goes to out/<ds>.discarded.jsonl: DISCARDED); with
    ``retry`` the prompt is sent again instead of ending there (RETRY: its ticket is given back).
    """
    several = ",".join(str(n) for n in lengths) if lengths is not None and len(lengths) > 1 else ""
    args: list[Any] = [keys.HIST_BINS, keys.RATE_BUCKET_S, keys.RATE_KEEP_S,
                       job_id, prompt_tokens, completion_tokens, row_json, finish_reason, several,
                       discard or "", "1" if discard and retry else ""]
    return ScriptCall("commit", [*keys.budget_keys(ds), keys.discards_key(ds), keys.retried_key(ds)], args,
                      lambda r: Outcome(text(r[0])), shared=3)


def release(ds: str, job_id: str, generated: int = 0, member: str | None = None) -> ScriptCall[Release]:
    """Give a reservation back; ``generated`` tokens made for nothing are counted as waste.

    With ``member`` (the caller's started-registry entry), only while the caller still holds
    the job; NOT_OURS if it does not (its lease ran out and the job was requeued).
    """
    def parse(r: Any) -> Release:
        return Release(Released(text(r[0])), int(r[1]))

    if member is None:
        return ScriptCall("release", keys.budget_keys(ds), [job_id, generated], parse)
    return ScriptCall("release", [*keys.budget_keys(ds), keys.rq_wip_key(ds)], [job_id, generated, member], parse)


def adjust(ds: str, tokens_by_job: dict[str, int]) -> ScriptCall[int]:
    args: list[Any] = []
    for job_id, tokens in tokens_by_job.items():
        args += [job_id, tokens]
    return ScriptCall("adjust", keys.budget_keys(ds), args, int)


def withdraw(ds: str) -> ScriptCall[int]:
    return ScriptCall("withdraw", keys.budget_keys(ds), [], int)


def adopt(ds: str, rows: list[tuple[str, int, int]]) -> ScriptCall[tuple[int, int]]:
    """Mark (job id, counted or -1 truncated / -2 discarded (not counted), completion) rows on disk as done."""
    args: list[Any] = []
    for job_id, counted, completion in rows:
        args += [job_id, counted, completion]
    return ScriptCall("adopt", keys.budget_keys(ds), args, lambda r: (int(r[0]), int(r[1])))


def quality_json(ds: DatasetConfig) -> str:
    """The dataset's guard, gates and retry_discarded as workers read them (conf ``quality``):
    a worker's own config need not list the datasets it serves."""
    return json.dumps({"guard": ds.guard.model_dump(mode="json"), "gates": ds.gates.model_dump(mode="json"),
                       "retry_discarded": ds.retry_discarded}, sort_keys=True)


def register_dataset(client: redis.Redis, ds: DatasetConfig, keep_limit: bool = False) -> int | None:
    """Write a dataset's budget settings; keeps counters (a restarted producer continues).

    The config's budget is applied when it is new or differs from the one last applied; a
    restart with the same config keeps a budget an operator set live (``budgetq budget set``),
    as the deadline and the total are kept. Returns that live budget when it was kept, else None.

    ``keep_limit`` (a run with a deadline or a total, and a dataset without a budget): the limit
    is the producer's budget loop's to set (producer/run/budget_loop.py); it is written only if absent.
    """
    kept = None
    pipe = client.pipeline()
    pipe.sadd(keys.DATASETS, ds.name)
    conf: dict[Any, Any] = {
        Conf.MODE: ds.mode, Conf.COUNT: ds.count, Conf.KEEP: ds.keep, Conf.BUDGET_COUNTS: ds.budget_counts,
        Conf.QUALITY: quality_json(ds),
        Conf.PRIOR_MEAN: ds.prior_mean, Conf.MAX_TOKENS: ds.max_tokens, Conf.END_MARGIN_Z: ds.end_margin_z,
        Conf.REGISTERED_AT: f"{time.time():.3f}",
    }
    if keep_limit or ds.budget is None:
        pipe.hsetnx(keys.conf_key(ds.name), Conf.LIMIT, ds.budget if ds.budget is not None else 0)
    else:
        limit, applied = client.hmget(keys.conf_key(ds.name), [Conf.LIMIT, Conf.CFG_LIMIT])
        if limit is not None and applied is not None and int(applied) == ds.budget and int(limit) != ds.budget:
            kept = int(limit)  # set live since this config value was applied: the operator's word stands
        else:
            conf[Conf.LIMIT] = ds.budget
        conf[Conf.CFG_LIMIT] = ds.budget
    if ds.budget is not None:
        conf[Conf.OWN_BUDGET] = kept if kept is not None else ds.budget
    else:
        pipe.hdel(keys.conf_key(ds.name), Conf.OWN_BUDGET)
    pipe.hset(keys.conf_key(ds.name), mapping=conf)
    pipe.hsetnx(keys.conf_key(ds.name), Conf.PAUSED, "0")
    pipe.hdel(keys.conf_key(ds.name), Conf.SOURCE_ENDED, Conf.INTERRUPTED)  # this producer reads the rows again
    pipe.execute()
    return kept


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
    abort_epoch: int = 0
    count: str = "completion"
    keep: str = "all"
    prior_mean: int = 0
    registered_at: float | None = None
    hold: str = ""   # the producer's hold (output disk full); paused is also true while it is set
    operator_paused: bool = False  # `budgetq pause` alone (paused without the hold), for status
    source_ended: bool = False  # the producer has read every row
    interrupted: bool = False   # the producer was stopped on request before the dataset ended
    own_budget: int | None = None  # the config's budget of this dataset (a deadline or total moves ``limit``)
    budget_counts: str = "kept"    # kept | spent: what ``used`` counts (commit.lua)
    quality: str = ""              # the worker's guard and gates, JSON (``quality_json``); "" = defaults

    @property
    def exhausted(self) -> bool:
        """True once no new request for this dataset can be admitted by the budget."""
        if self.mode == "strict":
            return self.used + self.max_tokens > self.limit
        return self.used >= self.limit

    @property
    def own_budget_reached(self) -> bool:
        """Its own budget (the config's), not a limit a deadline or total set, stops admissions."""
        if self.own_budget is None:
            return False
        if self.mode == "strict":
            return self.used + self.max_tokens > self.own_budget
        return self.used >= self.own_budget


def queue_state_commands(pipe: redis.client.Pipeline | aredis.client.Pipeline, name: str) -> None:
    pipe.hgetall(keys.conf_key(name))
    pipe.get(keys.used_key(name))
    pipe.get(keys.reserved_key(name))
    pipe.hlen(keys.resv_key(name))
    pipe.hgetall(keys.stats_key(name))


def parse_state(name: str, replies: list[Any]) -> DatasetState:
    conf, used, reserved, in_flight, stats = replies
    conf = {text(k): text(v) for k, v in conf.items()}
    stats_i = {text(k): int(float(v)) for k, v in stats.items()}
    return DatasetState(
        name=name, limit=int(conf.get(Conf.LIMIT, 0)), mode=conf.get(Conf.MODE, "soft"),
        paused=conf.get(Conf.PAUSED) == "1" or bool(conf.get(Conf.HOLD)),  # held: as paused for workers
        used=int(used or 0), reserved=int(reserved or 0),
        in_flight=int(in_flight), max_tokens=int(conf.get(Conf.MAX_TOKENS, 0)), stats=stats_i,
        abort_epoch=int(conf.get(Conf.ABORT_EPOCH, 0)), count=conf.get(Conf.COUNT, "completion"),
        keep=conf.get(Conf.KEEP, "all"), prior_mean=int(float(conf.get(Conf.PRIOR_MEAN, 0))),
        registered_at=float(conf[Conf.REGISTERED_AT]) if conf.get(Conf.REGISTERED_AT) else None,
        hold=conf.get(Conf.HOLD, ""),
        operator_paused=conf.get(Conf.PAUSED) == "1",
        source_ended=conf.get(Conf.SOURCE_ENDED) == "1",
        interrupted=conf.get(Conf.INTERRUPTED) == "1",
        own_budget=int(conf[Conf.OWN_BUDGET]) if conf.get(Conf.OWN_BUDGET) else None,
        budget_counts=conf.get(Conf.BUDGET_COUNTS, "kept"), quality=conf.get(Conf.QUALITY, ""),
    )


STATE_REPLIES = 5  # replies queue_state_commands adds to a pipeline


def dataset_state(client: redis.Redis, name: str) -> DatasetState:
    pipe = client.pipeline(transaction=False)
    queue_state_commands(pipe, name)
    return parse_state(name, pipe.execute())
