"""Move committed results from Redis streams into out/<dataset>.jsonl, never twice.

The stream cursor is saved only after the rows are flushed and fsynced; if the producer
dies in between, the ids already in the file are loaded at start and skipped.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import redis

from shared import keys


class Collector:
    def __init__(self, conn: redis.Redis, out_dir: Path, datasets: list[str]) -> None:
        self.conn = conn
        out_dir.mkdir(parents=True, exist_ok=True)
        self.paths = {ds: out_dir / f"{ds}.jsonl" for ds in datasets}
        self.seen: dict[str, set[str]] = {ds: self._ids_in(p) for ds, p in self.paths.items()}
        self.written = {ds: 0 for ds in datasets}

    @staticmethod
    def _ids_in(path: Path) -> set[str]:
        ids: set[str] = set()
        if path.exists():
            with open(path, encoding="utf-8") as fh:
                for line in fh:
                    try:
                        ids.add(json.loads(line)["id"])
                    except (ValueError, KeyError, TypeError):
                        continue  # a torn last line from a crash; its row is re-collected
        return ids

    def drain(self, count: int = 1000) -> int:
        """Write every waiting result; returns how many rows were written."""
        total = 0
        for ds, path in self.paths.items():
            while True:
                cursor = (self.conn.get(keys.cursor_key(ds)) or b"0-0").decode()
                entries = self.conn.xrange(keys.results_key(ds), min=f"({cursor}", count=count)
                if not entries:
                    break
                with open(path, "a", encoding="utf-8") as fh:
                    for _eid, fields in entries:
                        pid_row = json.loads(fields[b"row"])
                        if pid_row["id"] in self.seen[ds]:
                            continue
                        fh.write(fields[b"row"].decode() + "\n")
                        self.seen[ds].add(pid_row["id"])
                        self.written[ds] += 1
                        total += 1
                    fh.flush()
                    os.fsync(fh.fileno())
                last = entries[-1][0].decode()
                pipe = self.conn.pipeline()
                pipe.set(keys.cursor_key(ds), last)
                pipe.xdel(keys.results_key(ds), *[e[0] for e in entries])
                pipe.execute()
        return total

    def rows(self, ds: str) -> int:
        return len(self.seen[ds])
