"""Typed calls of the scripts that move RQ jobs: claim (queue -> started), requeue, finish.

They write RQ's own layout (queue list, started registry ``rq:wip:<queue>`` with
``<job>:<execution>`` members, job hash status fields, finished / failed / canceled
registries, result streams ``rq:results:<job>``), so rq-dashboard and the ``rq`` tooling
see the truth; tests/test_rq_layout.py checks every step through RQ's own API. Doing this in
Lua instead of through RQ's Job objects is what lets one worker process handle over a
thousand prompts a second (bench/orchestration.py).
"""

from __future__ import annotations

import enum
import json
import uuid
import zlib
from base64 import b64encode
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, TypeVar

import redis
from redis.client import Pipeline
from rq import Queue
from rq.job import Job, JobStatus
from rq.queue import EnqueueData
from rq.registry import BaseRegistry
from rq.serializers import JSONSerializer
from rq.utils import now as rq_now
from rq.utils import utcformat

from budgetq.shared import keys
from budgetq.shared.scripts import ScriptCall, run
from budgetq.shared.stats import ENDING_STATS, REOPEN_STATS, REQUEUE_STATS, Stat

# The one definition of how long RQ keeps ended jobs; the producer enqueues with them too
# (Queue.prepare_data's result_ttl / failure_ttl), finish.lua gets them in ARGV.
RESULT_TTL_S = 500             # finished jobs, like RQ's default
KEEP_S = 7 * 86400             # failed and skipped jobs: retry-failed / a raised budget requeue them

RESULT_STREAM_MAXLEN = 10     # entries of a job's result stream, like RQ's Result.save

RegistryT = TypeVar("RegistryT", bound=BaseRegistry)


def registry(kind: type[RegistryT], ds: str, conn: redis.Redis) -> RegistryT:
    """RQ's registry ``kind`` (FailedJobRegistry, CanceledJobRegistry, ...) of a dataset's queue,
    with the JSON serializer our jobs are written with: the one place these are built."""
    return kind(keys.queue_name(ds), connection=conn, serializer=JSONSerializer)


class Ending(enum.StrEnum):
    """How a job ends, as RQ's job status (and the registry it goes to: rq:<status>:<queue>).

    QUEUED is the end of one attempt, not of the job: aborted in flight, it goes back to the
    front of its queue (requeue.lua) and runs again once admitted, so nothing aborted is lost.
    """

    FINISHED = JobStatus.FINISHED.value
    FAILED = JobStatus.FAILED.value
    CANCELED = JobStatus.CANCELED.value
    QUEUED = JobStatus.QUEUED.value


class Skip(enum.StrEnum):
    """Why a job was not run to a row: EXHAUSTED is skipped (RQ status canceled, its meta
    ``skipped`` field); the others are aborts, requeued (``JobEnd.skip``)."""

    EXHAUSTED = "budget exhausted"
    WITHDRAWN = "admission withdrawn before the result arrived"
    ABORTED_BUDGET = "aborted in flight: budget"
    ABORTED_WITHDRAWN = "aborted in flight: withdrawn"

    @property
    def aborted(self) -> bool:
        return self is not Skip.EXHAUSTED


class ResultStatus(enum.StrEnum):
    """The ``status`` of a finished job's return value (what RQ shows as its result)."""

    COMMITTED = "committed"
    CROSSED = "crossed"
    TRUNCATED = "truncated"
    DUPLICATE = "duplicate_result"
    ALREADY_DONE = "already_done"


@dataclass(frozen=True)
class JobEnd:
    """Everything finish.lua records about one job's end; built by the constructors below."""

    ending: Ending
    result: dict[str, Any] | None = None
    error: str = ""
    skipped: Skip | None = None
    stat: Stat | None = None
    # Ends as committed (a row, truncated, discarded, a duplicate or already done): finish.lua
    # checks that the done set has it, and requeues it if a failover lost the commit.
    committed: bool = False

    @property
    def outcome(self) -> str:
        """The word the worker's exit log counts it under."""
        if self.ending is Ending.QUEUED:
            return Stat.ABORTED.value
        return str((self.result or {}).get("status", self.ending))

    @classmethod
    def done(cls, status: ResultStatus, completion_tokens: int | None = None) -> JobEnd:
        result: dict[str, Any] = {"status": status.value}
        if completion_tokens is not None:
            result["completion_tokens"] = completion_tokens
        return cls(Ending.FINISHED, result, stat=Stat.ALREADY_DONE if status is ResultStatus.ALREADY_DONE else None,
                   committed=True)

    @classmethod
    def failed(cls, error: str) -> JobEnd:
        return cls(Ending.FAILED, error=error, stat=Stat.FAILED)

    @classmethod
    def skip(cls, reason: Skip) -> JobEnd:
        """EXHAUSTED: skipped (canceled registry, requeued by ``reopen`` once the budget admits it
        again). An abort (cancelled at the server, or its result refused because its admission
        was withdrawn: budget crossed or lowered, pause --abort-in-flight): back on the queue,
        counted aborted, so every withdrawn admission is one abort and no prompt is lost."""
        if reason.aborted:
            return cls(Ending.QUEUED, skipped=reason, stat=Stat.ABORTED)
        return cls(Ending.CANCELED, skipped=reason, stat=Stat.SKIPPED)


@dataclass(frozen=True)
class Claimed:
    job_id: str
    execution_id: str
    data: bytes  # RQ's job data: zlib-compressed JSON [function, instance, args, kwargs]
    result_ttl: int | None = None  # the job's own (RQ's result_ttl field); None: RQ's default

    @property
    def member(self) -> str:
        return f"{self.job_id}:{self.execution_id}"

    def payload(self) -> Any:
        """The job's first argument (budgetq's payload dict)."""
        _func, _instance, args, _kwargs = json.loads(zlib.decompress(self.data))
        return args[0]


class LeanQueue(Queue):
    """RQ's Queue, whose ``enqueue_many`` writes RQ's own layout in fewer Redis commands.

    The job hash is RQ's (``Job.to_dict``, status queued included, without the fields that are
    '' on a new job), the queue list and the queue set are RQ's; what goes is RQ's extra ``HSET
    status`` per job before the save that writes it again, and its ``RPUSH`` per job (one
    ``RPUSH`` for the batch).
    Every command is Redis CPU spent per prompt (bench/ceiling.py). Anything else than plain
    jobs in a caller's pipeline (dependencies, at_front, repeat, a group) is RQ's own path.
    tests/test_enqueue_layout.py compares the two.
    """

    def enqueue_many(self, job_datas: Iterable[EnqueueData], pipeline: Pipeline | None = None,
                     group_id: str | None = None) -> list[Job]:
        items = list(job_datas)
        if (pipeline is None or group_id is not None or not items
                or any(d.depends_on or d.at_front or d.repeat for d in items)):
            return super().enqueue_many(items, pipeline=pipeline, group_id=group_id)
        if len({d.job_id for d in items}) < len(items):
            raise ValueError("a job id appears more than once in enqueue_many()")  # as RQ's
        version = self.get_redis_server_version()
        out: list[Job] = []
        for d in items:
            job = self.create_job(d.func, args=d.args, kwargs=d.kwargs, timeout=d.timeout, result_ttl=d.result_ttl,
                                  ttl=d.ttl, failure_ttl=d.failure_ttl, description=d.description, job_id=d.job_id,
                                  meta=d.meta, status=JobStatus.QUEUED, retry=d.retry, on_success=d.on_success,
                                  on_failure=d.on_failure, on_stopped=d.on_stopped, webhooks=d.webhooks)
            # What Queue._prepare_for_queue sets before RQ saves a job it enqueues.
            job.redis_server_version = version
            job.origin = self.name
            job.enqueued_at = rq_now()
            # RQ's Job.save writes every field of Job.to_dict, eight of them '' on a new job
            # (started_at, ended_at, worker_name, callbacks, ...); RQ reads an absent field as
            # it reads '' (Job.restore), so they are left out: 9 fields instead of 17 to create
            # here and to free when the job goes (Redis CPU per prompt: bench/ceiling.py).
            pipeline.hset(job.key, mapping={k: v for k, v in job.to_dict().items() if v != ""})
            job.cleanup(ttl=job.ttl, pipeline=pipeline)  # an expiring job (ttl): EXPIREs, as RQ
            out.append(job)
        pipeline.sadd(self.redis_queues_keys, self.key)
        pipeline.rpush(self.key, *[job.id for job in out])
        return out


def _ttl(raw: Any) -> int | None:
    try:
        return int(raw) if raw else None
    except ValueError:  # not RQ's: RQ's default applies
        return None


def _claimed(reply: list[Any]) -> list[Claimed]:
    return [Claimed(job_id.decode(), exec_id.decode(), data or b"", _ttl(ttl)) for job_id, exec_id, data, ttl in reply]


def claim(ds: str, count: int, lease_end: float, worker_name: str) -> ScriptCall[list[Claimed]]:
    prefix = uuid.uuid4().hex[:20]
    return ScriptCall("claim", [keys.rq_queue_key(ds), keys.rq_wip_key(ds)],
                      [count, f"{lease_end:.3f}", prefix, utcformat(datetime.now(UTC)), worker_name,
                       keys.RQ_JOB_PREFIX, JobStatus.STARTED.value], _claimed)


def requeue(ds: str, member: str, job_id: str, reason: Stat = Stat.REQUEUED,
            only_if_expired_before: float | None = None) -> ScriptCall[bool]:
    """Put a started job back at the front of its queue and release its reservation."""
    if reason not in REQUEUE_STATS:
        raise ValueError(f"not a requeue counter: {reason!r}")
    return ScriptCall(
        "requeue",
        [keys.rq_wip_key(ds), keys.rq_queue_key(ds), keys.rq_job_key(job_id), keys.resv_key(ds),
         keys.reserved_key(ds), keys.stats_key(ds), keys.done_key(ds)],
        [member, job_id, reason.value, "" if only_if_expired_before is None else f"{only_if_expired_before:.3f}",
         JobStatus.QUEUED.value],
        lambda r: bool(int(r)))


# finish.lua's registries, in the order of its KEYS 2, 3, 4
_REGISTRIES = (Ending.FINISHED, Ending.FAILED, Ending.CANCELED)


def result_ttl(c: Claimed, ending: Ending) -> int:
    """How long RQ keeps this job once ended (RQ's ``Job.get_result_ttl`` / failure_ttl): a
    finished job its own result_ttl (0: deleted at once; none, or RQ's negative "never expire",
    which budgetq never enqueues: RESULT_TTL_S); the others KEEP_S."""
    if ending is not Ending.FINISHED:
        return KEEP_S
    return c.result_ttl if c.result_ttl is not None and c.result_ttl >= 0 else RESULT_TTL_S


REOPEN_BATCH = 1000  # jobs reopen.lua moves per call: one call blocks Redis for about a millisecond


def reopen(ds: str, registry_key: str, reason: Stat, batch: int = REOPEN_BATCH) -> ScriptCall[tuple[int, int, int]]:
    """Move up to ``batch`` jobs of a dataset's canceled or failed registry back to its queue;
    (moved, vanished, left in the registry). ``reopen_all`` loops it."""
    if reason not in REOPEN_STATS:
        raise ValueError(f"not a reopen counter: {reason!r}")
    return ScriptCall("reopen", [registry_key, keys.rq_queue_key(ds), keys.stats_key(ds)],
                      [keys.RQ_JOB_PREFIX, JobStatus.QUEUED.value, reason.value, batch,
                       utcformat(datetime.now(UTC))],
                      lambda r: (int(r[0]), int(r[1]), int(r[2])))


def reopen_all(conn: redis.Redis, ds: str, ending: Ending, reason: Stat) -> tuple[int, int]:
    """Every job of the dataset's ``ending`` registry (CANCELED or FAILED) back on its queue, a
    batch at a time (each job moves atomically); returns (moved, vanished)."""
    moved = vanished = 0
    while True:
        m, v, left = run(conn, reopen(ds, keys.rq_registry_key(ds, ending), reason))
        moved, vanished = moved + m, vanished + v
        if not left or not (m or v):
            return moved, vanished


class Finished(enum.IntEnum):
    """What finish.lua did with a job's end."""

    NOT_OURS = 0    # we no longer hold the job (its lease ran out; its new holder records it)
    RECORDED = 1
    LOST_COMMIT = 2  # it ended as committed, but this Redis has no commit (a failover lost it): requeued


def finish(ds: str, c: Claimed, end: JobEnd, started_at: float, worker_name: str) -> ScriptCall[Finished]:
    """Record a job's end in RQ's layout and count it. An abort (``Ending.QUEUED``) is
    requeue.lua's: the job goes back to the front of its queue."""
    if end.ending is Ending.QUEUED:
        call = requeue(ds, c.member, c.job_id, Stat.ABORTED)
        return ScriptCall(call.script, call.keys, call.args,
                          lambda r: Finished.RECORDED if call.parse(r) else Finished.NOT_OURS, call.shared)
    if end.stat is not None and end.stat not in ENDING_STATS:
        raise ValueError(f"not an ending counter: {end.stat!r}")
    now = datetime.now(UTC)
    ttl = result_ttl(c, end.ending)
    result_type = {Ending.FINISHED: 1, Ending.FAILED: 2}.get(end.ending, 0)
    error = end.error
    return ScriptCall(
        "finish",
        [keys.rq_wip_key(ds), *(keys.rq_registry_key(ds, e) for e in _REGISTRIES), keys.stats_key(ds),
         keys.done_key(ds), keys.rq_queue_key(ds), keys.resv_key(ds), keys.reserved_key(ds)],
        [keys.RQ_JOB_PREFIX, keys.RQ_RESULTS_PREFIX, worker_name, RESULT_STREAM_MAXLEN, JobStatus.QUEUED.value,
         # the item: this job's end
         c.member, c.job_id, end.ending.value, 2 + _REGISTRIES.index(end.ending), utcformat(now),
         f"{now.timestamp() + ttl:.3f}", ttl, result_type,
         b64encode(json.dumps(end.result).encode()).decode() if end.result is not None else "",
         b64encode(zlib.compress(error.encode())).decode() if error else "",
         c.execution_id, f"{started_at:.6f}", f"{now.timestamp():.6f}",
         zlib.compress(error.encode()) if error else "",
         json.dumps({"skipped": end.skipped.value}) if end.skipped else "",
         end.stat.value if end.stat else "", "1" if end.committed else ""],
        lambda r: Finished(int(r)), shared=5)
