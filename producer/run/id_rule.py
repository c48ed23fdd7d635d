"""Where a dataset's prompt ids come from, kept the same for the whole life of its state.

Ids are what make a run restart-safe: the done set, the job ids and the rows on disk are keyed
on them, so a producer that derived ids another way would see every prompt as new and generate
it again. ``settle_id_field`` decides the rule (a field name, or None for content hashes) once:

1. recorded in the dataset's conf hash (field ``id_field``, JSON), written by the first producer
   of this version with HSETNX; else in out/<ds>.meta.json (``source.fields.id_field``, which
   every version records as the rule its rows were made with): that rule.
2. else, if Redis holds state of the dataset (an earlier version that recorded nothing): with
   the default ``id_field: id``, the rule its state shows. Earlier versions hashed rows unless a
   config named a field, so both candidate job ids of the first rows are looked up (done set,
   job hashes) and the rule with more hits wins; none: the config's rule.
3. else (a new dataset): the config's rule (producer/reading/reader.py ``dataset_id_field``).

The default ``id`` accepts a recorded content-hash rule (what earlier versions did with the
setting left out: the state stays valid, a log line says so). Any other configured rule that
differs from the recorded one is refused in one line: it would give every prompt a new id. The
settled rule is written onto ``ds.id_field``, so the reader, meta.json and every later step see it.
"""

from __future__ import annotations

import json
import logging
from itertools import islice
from pathlib import Path

import redis

from budgetq.producer.reading.reader import DEFAULT_ID_FIELD, dataset_id_field, row_id
from budgetq.producer.reading.source_rows import SourceRow
from budgetq.producer.reading.sources import detect_format, iter_rows
from budgetq.producer.run.meta import meta_path
from budgetq.producer.run.migrate import has_state
from budgetq.shared import keys
from budgetq.shared.config import DatasetConfig
from budgetq.shared.errors import ConfigError
from budgetq.shared.identity import ID_FIELD_FIELD, IdError, PromptId, job_id, legacy_job_id
from budgetq.shared.redis_conn import text

log = logging.getLogger("budgetq.producer")
_UNSET = object()
EVIDENCE_ROWS = 200   # first rows (file order) whose candidate job ids are looked up in Redis


def _show(rule: str | None) -> str:
    return "content hashes (id_field: null)" if rule is None else f"field {rule!r} (id_field: {rule})"


def recorded_in_meta(out_dir: Path, ds: str) -> str | None | object:
    """``source.fields.id_field`` last in force in out/<ds>.meta.json, or _UNSET if there is none."""
    try:
        record = json.loads(meta_path(out_dir, ds).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return _UNSET   # no record (or one meta.py itself refuses with a clear message)
    fields = (record.get("source") or {}).get("fields") if isinstance(record, dict) else None
    if not isinstance(fields, dict) or "id_field" not in fields:
        return _UNSET
    rule = fields["id_field"]
    for run in record.get("resumed") or []:   # changes recorded by later runs, in order
        change = ((run or {}).get("changed") or {}).get("source.fields")
        if isinstance(change, dict) and isinstance(change.get("to"), dict) and "id_field" in change["to"]:
            rule = change["to"]["id_field"]
    return rule if rule is None or isinstance(rule, str) else _UNSET


def _hits(conn: redis.Redis, ds: str, pids: list[PromptId]) -> int:
    """How many of these prompt ids Redis knows (done set or job hash, new or old job-id scheme)."""
    if not pids:
        return 0
    jids = [j for p in pids for j in (job_id(ds, p), legacy_job_id(ds, p))]
    pipe = conn.pipeline(transaction=False)
    pipe.smismember(keys.done_key(ds), jids)
    for j in jids:
        pipe.exists(keys.rq_job_key(j))
    done, *exists = pipe.execute()
    return sum(1 for d, e in zip(done, exists, strict=True) if d or e)


def rule_in_state(conn: redis.Redis, ds: DatasetConfig) -> str | None | object:
    """``id`` or None (hashes), whichever the first rows' job ids in Redis show; _UNSET: neither."""
    rows = iter_rows(ds.model_copy(update={"shuffle": False}), detect_format(ds))
    hashed = ds.model_copy(update={"id_field": None})
    by_field: list[PromptId] = []
    by_hash: list[PromptId] = []
    try:
        for item in islice((i for i in rows if isinstance(i, SourceRow)), EVIDENCE_ROWS):
            by_hash.append(row_id(hashed, item.data))
            try:
                by_field.append(row_id(ds, item.data))
            except IdError:
                pass
    finally:
        rows.close()
    field_hits, hash_hits = _hits(conn, ds.name, by_field), _hits(conn, ds.name, by_hash)
    if field_hits == hash_hits == 0:
        return _UNSET
    return DEFAULT_ID_FIELD if field_hits > hash_hits else None


def settle_id_field(conn: redis.Redis, ds: DatasetConfig, out_dir: Path, record: bool = True) -> str | None:
    """Decide (or recall) where ``ds``'s ids come from, record it (unless ``record`` is False: the
    producer records it with ``record_id_field`` once nothing can refuse the run), set ``ds.id_field``;
    see above."""
    configured = ds.id_field
    raw = conn.hget(keys.conf_key(ds.name), ID_FIELD_FIELD)
    recorded: str | None | object = json.loads(text(raw)) if raw is not None else recorded_in_meta(out_dir, ds.name)
    if recorded is _UNSET and configured == DEFAULT_ID_FIELD and has_state(conn, ds.name):
        recorded = rule_in_state(conn, ds)
    if recorded is _UNSET:
        rule = dataset_id_field(ds)
    else:
        rule = recorded if isinstance(recorded, str) else None
        if configured != rule and not (configured == DEFAULT_ID_FIELD and rule is None):
            raise ConfigError(
                f"dataset {ds.name}: its rows and Redis state were made with ids from {_show(rule)}; id_field: "
                f"{configured if configured is not None else 'null'} would give every prompt a new id and generate "
                f"it again: set id_field: {rule if rule is not None else 'null'}, or start the dataset afresh "
                "(another output_dir and Redis database)")
        if rule == DEFAULT_ID_FIELD and dataset_id_field(ds) != rule:
            raise ConfigError(f"dataset {ds.name}: its state was made with ids from field 'id', but the first "
                              f"row of {ds.path} has no 'id' now")
        if rule is None and configured == DEFAULT_ID_FIELD and dataset_id_field(ds) == DEFAULT_ID_FIELD:
            log.info("dataset %s: its state was made with content-hash ids (what earlier versions did without "
                     "id_field); keeping them so nothing runs twice (set id_field: null to say so)", ds.name)
    ds.id_field = rule
    if record:
        record_id_field(conn, ds)
    return rule


def record_id_field(conn: redis.Redis, ds: DatasetConfig) -> None:
    """Keep the rule ``settle_id_field`` set on ``ds`` in the dataset's state (the first one stays)."""
    conn.hsetnx(keys.conf_key(ds.name), ID_FIELD_FIELD, json.dumps(ds.id_field))
