"""A committed row -> the token ids of its whole conversation and the span of its generated answer.

The same chat template as generation (server.tokenizer, the dataset's chat_template_kwargs): the
prompt rendered with the generation prompt must be a prefix of the whole conversation rendered,
and the tokens after it are the answer (the loss mask's ones). A template that renders the
history differently once the answer is there (some drop earlier turns' reasoning) breaks that
prefix rule; such a row is reported by id, not guessed at.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from budgetq.shared.schema import ResultRow

log = logging.getLogger("budgetq.features")


class FeaturesInputError(ValueError):
    """This row cannot be turned into a prefill (the message names the row)."""


def _ids(out: Any) -> list[int]:
    ids = out["input_ids"] if isinstance(out, Mapping) else out  # transformers 5: BatchEncoding
    return [int(i) for i in ids]


def conversation_ids(tokenizer: Any, row: ResultRow, kwargs: dict[str, Any]) -> tuple[list[int], int, int]:
    """(input_ids, loss_start, loss_end) of a row whose last message is the generated answer."""
    msgs = [m.model_dump(exclude_none=True) for m in row.conversations]
    if len(msgs) < 2 or msgs[-1].get("role") != "assistant":
        raise FeaturesInputError(f"row {row.id!r}: conversations does not end with an assistant answer")
    prompt = _ids(tokenizer.apply_chat_template(msgs[:-1], add_generation_prompt=True, tokenize=True, **kwargs))
    full = _ids(tokenizer.apply_chat_template(msgs, add_generation_prompt=False, tokenize=True, **kwargs))
    if full[: len(prompt)] != prompt:
        raise FeaturesInputError(f"row {row.id!r}: the chat template renders the prompt differently once the answer "
                                 "is added, so the answer's tokens cannot be located")
    if len(full) == len(prompt):
        raise FeaturesInputError(f"row {row.id!r}: the answer renders to no tokens")
    return full, len(prompt), len(full)


class RowTail:
    """Reads out/<ds>.jsonl from where it last stopped: complete lines only (the collector appends
    and fsyncs whole lines; a line without its newline is still being written, or torn)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0
        self.line_no = 0

    def new_rows(self) -> Iterator[ResultRow]:
        """The rows appended since the last call (reading stops at the first incomplete line)."""
        if not self.path.exists():
            return
        with open(self.path, "rb") as fh:
            fh.seek(self.offset)
            for raw in fh:
                if not raw.endswith(b"\n"):
                    break
                self.offset += len(raw)
                self.line_no += 1
                try:
                    yield ResultRow.model_validate(json.loads(raw))
                except (ValueError, ValidationError) as exc:
                    log.warning("%s:%d: malformed row skipped: %s", self.path, self.line_no,
                                str(exc).splitlines()[0])


def committed_rows(path: Path) -> Iterator[ResultRow]:
    """The rows of out/<ds>.jsonl, in order; a malformed line is reported with file:line and skipped."""
    return RowTail(path).new_rows()
