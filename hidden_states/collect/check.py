"""``budgetq features --check``: rows <-> index <-> shards <-> the Redis done set agree (and ``--fix``)."""

from __future__ import annotations

from typing import cast

import redis

from budgetq.hidden_states.collect.inputs import committed_rows
from budgetq.hidden_states.store.shards import check_store, features_dir, features_root, index_rows
from budgetq.shared import keys
from budgetq.shared.config import Config
from budgetq.shared.redis_conn import text


def check(cfg: Config, conn: redis.Redis | None, names: list[str] | None = None) -> dict[str, list[str]]:
    """rows <-> index <-> shards (and the Redis done set when Redis is given), per dataset."""
    out: dict[str, list[str]] = {}
    for ds in [cfg.dataset(n) for n in names] if names else cfg.datasets:
        row_ids = {r.id for r in committed_rows(cfg.output_dir / f"{ds.name}.jsonl")}
        problems = check_store(features_root(cfg), ds.name, row_ids)
        if conn is not None:
            indexed = {r["id"] for r in index_rows(features_dir(features_root(cfg), ds.name) / "index.jsonl")}
            done = {text(m) for m in cast(set[bytes], conn.smembers(keys.features_done_key(ds.name)))}
            for pid in sorted(done - indexed)[:20]:
                problems.append(f"redis {keys.features_done_key(ds.name)}: {pid!r} is marked done but not on disk "
                                "(`budgetq features` re-captures it after `budgetq features --check --fix`)")
        out[ds.name] = problems
    return out


def fix_done_set(cfg: Config, conn: redis.Redis, names: list[str] | None = None) -> int:
    """Make the Redis done set exactly the ids on disk; returns how many entries changed."""
    changed = 0
    for ds in [cfg.dataset(n) for n in names] if names else cfg.datasets:
        indexed = {r["id"] for r in index_rows(features_dir(features_root(cfg), ds.name) / "index.jsonl")}
        key = keys.features_done_key(ds.name)
        done = {text(m) for m in cast(set[bytes], conn.smembers(key))}
        extra, missing = sorted(done - indexed), sorted(indexed - done)
        if extra:
            conn.srem(key, *extra)
        if missing:
            conn.sadd(key, *missing)
        changed += len(extra) + len(missing)
    return changed

