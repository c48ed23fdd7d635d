"""Whether a producer is running: it refreshes one key with a TTL while it runs and deletes it when
it ends. A producer killed without the chance to say so (SIGKILL, the OOM killer, a lost host)
leaves the key to expire, and `budgetq status` then shows its unfinished datasets as
``interrupted`` (shared/ends.py) instead of ``running`` with an ETA that nothing works toward.
"""

from __future__ import annotations

import json
import os
import socket
import time
from typing import Any

import redis

from budgetq.shared import keys

TTL_S = 15    # gone this long after its last refresh: longer than any tick, short for an operator
BEAT_S = 2.0  # refreshed at most this often (a tick can be every 20 ms)


class Presence:
    """The running producer's key: ``beat`` from every tick, ``leave`` when it ends."""

    def __init__(self, conn: redis.Redis) -> None:
        self.conn = conn
        self.me = {"host": socket.gethostname(), "pid": os.getpid(), "started_at": round(time.time(), 3)}
        self._beat_at = -BEAT_S

    def others(self) -> dict[str, Any] | None:
        """Another producer's key, if one may be running (two producers of one run race each other);
        not one of this host whose process is gone (a producer killed moments ago, restarted)."""
        other = read(self.conn)
        if other is None or other == self.me:
            return None
        if other.get("host") == self.me["host"] and isinstance(other.get("pid"), int):
            try:
                os.kill(other["pid"], 0)
            except ProcessLookupError:
                return None
            except OSError:  # alive, another user's
                pass
        return other

    def beat(self) -> None:
        if time.monotonic() - self._beat_at >= BEAT_S:
            self.conn.set(keys.PRODUCER, json.dumps(self.me), ex=TTL_S)
            self._beat_at = time.monotonic()

    def leave(self) -> None:
        if read(self.conn) == self.me:  # not another producer's, started since
            self.conn.delete(keys.PRODUCER)


def read(conn: redis.Redis) -> dict[str, Any] | None:
    """The running producer (host, pid, started_at), or None when none is."""
    raw = conn.get(keys.PRODUCER)
    try:
        value = json.loads(raw) if raw else None
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def absent_line(producer: dict[str, Any] | None, datasets: list[dict[str, Any]]) -> str | None:
    """The line `budgetq status` and the monitor show while no producer runs and datasets of the
    run stopped before their end (stopped on request, or killed); None otherwise."""
    stopped = [d["dataset"] for d in datasets if d["stop"] == "interrupted"]
    if producer is not None or not stopped:
        return None
    return f"no producer is running: {', '.join(stopped)} stopped before the end; `budgetq produce` continues the run"
