"""Stream a dataset file row by row (never the whole file in memory) into prompts or errors."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass

from shared.config import DatasetConfig
from shared.schema import Message, stable_id


@dataclass(frozen=True)
class Prompt:
    line: int
    id: str
    messages: list[Message]
    input_ids: list[int] | None = None
    prompt_tokens: int | None = None


@dataclass(frozen=True)
class Invalid:
    line: int
    reason: str


def _messages(ds: DatasetConfig, row: dict) -> list[Message]:
    msgs: list[Message] = []
    if ds.system_prompt:
        msgs.append(Message(role="system", content=ds.system_prompt))
    if ds.messages_field:
        raw = row.get(ds.messages_field)
        if not isinstance(raw, list) or not raw:
            raise ValueError(f"field {ds.messages_field!r} is missing or not a non-empty list")
        for i, m in enumerate(raw):
            if not isinstance(m, dict) or not isinstance(m.get("content"), str) or not m.get("role"):
                raise ValueError(f"{ds.messages_field}[{i}] needs string 'role' and 'content'")
            msgs.append(Message(role=str(m["role"]), content=m["content"]))
        return msgs
    field = ds.prompt_field or "prompt"
    if field not in row:
        raise ValueError(f"missing field {field!r}")
    prompt = row[field]
    if not isinstance(prompt, str):
        raise ValueError(f"field {field!r} is {type(prompt).__name__}, not a string")
    if not prompt.strip():
        raise ValueError(f"field {field!r} is empty")
    msgs.append(Message(role="user", content=prompt))
    return msgs


def read_jsonl(ds: DatasetConfig) -> Iterator[Prompt | Invalid]:
    with open(ds.path, encoding="utf-8") as fh:
        for line_no, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                yield Invalid(line_no, f"bad JSON: {exc.msg} at column {exc.colno}")
                continue
            if not isinstance(row, dict):
                yield Invalid(line_no, f"row is a {type(row).__name__}, not a JSON object")
                continue
            try:
                msgs = _messages(ds, row)
            except ValueError as exc:
                yield Invalid(line_no, str(exc))
                continue
            if ds.id_field:
                if row.get(ds.id_field) in (None, ""):
                    yield Invalid(line_no, f"missing id field {ds.id_field!r}")
                    continue
                pid = str(row[ds.id_field])
            else:
                pid = stable_id(row)
            yield Prompt(line_no, pid, msgs)


@dataclass(frozen=True)
class Filtered:
    line: int
    reason: str


def read_prompts(ds: DatasetConfig, server: object = None) -> Iterator[Prompt | Invalid | Filtered]:
    """The producer's one entry point for reading a dataset."""
    return read_jsonl(ds)
