"""Where a dataset's prompt ids come from, kept the same for the whole life of its state.

Ids are what make a run restart-safe: the done set, the job ids and the rows on disk are keyed
on them, so a second producer that derived ids another way would see every prompt as new and
generate it again. ``settle_id_field`` decides the rule once and keeps it:

1. recorded in the dataset's conf hash (field ``id_field``, JSON: a field name or null for content
   hashes): that rule. Written by the first producer of this version, with HSETNX.
2. else recorded in out/<ds>.meta.json (every version writes ``source.fields.id_field`` there,
   the rule in force when the rows were made): that rule.
3. else, if Redis holds state of the dataset (an earlier version that recorded nothing): the
   rule that version applied, ``id_field`` when the config sets it, else content hashes (its
   default). The config's own default (the ``id`` field when the dataset has one) would change
   every id, so it is not applied to such a dataset, and a log line says so.
4. else (a new dataset): the config's rule (producer/reader.py ``dataset_id_field``).

A config that explicitly sets ``id_field`` to something else than the recorded rule is refused
with one line: it would give every prompt a new id. The settled rule is written onto
``ds.id_field``, so the reader, meta.json and every later step see it.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import redis

from producer.meta import meta_path
from producer.migrate import has_state
from producer.reader import dataset_id_field
from shared import keys
from shared.config import DatasetConfig
from shared.errors import ConfigError
from shared.identity import ID_FIELD_FIELD
from shared.redis_conn import text

log = logging.getLogger("budgetq.producer")
_UNSET = object()


def _show(rule: str | None) -> str:
    return "content hashes (id_field: null)" if rule is None else f"field {rule!r} (id_field: {rule})"


def recorded_in_meta(out_dir: Path, ds: str) -> str | None | object:
    """``source.fields.id_field`` last in force in out/<ds>.meta.json, or _UNSET if there is none."""
    path = meta_path(out_dir, ds)
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return _UNSET   # no record (or one meta.py itself will refuse with a clear message)
    fields = (record.get("source") or {}).get("fields") if isinstance(record, dict) else None
    if not isinstance(fields, dict) or "id_field" not in fields:
        return _UNSET
    rule = fields["id_field"]
    for run in record.get("resumed") or []:   # changes recorded by later runs, in order
        change = ((run or {}).get("changed") or {}).get("source.fields")
        if isinstance(change, dict) and isinstance(change.get("to"), dict) and "id_field" in change["to"]:
            rule = change["to"]["id_field"]
    return rule if rule is None or isinstance(rule, str) else _UNSET


def settle_id_field(conn: redis.Redis, ds: DatasetConfig, out_dir: Path) -> str | None:
    """Decide (or recall) where ``ds``'s ids come from, record it, set ``ds.id_field``; see above."""
    explicit = "id_field" in ds.model_fields_set
    raw = conn.hget(keys.conf_key(ds.name), ID_FIELD_FIELD)
    recorded: str | None | object = json.loads(text(raw)) if raw is not None else recorded_in_meta(out_dir, ds.name)
    if recorded is not _UNSET:
        rule = recorded if isinstance(recorded, str) else None
        if explicit and ds.id_field != rule:
            raise ConfigError(
                f"dataset {ds.name}: its rows and Redis state were made with ids from {_show(rule)}; "
                f"id_field: {ds.id_field if ds.id_field is not None else 'null'} would give every prompt a new id "
                f"and generate it again: set id_field: {rule if rule is not None else 'null'}, or start the dataset "
                "afresh (another output_dir and Redis database)")
    elif has_state(conn, ds.name):
        rule = ds.id_field if explicit else None
        if not explicit and dataset_id_field(ds) is not None:
            log.warning("dataset %s: Redis holds state an earlier version made with content-hash ids; keeping "
                        "them so nothing runs twice (its rows have an 'id' field, which new datasets use by "
                        "default; set id_field: null to silence this)", ds.name)
    else:
        rule = dataset_id_field(ds)
    conn.hsetnx(keys.conf_key(ds.name), ID_FIELD_FIELD, json.dumps(rule))
    ds.id_field = rule
    return rule
