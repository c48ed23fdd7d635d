"""Typed calls of the scripts that move RQ jobs: claim (queue -> started), requeue, finish.

They write RQ's own layout (queue list, started registry ``rq:wip:<queue>`` with
``<job>:<execution>`` members, job hash status fields, finished / failed / canceled
registries, result streams ``rq:results:<job>``), so rq-dashboard and the ``rq`` tooling
see the truth; tests/test_rq_layout.py checks every step through RQ's own API. Doing this in
Lua instead of through RQ's Job objects is what lets one worker process handle over a
thousand prompts a second (bench/orchestration.py).
"""

from __future__ import annotations

import json
import uuid
import zlib
from base64 import b64encode
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from rq.utils import utcformat

from shared import keys
from shared.scripts import ScriptCall

RESULT_TTL_S = 500             # finished jobs, like RQ's default
KEEP_S = 7 * 86400             # failed and skipped jobs: retry-failed / a raised budget requeue them
# RQ names each registry after the status of the jobs in it: rq:<status>:<queue>.
ENDINGS = ("finished", "failed", "canceled")


@dataclass(frozen=True)
class Claimed:
    job_id: str
    execution_id: str
    data: bytes  # RQ's job data: zlib-compressed JSON [function, instance, args, kwargs]

    @property
    def member(self) -> str:
        return f"{self.job_id}:{self.execution_id}"

    def payload(self) -> Any:
        """The job's first argument (budgetq's payload dict)."""
        _func, _instance, args, _kwargs = json.loads(zlib.decompress(self.data))
        return args[0]


def _claimed(reply: list[Any]) -> list[Claimed]:
    return [Claimed(job_id.decode(), exec_id.decode(), data or b"") for job_id, exec_id, data in reply]


def claim(ds: str, count: int, lease_end: float, worker_name: str) -> ScriptCall[list[Claimed]]:
    prefix = uuid.uuid4().hex[:20]
    return ScriptCall("claim", [keys.rq_queue_key(ds), keys.rq_wip_key(ds)],
                      [count, f"{lease_end:.3f}", prefix, utcformat(datetime.now(UTC)), worker_name], _claimed)


def requeue(ds: str, member: str, job_id: str, reason: str = "requeued",
            only_if_expired_before: float | None = None) -> ScriptCall[bool]:
    """Put a started job back at the front of its queue and release its reservation."""
    return ScriptCall(
        "requeue",
        [keys.rq_wip_key(ds), keys.rq_queue_key(ds), keys.rq_job_key(job_id), keys.resv_key(ds),
         keys.reserved_key(ds), keys.stats_key(ds)],
        [member, job_id, reason, "" if only_if_expired_before is None else f"{only_if_expired_before:.3f}"],
        lambda r: bool(int(r)))


def finish(ds: str, c: Claimed, status: str, started_at: float, worker_name: str, *,
           result: dict | None = None, error: str = "", skipped: str = "", stat: str = "") -> ScriptCall[bool]:
    """Record a job's end (status finished, failed or canceled); False if we no longer hold it."""
    if status not in ENDINGS:
        raise ValueError(f"not a job ending: {status!r} (one of {', '.join(ENDINGS)})")
    now = datetime.now(UTC)
    ttl = RESULT_TTL_S if status == "finished" else KEEP_S
    queue = keys.queue_name(ds)
    result_type = {"finished": 1, "failed": 2}.get(status, 0)
    return ScriptCall(
        "finish",
        [keys.rq_wip_key(ds), keys.rq_job_key(c.job_id), f"rq:{status}:{queue}",
         f"rq:results:{c.job_id}", keys.stats_key(ds)],
        [c.member, c.job_id, status, utcformat(now), f"{now.timestamp() + ttl:.3f}", ttl, result_type,
         b64encode(json.dumps(result).encode()).decode() if result is not None else "",
         b64encode(zlib.compress(error.encode())).decode() if error else "",
         worker_name, c.execution_id, f"{started_at:.6f}", f"{now.timestamp():.6f}",
         zlib.compress(error.encode()) if error else "",
         json.dumps({"skipped": skipped}) if skipped else "", stat],
        lambda r: bool(int(r)))
