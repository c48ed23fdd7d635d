"""``budgetq export``: out/<dataset>.jsonl -> Parquet or SpecForge JSONL, streamed (never the whole file).

Parquet: columns are ResultRow's fields; ``conversations`` is
list<struct<role, content, reasoning_content>>, the layout SpecForge (and
``datasets.load_dataset("parquet", ...)``) reads as chat turns. The dataset's meta record
(out/<dataset>.meta.json), when there is one, rides along in the file's key-value metadata
under ``budgetq.meta``.

SpecForge (``--format specforge``): ``<dataset>.specforge.jsonl`` holding only rows SpecForge
can train on as they are: complete answers (finish_reason "stop": a truncated one would be
taught an end-of-turn the model never produced) whose conversation passes SpecForge's
validator rules. Written to a .tmp file and renamed, so the file never has a torn line.

Either way a malformed line is reported with file and line and skipped; the rest is exported.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

import pyarrow as pa
import pyarrow.parquet as pq
from pydantic import ValidationError

from budgetq.producer.reading.conversations import specforge_problem
from budgetq.shared.json_kind import json_problem, kind
from budgetq.shared.schema import Message, ResultRow

log = logging.getLogger("budgetq.export")
BATCH_ROWS = 2048
MAX_REPORTED = 20   # malformed lines listed one by one; beyond that only counted

# As datasets writes list-of-dict columns; reasoning_content is null on every turn but a
# generated reply with thinking: separate.
TURN = pa.struct([("role", pa.string()), ("content", pa.string()), ("reasoning_content", pa.string())])
SCHEMA = pa.schema([
    pa.field("id", pa.string(), nullable=False),
    pa.field("dataset", pa.string(), nullable=False),
    pa.field("conversations", pa.list_(TURN), nullable=False),
    pa.field("status", pa.string(), nullable=False),
    pa.field("prompt_tokens", pa.int64(), nullable=False),
    pa.field("completion_tokens", pa.int64(), nullable=False),
    pa.field("finish_reason", pa.string(), nullable=False),
    pa.field("model", pa.string(), nullable=False),
    pa.field("endpoint", pa.string(), nullable=False),
    pa.field("latency_s", pa.float64(), nullable=False),
    # regenerate: all, several requests: each one's counts (null on a single-request row)
    pa.field("turns", pa.list_(pa.struct([("prompt_tokens", pa.int64()), ("completion_tokens", pa.int64()),
                                          ("finish_reason", pa.string())]))),
    # features.vllm.single_pass: the engine's file of the row's hidden states (null otherwise)
    pa.field("hidden_states_file", pa.string()),
    # samples: N: which answer of its prompt the row is (null with samples: 1; docs/datasets.md)
    pa.field("sample", pa.int64()),
])


@dataclass
class ExportResult:
    source: Path
    target: Path
    rows: int = 0
    malformed: int = 0
    reports: list[str] = field(default_factory=list)   # the first MAX_REPORTED malformed lines


def _error(exc: ValidationError) -> str:
    first = exc.errors()[0]
    loc = ".".join(str(p) for p in first["loc"]) or "(row)"
    more = f" (+{exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
    return f"{loc}: {first['msg']}{more}"


def _row(raw: bytes) -> ResultRow:
    """One JSONL line -> a ResultRow; ValueError says why it is not one."""
    try:
        obj = json.loads(raw.decode("utf-8").rstrip("\r\n"))
    except UnicodeDecodeError as exc:
        raise ValueError(f"not valid UTF-8 (byte {exc.start + 1})") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"bad JSON at column {exc.colno}: {json_problem(exc)}") from None
    if not isinstance(obj, dict):
        raise ValueError(f"row is {kind(obj)}, not a JSON object")
    # Rows written before reasoning moved onto the assistant message had it at the top level.
    old_reasoning = obj.pop("reasoning_content", None)
    try:
        row = ResultRow.model_validate(obj)
    except ValidationError as exc:
        raise ValueError(_error(exc)) from None
    if old_reasoning and row.conversations and row.reasoning is None:
        row.conversations[-1] = Message(**{**row.conversations[-1].model_dump(), "reasoning_content": old_reasoning})
    return row


def _parse(raw: bytes) -> dict:
    """One JSONL line -> a row in SCHEMA's layout; ValueError says why it is not one."""
    row = _row(raw)
    out = row.model_dump(include=set(SCHEMA.names))
    out["conversations"] = [{"role": m.role, "content": m.content,
                             "reasoning_content": getattr(m, "reasoning_content", None)} for m in row.conversations]
    return out


def export_parquet(source: Path, target: Path, meta: Path | None = None,
                   batch_rows: int = BATCH_ROWS) -> ExportResult:
    """Write ``source`` (a results JSONL) to ``target`` (Parquet), replacing it only when done."""
    res = ExportResult(Path(source), Path(target))
    schema = SCHEMA
    if meta is not None and meta.exists():
        schema = SCHEMA.with_metadata({b"budgetq.meta": meta.read_bytes()})
    res.target.parent.mkdir(parents=True, exist_ok=True)
    tmp = res.target.with_name(res.target.name + ".tmp")
    try:
        with open(res.source, "rb") as fh, pq.ParquetWriter(tmp, schema) as writer:
            _copy(fh, writer, schema, res, batch_rows)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, res.target)
    return res


def _malformed(res: ExportResult, line_no: int, exc: ValueError) -> None:
    """Count and report (the first MAX_REPORTED of) the lines an export skips."""
    res.malformed += 1
    msg = f"{res.source}:{line_no}: malformed row skipped: {exc}"
    log.warning(msg)
    if len(res.reports) < MAX_REPORTED:
        res.reports.append(msg)


def _copy(fh: BinaryIO, writer: pq.ParquetWriter, schema: pa.Schema, res: ExportResult, batch_rows: int) -> None:
    batch: list[dict] = []
    for line_no, raw in enumerate(fh, start=1):
        if not raw.strip():
            continue
        try:
            batch.append(_parse(raw))
        except ValueError as exc:
            _malformed(res, line_no, exc)
            continue
        if len(batch) >= batch_rows:
            writer.write_table(pa.Table.from_pylist(batch, schema=schema))
            res.rows += len(batch)
            batch.clear()
    if batch:
        writer.write_table(pa.Table.from_pylist(batch, schema=schema))
        res.rows += len(batch)


@dataclass
class SpecForgeResult(ExportResult):
    truncated: int = 0   # finish_reason other than "stop": left out
    rejected: int = 0    # conversation SpecForge's validator would reject: left out


def export_specforge(source: Path, target: Path) -> SpecForgeResult:
    """Write ``source``'s complete, valid rows to ``target`` (JSONL), replacing it only when done."""
    res = SpecForgeResult(Path(source), Path(target))
    res.target.parent.mkdir(parents=True, exist_ok=True)
    tmp = res.target.with_name(res.target.name + ".tmp")
    try:
        with open(res.source, "rb") as fh, open(tmp, "w", encoding="utf-8") as out:
            for line_no, raw in enumerate(fh, start=1):
                if raw.strip():
                    _one_specforge(raw, line_no, out, res)
            out.flush()
            os.fsync(out.fileno())   # the rename below must never expose a file shorter than it says
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, res.target)
    return res


def specforge_note(res: ExportResult) -> str:
    """What an export left out beyond malformed lines, for its one summary line."""
    if not isinstance(res, SpecForgeResult):
        return ""
    note = ""
    if res.truncated:
        note += (f"; {res.truncated} truncated row(s) left out (finish_reason not 'stop': SpecForge "
                 "would train an end-of-turn the model never produced)")
    if res.rejected:
        note += f"; {res.rejected} row(s) left out that SpecForge's validator rejects"
    return note


def _one_specforge(raw: bytes, line_no: int, out, res: SpecForgeResult) -> None:
    try:
        row = _row(raw)
    except ValueError as exc:
        _malformed(res, line_no, exc)
        return
    if row.finish_reason != "stop":
        res.truncated += 1
        return
    obj = row.model_dump(mode="json") | {"id": row.id}   # SpecForge's validator takes string ids only
    if (why := specforge_problem(obj)) is not None:
        res.rejected += 1
        if len(res.reports) < MAX_REPORTED:
            res.reports.append(f"{res.source}:{line_no}: left out, SpecForge would reject it: {why}")
        return
    out.write(json.dumps(obj, ensure_ascii=False) + "\n")
    res.rows += 1
