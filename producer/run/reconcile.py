"""Rebuild a dataset's counters and done set from the output files (after Redis lost data).

The output files are the truth the producer owns: every row in out/<ds>.jsonl was counted
once. ``adopt_missing`` (run by every producer at start) marks rows on disk that Redis
forgot as done, so they are never generated again, and adds their tokens (adopt.lua: a
prompt already in the done set is left alone, so it never counts twice). ``reconcile``
also compares the counters with the files and, with ``rebuild``, sets them to what the
files say, reporting every difference it found.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import redis

from budgetq.producer.run.collector import output_paths
from budgetq.producer.run.migrate import id_scheme
from budgetq.shared import budget, keys
from budgetq.shared.config import Config, DatasetConfig
from budgetq.shared.errors import BudgetqError
from budgetq.shared.identity import SCHEME_MIGRATED, job_id, legacy_job_id
from budgetq.shared.redis_conn import stream_entries, text
from budgetq.shared.scripts import run

log = logging.getLogger("budgetq.reconcile")
BATCH = 500


# adopt.lua's markers for a row that ends its prompt without counting.
TRUNCATED, DISCARDED = -1, -2


def _final(row: dict, kind: str) -> bool:
    """Whether the row ends its prompt: every row does but a discarded attempt that was sent again."""
    return kind != "discarded" or not (isinstance(row.get("discard"), dict) and row["discard"].get("retried"))


def _counted(ds: DatasetConfig, row: dict, kind: str) -> int:
    if kind == "truncated":
        return TRUNCATED  # kept aside: done, not counted
    if kind == "discarded":
        return DISCARDED  # refused by the guard or a gate: done, not counted
    completion = int(row.get("completion_tokens", 0))
    return completion + int(row.get("prompt_tokens", 0)) if ds.count == "total" else completion


def rows_on_disk(out_dir: Path, ds: DatasetConfig) -> Iterator[tuple[str, int, int]]:
    """(prompt id, counted or TRUNCATED / DISCARDED, completion tokens) for every readable row of the
    dataset's output files that ends its prompt (a discarded attempt sent again does not: left out).
    Rows first, so a prompt with a row is a row whatever else the files hold."""
    for kind, path in output_paths(out_dir, ds.name).items():
        if not path.exists():
            continue
        with open(path, encoding="utf-8") as fh:
            for line_no, line in enumerate(fh, start=1):
                try:
                    row = json.loads(line)
                    if _final(row, kind):
                        yield str(row["id"]), _counted(ds, row, kind), int(row["completion_tokens"])
                except (ValueError, KeyError, TypeError) as exc:
                    log.warning("%s:%d: unreadable row skipped: %s", path, line_no, exc)


def _rows_in_stream(conn: redis.Redis, ds: DatasetConfig) -> Iterator[tuple[str, int, int]]:
    cursor = text(conn.get(keys.cursor_key(ds.name)) or b"0-0")
    for _eid, fields in stream_entries(conn.xrange(keys.results_key(ds.name), min=f"({cursor}")):
        row = json.loads(fields[b"row"])
        kind = fields.get(b"kind", b"row").decode()
        if not _final(row, kind):
            continue
        yield str(row["id"]), _counted(ds, row, kind), int(row["completion_tokens"])


def adopt_missing(conn: redis.Redis, rows: Iterator[tuple[str, int, int]], ds: str,
                  legacy: bool = False) -> tuple[int, int]:
    """Adopt (prompt id, counted, completion) rows whose job id is not in the done set (nor,
    with ``legacy``, their old-scheme job id); returns (adopted, tokens added)."""
    adopted = added = 0
    batch: list[tuple[str, int, int]] = []

    def flush() -> None:
        nonlocal adopted, added
        ids = [job_id(ds, b[0]) for b in batch]
        present = conn.smismember(keys.done_key(ds), ids)
        if legacy:
            old = conn.smismember(keys.done_key(ds), [legacy_job_id(ds, b[0]) for b in batch])
            present = [p or o for p, o in zip(present, old, strict=True)]
        missing = [(j, c, n) for j, (_pid, c, n), p in zip(ids, batch, present, strict=True) if not p]
        if missing:
            a, t = run(conn, budget.adopt(ds, missing))
            adopted += a
            added += t
        batch.clear()

    for r in rows:
        batch.append(r)
        if len(batch) >= BATCH:
            flush()
    if batch:
        flush()
    return adopted, added


@dataclass
class Report:
    dataset: str
    rows_on_disk: int
    rows_in_stream: int
    done_before: int
    used_before: int
    used_expected: int
    adopted: int
    tokens_added: int
    stale_done: int
    used_after: int
    rebuilt: bool

    def as_dict(self) -> dict:
        return asdict(self)


def reconcile(conn: redis.Redis, cfg: Config, ds: DatasetConfig, rebuild: bool = False,
              force: bool = False) -> Report:
    in_flight = conn.hlen(keys.resv_key(ds.name))
    if in_flight and not force:
        raise BudgetqError(f"dataset {ds.name}: {in_flight} requests are in flight; pause it and let them finish "
                           f"(or pass --force: counts may then be off by what commits meanwhile)")
    if not conn.sismember(keys.DATASETS, ds.name):
        budget.register_dataset(conn, ds)
    used_before = int(conn.get(keys.used_key(ds.name)) or 0)
    done_before = conn.scard(keys.done_key(ds.name))
    disk: dict[str, tuple[int, int]] = {}
    for j, c, n in rows_on_disk(cfg.output_dir, ds):
        disk.setdefault(j, (c, n))   # the first file's: a row before a discarded line of the same prompt
    stream: dict[str, tuple[int, int]] = {}
    for j, c, n in _rows_in_stream(conn, ds):
        if j not in disk:
            stream.setdefault(j, (c, n))
    everything = {**disk, **stream}
    expected = sum(c for c, _n in everything.values() if c >= 0)
    legacy = id_scheme(conn, ds.name) == SCHEME_MIGRATED
    adopted, added = adopt_missing(conn, ((j, c, n) for j, (c, n) in everything.items()), ds.name, legacy)
    known = {job_id(ds.name, pid) for pid in everything}
    if legacy:
        known |= {legacy_job_id(ds.name, pid) for pid in everything}
    stale = [m.decode() for m in conn.sscan_iter(keys.done_key(ds.name), count=1000)
             if m.decode() not in known]
    if rebuild:
        pipe = conn.pipeline()
        if stale:
            pipe.srem(keys.done_key(ds.name), *stale)
        pipe.set(keys.used_key(ds.name), expected)
        pipe.hset(keys.stats_key(ds.name), mapping={
            "committed": sum(1 for c, _n in everything.values() if c >= 0),
            "truncated": sum(1 for c, _n in everything.values() if c == TRUNCATED),
            "discarded": sum(1 for c, _n in everything.values() if c == DISCARDED),
            "sum_tokens": expected, "sum_completion": sum(n for _c, n in everything.values())})
        pipe.execute()
    used_after = int(conn.get(keys.used_key(ds.name)) or 0)
    report = Report(ds.name, len(disk), len(stream), done_before, used_before, expected, adopted, added,
                    len(stale), used_after, rebuild)
    if adopted or stale or used_after != expected:
        log.warning("dataset %s: reconcile found differences: %s", ds.name, report.as_dict())
    return report

