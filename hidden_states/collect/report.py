"""What a features pass reports: per dataset counts, failed jobs (with the last line of their error), what
stopped it. ``FeaturesPass`` (features_pass.py) fills it; ``budgetq features`` and produce's capture print it."""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from typing import cast

import redis

from budgetq.shared import keys
from budgetq.shared.identity import job_id
from budgetq.shared.redis_conn import text


@dataclass
class Report:
    datasets: dict[str, dict] = field(default_factory=dict)
    stopped_by: str | None = None
    failed: dict[str, list[str]] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.stopped_by is None and not any(self.failed.values())


def failures(conn: redis.Redis, ds: str, lost: list[str], why: dict[str, str] | None = None) -> list[str]:
    """'<job id>: <last line of the error>' for the dataset's failed features jobs not on disk, then the
    ``lost`` ids (enqueued again and still not captured): ``why[id]`` where the pass knows it (a worker's shard
    it could not adopt), else Redis lost the job."""
    name = keys.features_name(ds)
    out = []
    for member in cast(list[bytes], conn.zrange(f"rq:failed:{keys.queue_name(name)}", 0, -1)):
        jid = text(member)
        status, exc = cast(list[bytes | None], conn.hmget(keys.rq_job_key(jid), ["status", "exc_info"]))
        if status != b"failed":
            continue  # enqueued again since
        try:
            exc = zlib.decompress(exc or b"")
        except zlib.error:
            pass
        lines = (exc or b"").decode(errors="replace").strip().splitlines()
        out.append(f"{jid}: {lines[-1] if lines else 'failed'}")
    out += [f"{job_id(name, pid)}: {(why or {}).get(pid, 'lost by Redis')}, not captured" for pid in lost]
    return out
