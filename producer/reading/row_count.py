"""How many rows a dataset's file holds, before it is read: for the ledger's ``unread`` (every row of
the file has a place, rows never read because the budget came first included) and the ETA's
prompts left (shared/ends.py).

Exact where it is cheap: Parquet and HF datasets from their metadata, JSONL and JSON arrays by a
scan of files up to ``EXACT_BYTES``. A larger text file is estimated from the rows in its first
``SAMPLE_BYTES`` (the producer's count of the rows it read replaces it once every row is read).
A row here is what the reader yields one item for: a JSONL line that is not blank, a JSON array's
element, a Parquet or Arrow row.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

from budgetq.producer.reading import arrow_sources
from budgetq.producer.reading.sources import _array_spans, _Span, detect_format
from budgetq.shared.config import DatasetConfig

log = logging.getLogger("budgetq.producer")
EXACT_BYTES = 1 << 30    # text files up to 1 GiB are counted row by row (a second or so)
SAMPLE_BYTES = 64 << 20  # a larger one: its first 64 MiB's rows per byte times its size


@dataclass(frozen=True)
class RowCount:
    rows: int
    exact: bool


def count_rows(ds: DatasetConfig) -> RowCount | None:
    """The rows of ``ds``'s file, exact or estimated; None when they cannot be told (a read error:
    the reader reports it as it reads)."""
    try:
        fmt = detect_format(ds)
        if fmt == "parquet":
            import pyarrow.parquet as pq

            return RowCount(pq.ParquetFile(ds.path).metadata.num_rows, True)
        if fmt == "hf":
            return RowCount(len(arrow_sources.open_hf(ds)), True)
        size = os.path.getsize(ds.path)
        limit = size if size <= EXACT_BYTES else SAMPLE_BYTES
        rows, scanned = (_jsonl_rows if fmt == "jsonl" else _array_rows)(Path(ds.path), limit)
    except Exception as exc:  # noqa: BLE001 - a count is a nicety: never what stops the run
        log.debug("dataset %s: rows not counted: %s: %s", ds.name, type(exc).__name__, exc)
        return None
    if scanned >= size:
        return RowCount(rows, True)
    return RowCount(round(rows * size / scanned) if scanned else 0, False)


def _jsonl_rows(path: Path, limit: int) -> tuple[int, int]:
    """(lines that are not blank, bytes scanned) within the first ``limit`` bytes (whole lines)."""
    rows = scanned = 0
    with open(path, "rb") as fh:
        for n, raw in enumerate(fh):
            if scanned + len(raw) > limit and scanned:
                break
            scanned += len(raw)
            if (raw.removeprefix(b"\xef\xbb\xbf") if n == 0 else raw).strip():
                rows += 1
    return rows, scanned


def _array_rows(path: Path, limit: int) -> tuple[int, int]:
    """(elements of the top-level JSON array, bytes scanned) within the first ``limit`` bytes; an
    error of the array itself (not one, not closed) is one row, as the reader yields it."""
    size = os.path.getsize(path)
    rows = 0
    for span in _array_spans(str(path)):
        rows += 1
        if not isinstance(span, _Span):
            return rows, size
        if limit < size and span.end >= limit:
            return rows, span.end + 1
    return rows, size
