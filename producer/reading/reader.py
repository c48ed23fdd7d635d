"""The producer's one entry point to datasets: ``read_prompts(ds, server)``.

Streams a dataset (JSONL, JSON array, Parquet, HF; see producer/reading/sources.py) row by row into
``Prompt`` (ready to enqueue), ``Invalid`` (bad row, with the reason) or ``Filtered`` (skipped
by the length filter, not an error). ``line`` is the 1-based line for JSONL and the 1-based
row index for the other formats (their reasons start with "row N").

A bad row costs only that row: any error while mapping, identifying or tokenizing it
(expected or not) becomes an ``Invalid`` with the reason. Ids are checked here too
(``id_field: id``, the default: the ``id`` field when the dataset's first row in file order
has one, else a content hash; ``dataset_id_field``): the first row with an id wins, in processing
order (file order, or the seeded shuffle order, which is the same on every run with the same
seed); a later row with the same id is
``Invalid(reason="duplicate id ...")``, whatever its content. Ids already done in an
earlier run are still "seen" here first (the run skips them later), so a restart never
flags the first occurrence itself.
"""

from __future__ import annotations

from collections.abc import Generator, Iterator
from dataclasses import dataclass

from budgetq.producer.reading.arrow_sources import plain
from budgetq.producer.reading.conversations import with_template_system
from budgetq.producer.reading.mapping import prompt_chars, row_to_messages, split_turns
from budgetq.producer.reading.seen import SeenIds
from budgetq.producer.reading.source_rows import SourceError, SourceItem, SourceRow
from budgetq.producer.reading.sources import detect_format, iter_rows
from budgetq.producer.reading.tokenize import PromptEncoder
from budgetq.shared.config import DatasetConfig, ServerConfig
from budgetq.shared.identity import IdError, PromptId, has_surrogate, id_text, id_value, stable_id
from budgetq.shared.schema import Message

DUPLICATE = "duplicate id"
DEFAULT_ID_FIELD = "id"


@dataclass(frozen=True)
class Prompt:
    line: int
    # The dataset's id as the output row keeps it (an integer stays one); its key, for job ids
    # and the duplicate check, is ``id_text(id)``.
    id: PromptId
    messages: list[Message]
    # api=generate: the chat template applied locally; the server gets these ids.
    input_ids: list[int] | None = None
    # Known whenever a tokenizer is configured (generate, or chat with server.tokenizer).
    # regenerate: all: summed over the conversation's requests, without the answers.
    prompt_tokens: int | None = None
    # regenerate: all: the later user turns (JobPayload.turns); None: one request.
    turns: list[Message] | None = None


@dataclass(frozen=True)
class Invalid:
    line: int
    reason: str
    duplicate: bool = False   # a later row repeating an earlier row's id


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
    return _prompts(ds, fmt, encoder, server.max_prompt_bytes)


def dataset_id_field(ds: DatasetConfig, fmt: str | None = None) -> str | None:
    """Where ``ds``'s ids come from: ``id_field: id`` (the default) means the ``id`` field when the
    first readable row in file order has a non-null one, else None (content hashes); any other
    name is that field on every row, null content hashes. File order, not the shuffled one:
    every seed agrees."""
    if ds.id_field != DEFAULT_ID_FIELD:
        return ds.id_field
    return _default_rule(first_row(ds, fmt))


def first_row(ds: DatasetConfig, fmt: str | None = None) -> SourceRow | None:
    """The first readable row of ``ds`` in file order (None: it has none)."""
    rows = iter_rows(ds.model_copy(update={"shuffle": False}), fmt or detect_format(ds))
    try:
        return next((item for item in rows if isinstance(item, SourceRow)), None)
    finally:
        rows.close()


def _default_rule(first: SourceRow | None) -> str | None:
    return DEFAULT_ID_FIELD if first is not None and first.data.get(DEFAULT_ID_FIELD) is not None else None


def _prompts(ds: DatasetConfig, fmt: str, encoder: PromptEncoder | None,
             max_bytes: int) -> Generator[Item, None, None]:
    # id_field left unset: decided by the first row in file order, which, unshuffled, is the
    # first row streamed here (no second read); shuffled, it is looked up first. Lazily either
    # way: nothing is opened before the first row is asked for.
    settled = ds.id_field != DEFAULT_ID_FIELD
    if not settled and ds.shuffle:
        ds, settled = ds.model_copy(update={"id_field": dataset_id_field(ds, fmt)}), True
    rows = iter_rows(ds, fmt)
    seen = SeenIds()
    valid = 0
    try:
        for item in rows:
            if not settled and isinstance(item, SourceRow):
                ds, settled = ds.model_copy(update={"id_field": _default_rule(item)}), True
            where = "" if fmt == "jsonl" else f"row {item.line}: "
            try:
                out = _one(ds, item, encoder, where, max_bytes)
            except Exception as exc:  # noqa: BLE001 - whatever a row does, it costs only that row
                out = Invalid(item.line, f"{where}unexpected error: {type(exc).__name__}: {exc}")
            if isinstance(out, Prompt) and not seen.add(id_text(out.id)):
                shown = repr(out.id) if len(id_text(out.id)) <= 80 else repr(id_text(out.id)[:80]) + "..."
                out = Invalid(out.line, f"{where}{DUPLICATE} {shown} (an earlier row has it; the first one is kept)",
                              duplicate=True)
            yield out
            if isinstance(out, Prompt):
                valid += 1
                if ds.limit is not None and valid >= ds.limit:
                    return
    finally:
        rows.close()  # releases files and the shuffle spill when the caller stops early


def row_id(ds: DatasetConfig, row: dict) -> PromptId:
    """The row's prompt id (a string or an integer); IdError naming the field if it cannot be one."""
    if ds.id_field:
        if ds.id_field not in row or row[ds.id_field] is None:
            raise IdError(f"missing id field {ds.id_field!r}")
        return id_value(row[ds.id_field], ds.id_field)
    try:
        return stable_id(row)
    except (TypeError, ValueError):  # Arrow values JSON cannot hold (bytes, dates, decimals)
        return stable_id(plain(row))


def _too_big(msgs: list[Message], max_bytes: int) -> str | None:
    """Why the messages are over ``server.max_prompt_bytes`` (UTF-8), or None.

    A character is at most 4 bytes, so only prompts over max_bytes / 4 characters are encoded.
    """
    chars = sum(len(m.content) for m in msgs)
    if chars * 4 <= max_bytes:
        return None
    size = sum(len(m.content.encode("utf-8", "surrogatepass")) for m in msgs)
    if size <= max_bytes:
        return None
    return (f"prompt has {size:,} bytes (UTF-8), more than server.max_prompt_bytes {max_bytes:,}: "
            "Redis and the server would carry it only for the server to refuse it")


def _one(ds: DatasetConfig, item: SourceItem, encoder: PromptEncoder | None, where: str,
         max_bytes: int) -> Item:
    if isinstance(item, SourceError):
        return Invalid(item.line, item.reason)
    line, row = item.line, item.data
    try:
        msgs = row_to_messages(ds, row)
    except ValueError as exc:
        return Invalid(line, f"{where}{exc}")
    try:
        pid = row_id(ds, row)
    except IdError as exc:
        return Invalid(line, f"{where}{exc}")
    for i, m in enumerate(msgs):
        if has_surrogate(m.content):  # the worker could never write its output row
            return Invalid(line, f"{where}message {i} ({m.role}) holds a lone surrogate, which UTF-8 cannot encode")
    turns: list[Message] | None = None
    if ds.regenerate == "all":
        msgs, later = split_turns(msgs)
        turns = later or None
    if (why := _too_big(msgs + (turns or []), max_bytes)) is not None:   # before the tokenizer reads it all
        return Invalid(line, f"{where}{why}")
    chars = prompt_chars(msgs + (turns or []))
    if ds.min_prompt_chars is not None and chars < ds.min_prompt_chars:
        return Filtered(line, f"{where}prompt has {chars} characters, fewer than min_prompt_chars "
                              f"{ds.min_prompt_chars}")
    if ds.max_prompt_chars is not None and chars > ds.max_prompt_chars:
        return Filtered(line, f"{where}prompt has {chars} characters, more than max_prompt_chars "
                              f"{ds.max_prompt_chars}")
    if encoder is None:
        return Prompt(line, pid, msgs, turns=turns)
    # The template's own default system prompt, written in: renders the same, so any consumer sees it.
    msgs = with_template_system(msgs, encoder.tokenizer, encoder.kwargs)
    try:
        ids, total, last = encoder.conversation_tokens(msgs, turns or [])
    except Exception as exc:  # noqa: BLE001 - a template may raise anything (e.g. roles must alternate)
        return Invalid(line, f"{where}chat template failed: {type(exc).__name__}: {exc}")
    if (why := encoder.too_long(last)) is not None:   # the last request's prompt, before any answer
        return Invalid(line, f"{where}{why}")
    return Prompt(line, pid, msgs, ids if encoder.send_ids else None, total, turns)
