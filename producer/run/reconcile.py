"""Rebuild a dataset's counters and done set from the output files (after Redis lost data).

The output files are the truth the producer owns: every row in out/<ds>.jsonl was counted
once. ``adopt_missing`` (run by every producer at start) marks rows on disk that Redis
forgot as done, so they are never generated again, and adds their tokens (adopt.lua: a
prompt already in the done set is left alone, so it never counts twice). ``reconcile``
also compares the counters with the files, reporting every difference it found, and sets
``used`` to what the files say (and, with ``rebuild``, the stats and the done set too). The
difference is applied as an increment, in a MULTI that fails and is tried again if a commit or
the collector changed anything meanwhile (WATCH), so it is exact even while a run goes on.
Without the files (the wrong host or output_dir) it refuses rather than set ``used`` to no rows.

Why ``used`` can differ from the files with every id adopted: a Sentinel failover (or a machine
crash with AOF's ``everysec``) loses the last commits the old master acknowledged, after the
collector had written their rows. Their jobs run again; a re-run counts its own length (an
engine samples: another length), and the collector, which writes a prompt once, keeps the row
already on disk. ``used`` then follows the re-run, the file the first run. An id with two rows
on disk (the collector never writes one; a file joined by hand) counts by its first row.
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


_STATS = ("committed", "truncated", "discarded", "sum_tokens", "sum_completion")
# Tries at a consistent read before giving up: each is undone by a commit or a collector write meanwhile.
SETTLE_TRIES = 5


def _first_rows(cfg: Config, ds: DatasetConfig) -> Iterator[tuple[str, int, int]]:
    """The rows on disk, the first of each id only: the one that counts (the collector writes a prompt once)."""
    seen: set[str] = set()
    for j, c, n in rows_on_disk(cfg.output_dir, ds):
        if j not in seen:
            seen.add(j)
            yield j, c, n


def _rows_in_stream(conn: redis.Redis, ds: DatasetConfig) -> Iterator[tuple[str, int, int]]:
    """The results committed but not yet written by the collector (after its cursor)."""
    cursor = text(conn.get(keys.cursor_key(ds.name)) or b"0-0")
    for _eid, fields in stream_entries(conn.xrange(keys.results_key(ds.name), min=f"({cursor}")):
        row = json.loads(fields[b"row"])
        kind = fields.get(b"kind", b"row").decode()
        if not _final(row, kind):
            continue
        yield str(row["id"]), _counted(ds, row, kind), int(row["completion_tokens"])


def _counters(conn: redis.Redis, ds: DatasetConfig) -> dict[str, int]:
    used, stats = conn.get(keys.used_key(ds.name)), conn.hmget(keys.stats_key(ds.name), list(_STATS))
    return {"used": int(used or 0), **{k: int(v or 0) for k, v in zip(_STATS, stats, strict=True)}}


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
                           f"(or pass --force: it then reads again while commits change the counters)")
    paths = output_paths(cfg.output_dir, ds.name)
    if not rebuild and conn.exists(keys.cursor_key(ds.name)) and not any(p.exists() for p in paths.values()):
        # The collector has written rows (its cursor moved), yet there is no file: the wrong host or directory.
        # Setting `used` to the rows found (none) would reopen the budget; --rebuild does it on purpose.
        raise BudgetqError(f"dataset {ds.name}: no output file {paths['row']}, yet the producer has written rows of "
                           f"it: run reconcile where the producer writes them, or pass --output-dir")
    if not conn.sismember(keys.DATASETS, ds.name):
        budget.register_dataset(conn, ds)
    done_before = conn.scard(keys.done_key(ds.name))
    used_before = int(conn.get(keys.used_key(ds.name)) or 0)
    legacy = id_scheme(conn, ds.name) == SCHEME_MIGRATED
    adopted, added = adopt_missing(conn, _first_rows(cfg, ds), ds.name, legacy)
    watched = [keys.used_key(ds.name), keys.stats_key(ds.name), keys.done_key(ds.name), keys.cursor_key(ds.name)]
    for attempt in range(1, SETTLE_TRIES + 1):
        # The counters, the stream and the files are read under WATCH and corrected in one MULTI: a commit
        # (done, used, stats and its result, one script) or a collector write (file, then cursor) meanwhile
        # aborts the correction and it is read again. Without it, a commit between the read of `used` and
        # that of the files, collected in between, would be counted twice (read in the files, and already
        # in `used`), or one collected between the files and the stream would be missed.
        with conn.pipeline() as pipe:
            try:
                pipe.watch(*watched)
                have = _counters(conn, ds)
                disk = {j: (c, n) for j, c, n in _first_rows(cfg, ds)}
                stream: dict[str, tuple[int, int]] = {}
                for j, c, n in _rows_in_stream(conn, ds):
                    if j not in disk:
                        stream.setdefault(j, (c, n))  # the first: a row before a discarded line of the same prompt
                everything = {**disk, **stream}
                expected = sum(c for c, _n in everything.values() if c >= 0)
                want = {"used": expected, "committed": sum(1 for c, _n in everything.values() if c >= 0),
                        "truncated": sum(1 for c, _n in everything.values() if c == TRUNCATED),
                        "discarded": sum(1 for c, _n in everything.values() if c == DISCARDED), "sum_tokens": expected,
                        "sum_completion": sum(n for _c, n in everything.values())}
                # `used` always follows the files (it is what admissions read): after a commit that a failover
                # lost and whose job then ran again with another length, the re-run counted its own tokens
                # while the collector kept the row already on disk (a prompt is written once). The stats
                # with --rebuild only.
                corrected = {k: want[k] - have[k] for k in (want if rebuild else ("used",)) if want[k] != have[k]}
                known = {job_id(ds.name, pid) for pid in everything}
                if legacy:
                    known |= {legacy_job_id(ds.name, pid) for pid in everything}
                stale = [m.decode() for m in conn.sscan_iter(keys.done_key(ds.name), count=1000)
                         if m.decode() not in known]
                pipe.multi()
                if rebuild and stale:
                    pipe.srem(keys.done_key(ds.name), *stale)
                for k, by in corrected.items():
                    if k == "used":
                        pipe.incrby(keys.used_key(ds.name), by)
                    else:
                        pipe.hincrby(keys.stats_key(ds.name), k, by)
                pipe.execute()
                break
            except redis.WatchError:
                if attempt == SETTLE_TRIES:
                    raise BudgetqError(f"dataset {ds.name}: its counters or results changed during each of "
                                       f"{SETTLE_TRIES} reads; pause it (budgetq pause {ds.name}), let its "
                                       f"requests finish and run reconcile again") from None
                log.info("dataset %s: a commit or the collector changed the counters meanwhile; reading again",
                         ds.name)
    used_after = int(conn.get(keys.used_key(ds.name)) or 0)
    report = Report(ds.name, len(disk), len(stream), done_before, used_before, expected, adopted, added,
                    len(stale), used_after, rebuild)
    if adopted or stale or used_after != expected:
        log.warning("dataset %s: reconcile found differences: %s", ds.name, report.as_dict())
    return report

