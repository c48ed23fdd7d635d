"""Move committed results from Redis streams into out/<dataset>.jsonl, never twice.

Rows kept aside (keep=complete and cut by max_tokens) go to out/<dataset>.truncated.jsonl; answers
the guard or a quality gate discarded to out/<dataset>.discarded.jsonl, each with its ``discard``
(reason, details, token counts). A prompt sent again (retry_discarded) has one discarded row per
refused attempt, told apart by ``discard.key``, and may still end as a row of the dataset.
The stream cursor is saved only after the rows are flushed and fsynced; if the producer
dies in between, the ids already in the files are loaded at start and skipped. A torn last
line (a crash mid-write) is cut off at start: its entry is still in the stream. A write that
fails (disk full, read-only) is cut back at once and raises; the entries stay in the stream
until a later write takes them (producer/run/disk_guard.py decides when to try again).
"""

from __future__ import annotations

import errno
import json
import logging
import os
from pathlib import Path

import redis

from budgetq.producer.run.run_report import Reservoir
from budgetq.shared import keys
from budgetq.shared.redis_conn import StreamEntries, stream_entries, text

log = logging.getLogger("budgetq.collector")
KINDS = {"row": "{ds}.jsonl", "truncated": "{ds}.truncated.jsonl", "discarded": "{ds}.discarded.jsonl"}
# Kinds whose rows end a prompt: one row per prompt id across their files (a discarded attempt does not).
ENDING = ("row", "truncated")


def output_paths(out_dir: Path, ds: str) -> dict[str, Path]:
    return {kind: out_dir / pattern.format(ds=ds) for kind, pattern in KINDS.items()}


def _cut_torn_tail(path: Path) -> None:
    if not path.exists() or path.stat().st_size == 0:
        return
    with open(path, "rb+") as fh:
        fh.seek(-1, os.SEEK_END)
        if fh.read(1) == b"\n":
            return
        size = fh.seek(0, os.SEEK_END)
        step = min(size, 1 << 16)
        pos = size
        while pos > 0:  # find the last newline, reading backwards
            pos = max(0, pos - step)
            fh.seek(pos)
            chunk = fh.read(min(step, size - pos))
            at = chunk.rfind(b"\n")
            if at >= 0:
                fh.truncate(pos + at + 1)
                break
        else:
            fh.truncate(0)
    log.warning("%s: cut a torn last line (the producer died mid-write); its row is collected again", path)


def discard_key(obj: dict) -> str:
    """What tells one discarded attempt from another (worker/discard.py ``discard_row``)."""
    key = obj.get("discard", {}).get("key") if isinstance(obj.get("discard"), dict) else None
    return str(key) if key else f"{obj['id']}#discarded"


def ids_in(path: Path, discarded: bool = False) -> set[str]:
    ids: set[str] = set()
    if path.exists():
        with open(path, encoding="utf-8") as fh:
            for line in fh:
                try:
                    obj = json.loads(line)
                    ids.add(discard_key(obj) if discarded else obj["id"])
                except (ValueError, KeyError, TypeError, AttributeError):
                    continue
    return ids


class Collector:
    def __init__(self, conn: redis.Redis, out_dir: Path, datasets: list[str]) -> None:
        self.conn = conn
        out_dir.mkdir(parents=True, exist_ok=True)
        self.paths = {ds: output_paths(out_dir, ds) for ds in datasets}
        self.seen: dict[str, set[str]] = {}
        self.seen_discarded: dict[str, set[str]] = {}   # discard keys: one row per discarded attempt
        for ds, paths in self.paths.items():
            self.seen[ds] = set()
            for kind, path in paths.items():
                _cut_torn_tail(path)
                if kind in ENDING:
                    self.seen[ds] |= ids_in(path)
            self.seen_discarded[ds] = ids_in(paths["discarded"], discarded=True)
        self.written = {ds: 0 for ds in datasets}
        self.discarded = {ds: 0 for ds in datasets}   # discarded rows written this run
        self.cut_kept = {ds: 0 for ds in datasets}   # rows written this run with finish_reason "length"
        # Request latencies (each row's latency_s) of the rows written this run: the end-of-run block.
        self.latency = {ds: Reservoir() for ds in datasets}
        self.latency_all = Reservoir(seed=1)
        self.torn: Path | None = None   # a failed write that could not be cut back (see _truncate)

    def drain(self, count: int = 1000) -> int:
        """Write every waiting result; returns how many rows were written."""
        total = 0
        for ds, paths in self.paths.items():
            while True:
                cursor = text(self.conn.get(keys.cursor_key(ds)) or b"0-0")
                entries = stream_entries(self.conn.xrange(keys.results_key(ds), min=f"({cursor}", count=count))
                if not entries:
                    break
                total += self._write(ds, paths, entries)
                last = entries[-1][0].decode()
                ms, seq = last.split("-")
                pipe = self.conn.pipeline()
                pipe.set(keys.cursor_key(ds), last)
                # Everything up to the cursor is on disk: one XTRIM (entries below the next id)
                # frees whole stream nodes, where XDEL of each id marked them one by one.
                pipe.xtrim(keys.results_key(ds), minid=f"{ms}-{int(seq) + 1}", approximate=False)
                pipe.execute()
                if len(entries) < count:  # the stream held no more: no second look
                    break
        return total

    def _write(self, ds: str, paths: dict[str, Path], entries: StreamEntries) -> int:
        """Append the batch's new rows and fsync them, or leave every file as it was.

        A write that fails (disk full, read-only, permission) cuts each file back to its size
        before the batch and forgets the batch's ids, then raises: the cursor has not moved, so
        the same entries are written again once the disk takes them.
        """
        if self.torn is not None:
            raise OSError(errno.EIO, "a failed write could not be cut back: restart the producer (it cuts the "
                          "torn tail, and writes the rows again)", str(self.torn))
        chunks: dict[str, list[str]] = {}
        added: list[str] = []
        added_discarded: list[str] = []
        latencies: list[float] = []
        cut = 0
        for _eid, fields in entries:
            row = fields[b"row"].decode()
            obj = json.loads(row)
            pid = obj["id"]
            kind = fields.get(b"kind", b"row").decode()
            if kind == "discarded":
                key = discard_key(obj)
                if key not in self.seen_discarded[ds]:
                    chunks.setdefault(kind, []).append(row + "\n")
                    self.seen_discarded[ds].add(key)
                    added_discarded.append(key)
                continue
            if pid in self.seen[ds]:
                continue
            if kind == "row" and obj.get("finish_reason") == "length":
                cut += 1   # keep=all: a cut answer in the training rows (summary says so)
            chunks.setdefault(kind, []).append(row + "\n")
            if isinstance(lat := obj.get("latency_s"), int | float) and not isinstance(lat, bool):
                latencies.append(float(lat))
            self.seen[ds].add(pid)
            added.append(pid)
        started: dict[Path, int] = {}
        path = paths["row"]
        try:
            for kind, lines in chunks.items():
                path = paths.get(kind, paths["row"])
                with open(path, "ab") as fh:
                    started.setdefault(path, os.fstat(fh.fileno()).st_size)
                    fh.write("".join(lines).encode("utf-8"))
                    fh.flush()
                    os.fsync(fh.fileno())
        except OSError as exc:
            self.seen[ds].difference_update(added)
            self.seen_discarded[ds].difference_update(added_discarded)
            for done, size in started.items():
                self._truncate(done, size)
            raise OSError(exc.errno, exc.strerror, str(path)) from exc  # a write's error names no file
        self.cut_kept[ds] += cut
        for lat in latencies:  # counted once the rows are on disk (a failed write is tried again)
            self.latency[ds].add(lat)
            self.latency_all.add(lat)
        self.written[ds] += len(added)
        self.discarded[ds] += len(added_discarded)
        return len(added) + len(added_discarded)

    def _truncate(self, path: Path, size: int) -> None:
        """Cut ``path`` back to ``size`` bytes (needs no free space). If even that fails, a torn
        tail may be left: no more writes this run (the next start cuts it, _cut_torn_tail)."""
        try:
            os.truncate(path, size)
        except OSError as exc:
            self.torn = path
            log.error("%s: could not cut back a failed write (%s); restart the producer once the volume "
                      "is writable: it cuts the torn tail and writes the rows again", path, exc.strerror)

    def rows(self, ds: str) -> int:
        return len(self.seen[ds])
