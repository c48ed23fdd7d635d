"""Typed calls of the scripts that move RQ jobs: claim (queue -> started) and requeue.

They write RQ's own layout (queue list, started registry ``rq:wip:<queue>`` with
``<job>:<execution>`` members, job hash status fields), so rq-dashboard and the ``rq``
tooling see the truth; tests check the result through RQ's own API.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from rq.utils import utcformat

from shared import keys
from shared.scripts import ScriptCall


@dataclass(frozen=True)
class Claimed:
    job_id: str
    execution_id: str
    raw: dict[bytes, bytes]  # the RQ job hash, as HGETALL returns it

    @property
    def member(self) -> str:
        return f"{self.job_id}:{self.execution_id}"


def _claimed(reply: list[Any]) -> list[Claimed]:
    out = []
    for job_id, exec_id, flat in reply:
        raw = {flat[i]: flat[i + 1] for i in range(0, len(flat), 2)}
        out.append(Claimed(job_id.decode(), exec_id.decode(), raw))
    return out


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
