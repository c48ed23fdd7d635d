"""out/<dataset>.meta.json: how a dataset's rows were generated, recorded once, checked on resume.

The first run writes the record. A later run compares its own settings with it and returns one
warning per changed field; the original record is never overwritten, each run is appended to
its ``resumed`` list instead, with what it changed. The API key is never recorded.
"""

from __future__ import annotations

import datetime as dt
import json
import os
from importlib import metadata
from pathlib import Path
from typing import Any

from budgetq.shared.config import Config, DatasetConfig
from budgetq.shared.errors import ConfigError
from budgetq.shared.server_kind import SGLANG_MODEL

# The fields that decide what a generated row looks like: a change means rows of one file
# were generated in two different ways.
WATCHED = ("model", "server.urls", "server.api", "tokenizer", "chat_template_kwargs", "thinking", "count",
           "keep", "mode", "source.path", "source.format", "source.split", "source.subset", "source.fields",
           "system_prompt")


def _version() -> str:
    try:
        return metadata.version("budgetq")
    except metadata.PackageNotFoundError:
        return "unknown"


def meta_path(out_dir: Path, ds: str) -> Path:
    return Path(out_dir) / f"{ds}.meta.json"


def current(cfg: Config, ds: DatasetConfig) -> dict[str, Any]:
    """What this run would record for ``ds`` (without the timestamps)."""
    return {
        "dataset": ds.name,
        "sampling": ds.sampling.model_dump(mode="json"),
        # unset: "default", as recorded before it could be unset (rows say which model each server was asked for)
        "model": cfg.server.model or SGLANG_MODEL,
        "server": {"urls": list(cfg.server.urls), "api": cfg.server.api},
        "tokenizer": cfg.server.tokenizer,
        "chat_template_kwargs": ds.chat_template_kwargs,
        "thinking": ds.thinking,
        "count": ds.count,
        "keep": ds.keep,
        "mode": ds.mode,
        "system_prompt": ds.system_prompt,
        "regenerate": ds.regenerate,
        "source": {"path": ds.path, "format": ds.format, "split": ds.split, "subset": ds.subset,
                   "fields": {"prompt_field": ds.prompt_field, "messages_field": ds.messages_field,
                              "conversations_field": ds.conversations_field, "id_field": ds.id_field}},
    }


def _get(record: dict[str, Any], dotted: str) -> Any:
    value: Any = record
    for part in dotted.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return value


def _changes(old: dict[str, Any], new: dict[str, Any]) -> dict[str, dict[str, Any]]:
    fields = [f"sampling.{k}" for k in sorted(set(old.get("sampling") or {}) | set(new["sampling"]))]
    changed = {}
    for f in [*fields, *WATCHED]:
        before, after = _get(old, f), _get(new, f)
        if before != after:
            changed[f] = {"from": before, "to": after}
    return changed


def _write(path: Path, record: dict[str, Any]) -> None:
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(record, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    os.replace(tmp, path)  # a crash leaves the old record or the new one, never half of one


def _show(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False) if not isinstance(value, str | int | float) else str(value)


def check_and_write_meta(cfg: Config, ds: DatasetConfig, out_dir: Path) -> list[str]:
    """Record ``ds``'s generation settings the first time; later, return one warning per change."""
    path = meta_path(out_dir, ds.name)
    path.parent.mkdir(parents=True, exist_ok=True)
    now = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
    new = current(cfg, ds)
    if not path.exists():
        _write(path, {**new, "created_at": now, "budgetq_version": _version(), "resumed": []})
        return []
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(record, dict):
            raise ValueError(f"top level is a {type(record).__name__}, not an object")
    except ValueError as exc:
        raise ConfigError(f"dataset {ds.name}: {path} is not a budgetq meta record ({exc}); "
                          "fix it or move it away to start a new record") from exc
    # Compare with the settings in force last time (the original plus every recorded change).
    latest = json.loads(json.dumps(record))
    for run in record.get("resumed") or []:
        for field, change in (run.get("changed") or {}).items():
            _set(latest, field, change.get("to"))
    changed = _changes(latest, new)
    record.setdefault("resumed", []).append({"at": now, "budgetq_version": _version(), "changed": changed})
    _write(path, record)
    rows = Path(out_dir) / f"{ds.name}.jsonl"
    return [f"dataset {ds.name}: {f} changed from {_show(c['from'])} to {_show(c['to'])} since {path} was written "
            f"(created {record.get('created_at', '?')}, last run recorded there); rows already in {rows} were "
            f"generated with {_show(c['from'])}" for f, c in changed.items()]


def _set(record: dict[str, Any], dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    for part in parts[:-1]:
        nxt = record.get(part)
        if not isinstance(nxt, dict):
            nxt = record[part] = {}
        record = nxt
    record[parts[-1]] = value
