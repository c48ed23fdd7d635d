"""The producer's one entry point to datasets: ``read_prompts(ds, server)``.

Streams a dataset (JSONL, JSON array, Parquet, HF; see producer/sources.py) row by row into
``Prompt`` (ready to enqueue), ``Invalid`` (bad row, with the reason) or ``Filtered`` (skipped
by the length filter, not an error). ``line`` is the 1-based line for JSONL and the 1-based
row index for the other formats (their reasons start with "row N").
"""

from __future__ import annotations

from collections.abc import Generator, Iterator
from dataclasses import dataclass

from producer.arrow_sources import plain
from producer.conversations import with_template_system
from producer.mapping import prompt_chars, row_to_messages
from producer.sources import SourceError, SourceItem, detect_format, iter_rows
from producer.tokenize import PromptEncoder
from shared.config import DatasetConfig, ServerConfig
from shared.schema import Message, stable_id


@dataclass(frozen=True)
class Prompt:
    line: int
    id: str
    messages: list[Message]
    # api=generate: the chat template applied locally; the server gets these ids.
    input_ids: list[int] | None = None
    # Known whenever a tokenizer is configured (generate, or chat with server.tokenizer).
    prompt_tokens: int | None = None


@dataclass(frozen=True)
class Invalid:
    line: int
    reason: str


@dataclass(frozen=True)
class Filtered:
    line: int
    reason: str


Item = Prompt | Invalid | Filtered


def read_prompts(ds: DatasetConfig, server: ServerConfig) -> Iterator[Item]:
    """Prompts of ``ds`` in file (or shuffled) order, at most ``ds.limit`` valid ones.

    Checks the source and loads the tokenizer now, so a wrong path or tokenizer fails here
    (ConfigError / FileNotFoundError naming it) rather than on the first ``next()``.
    """
    fmt = detect_format(ds)
    encoder = PromptEncoder.for_dataset(ds, server)
    return _prompts(ds, fmt, encoder)


def _prompts(ds: DatasetConfig, fmt: str, encoder: PromptEncoder | None) -> Generator[Item, None, None]:
    rows = iter_rows(ds, fmt)
    valid = 0
    try:
        for item in rows:
            out = _one(ds, item, encoder, "" if fmt == "jsonl" else f"row {item.line}: ")
            yield out
            if isinstance(out, Prompt):
                valid += 1
                if ds.limit is not None and valid >= ds.limit:
                    return
    finally:
        rows.close()  # releases files and the shuffle spill when the caller stops early


def _row_id(ds: DatasetConfig, row: dict) -> str | None:
    if ds.id_field:
        value = row.get(ds.id_field)
        return None if value in (None, "") else str(value)
    try:
        return stable_id(row)
    except (TypeError, ValueError):  # Arrow values JSON cannot hold (bytes, dates, decimals)
        return stable_id(plain(row))


def _one(ds: DatasetConfig, item: SourceItem, encoder: PromptEncoder | None, where: str) -> Item:
    if isinstance(item, SourceError):
        return Invalid(item.line, item.reason)
    line, row = item.line, item.data
    try:
        msgs = row_to_messages(ds, row)
    except ValueError as exc:
        return Invalid(line, f"{where}{exc}")
    pid = _row_id(ds, row)
    if pid is None:
        return Invalid(line, f"{where}missing id field {ds.id_field!r}")
    chars = prompt_chars(msgs)
    if ds.min_prompt_chars is not None and chars < ds.min_prompt_chars:
        return Filtered(line, f"{where}prompt has {chars} characters, fewer than min_prompt_chars "
                              f"{ds.min_prompt_chars}")
    if ds.max_prompt_chars is not None and chars > ds.max_prompt_chars:
        return Filtered(line, f"{where}prompt has {chars} characters, more than max_prompt_chars "
                              f"{ds.max_prompt_chars}")
    if encoder is None:
        return Prompt(line, pid, msgs)
    # The template's own default system prompt, written in: renders the same, so any consumer sees it.
    msgs = with_template_system(msgs, encoder.tokenizer, encoder.kwargs)
    try:
        ids = encoder.encode(msgs)
    except Exception as exc:  # noqa: BLE001 - a template may raise anything (e.g. roles must alternate)
        return Invalid(line, f"{where}chat template failed: {type(exc).__name__}: {exc}")
    if (why := encoder.too_long(len(ids))) is not None:
        return Invalid(line, f"{where}{why}")
    return Prompt(line, pid, msgs, ids if encoder.send_ids else None, len(ids))
