"""Format readers: stream raw rows (dicts) out of JSONL, JSON arrays, Parquet and HF datasets
(the last two in producer/reading/arrow_sources.py).

Every reader yields ``SourceRow(line, data)`` or ``SourceError(line, reason)`` and never holds
the whole input in memory. ``line`` is the 1-based line number for JSONL and the 1-based row
(element) index for every other format.

Shuffling needs random access, so it keeps one small index instead of the rows:
- JSONL: the byte offset of every line (8 bytes a line) plus the permutation (8 bytes a row);
- JSON array: start, end and line of every element (24 bytes) plus the permutation;
- Parquet: the file is first decoded into a temporary Arrow IPC file (disk: the
  uncompressed size; RAM: only the OS page cache, it is memory-mapped) plus the permutation;
- HF datasets: already memory-mapped Arrow, only the permutation.
The permutation is numpy's ``default_rng(shuffle_seed).permutation(n)``: the same seed on the
same input gives the same order.
"""

from __future__ import annotations

import array
import json
import re
from collections.abc import Generator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from budgetq.producer.reading import arrow_sources  # imports pyarrow (and datasets) only when a reader runs
from budgetq.producer.reading.source_rows import CHUNK, HF_PREFIX, SourceError, SourceItem, SourceRow, permutation
from budgetq.shared.config import DatasetConfig
from budgetq.shared.errors import ConfigError
from budgetq.shared.json_kind import json_problem, kind

if TYPE_CHECKING:
    import numpy as np

_EXTENSIONS = {".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "json", ".parquet": "parquet", ".pq": "parquet"}


def _first_byte(path: Path) -> bytes:
    """The first byte that is not whitespace or a UTF-8 BOM (b'' for an empty file)."""
    with open(path, "rb") as fh:
        while chunk := fh.read(4096):
            stripped = chunk.lstrip(b"\xef\xbb\xbf \t\r\n")
            if stripped:
                return stripped[:1]
    return b""


def detect_format(ds: DatasetConfig) -> str:
    """The format to read ``ds.path`` with; raises ConfigError/FileNotFoundError naming the path."""
    if ds.path.startswith(HF_PREFIX):
        if ds.format not in ("auto", "hf"):
            raise ConfigError(f"dataset {ds.name}: {ds.path} is a hub dataset; format {ds.format!r} does not apply")
        return "hf"
    path = Path(ds.path)
    if not path.exists():
        raise FileNotFoundError(f"dataset {ds.name}: file not found: {ds.path}")
    if ds.format == "hf" or (ds.format == "auto" and path.is_dir()):
        if not (path / "dataset_dict.json").exists() and not (path / "state.json").exists():
            raise ConfigError(f"dataset {ds.name}: {ds.path} is not a datasets save_to_disk directory "
                              "(it has neither dataset_dict.json nor state.json)")
        return "hf"
    if path.is_dir():
        raise ConfigError(f"dataset {ds.name}: {ds.path} is a directory; format {ds.format!r} needs a file")
    if ds.format != "auto":
        return ds.format
    fmt = _EXTENSIONS.get(path.suffix.lower())
    if fmt is None:
        raise ConfigError(f"dataset {ds.name}: cannot tell the format of {ds.path} from its extension; "
                          "set format: jsonl, json, parquet or hf")
    if fmt == "json" and _first_byte(path) != b"[":
        return "jsonl"  # a .json file of one object per line is JSONL
    return fmt


def iter_rows(ds: DatasetConfig, fmt: str) -> Generator[SourceItem, None, None]:
    """Stream the rows of ``ds`` in file order, or in a seeded permutation if ``ds.shuffle``."""
    if fmt == "jsonl":
        return _jsonl(ds)
    if fmt == "json":
        return _json_array(ds)
    return arrow_sources.read_parquet(ds) if fmt == "parquet" else arrow_sources.read_hf(ds)


# ---- JSONL ---------------------------------------------------------------------------------

def _parse_object(raw: bytes, line_no: int) -> SourceItem | None:
    """One JSONL line -> a row, an error, or None for a blank line."""
    if line_no == 1:
        raw = raw.removeprefix(b"\xef\xbb\xbf")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        return SourceError(line_no, f"not valid UTF-8 (byte {exc.start + 1})")
    if not text.strip():
        return None
    try:
        row = json.loads(text.rstrip("\r\n"))  # a line cut short then reads as the unterminated string it is
    except json.JSONDecodeError as exc:
        return SourceError(line_no, f"bad JSON at column {exc.colno}: {json_problem(exc)}")
    if not isinstance(row, dict):
        return SourceError(line_no, f"row is {kind(row)}, not a JSON object")
    return SourceRow(line_no, row)


def _line_offsets(path: str) -> np.ndarray:
    """Byte offset of the start of every line (int64; 8 bytes a line)."""
    import numpy as np

    parts = [np.zeros(1, dtype=np.int64)]
    pos = 0
    with open(path, "rb") as fh:
        while chunk := fh.read(4 * CHUNK):
            nl = np.flatnonzero(np.frombuffer(chunk, dtype=np.uint8) == 10)
            parts.append(nl.astype(np.int64) + (pos + 1))
            pos += len(chunk)
    offsets = np.concatenate(parts)
    return offsets[:-1] if offsets[-1] == pos else offsets  # a final newline starts no line


def _jsonl(ds: DatasetConfig) -> Generator[SourceItem, None, None]:
    with open(ds.path, "rb") as fh:
        if not ds.shuffle:
            for line_no, raw in enumerate(fh, start=1):
                if (item := _parse_object(raw, line_no)) is not None:
                    yield item
            return
        offsets = _line_offsets(ds.path)
        for idx in permutation(len(offsets), ds.shuffle_seed):
            fh.seek(int(offsets[idx]))
            if (item := _parse_object(fh.readline(), int(idx) + 1)) is not None:
                yield item


# ---- JSON array ----------------------------------------------------------------------------

_STRUCTURAL = re.compile(rb'["\\\[\]{},]')


@dataclass(frozen=True)
class _Span:
    """One array element: bytes [start, end) of the file, starting on file line ``line``."""
    start: int
    end: int
    line: int


def _array_spans(path: str) -> Iterator[_Span | SourceError]:
    """Find the elements of a top-level JSON array by scanning brackets and strings.

    Holds one chunk at a time; elements are read back by offset, so a huge array streams.
    """
    depth, in_str, skip_to = 0, False, -1
    region, region_line = -1, 1          # start of the current element's bytes, and its line
    lines, counted = 1, 0                 # newlines counted up to byte `counted`
    index, commas = 0, 0
    pos = 0
    with open(path, "rb") as fh:
        while chunk := fh.read(CHUNK):
            for m in _STRUCTURAL.finditer(chunk):
                at = pos + m.start()
                if at < skip_to:
                    continue
                ch = m.group()
                if in_str:
                    if ch == b"\\":
                        skip_to = at + 2
                    elif ch == b'"':
                        in_str = False
                    continue
                if ch == b'"':
                    in_str = True
                elif depth == 0:
                    if ch != b"[":
                        yield SourceError(index + 1, f"the file is not a JSON array (found {ch.decode()!r} "
                                                     "before '['); for one object per line use format: jsonl")
                        return
                    lines += chunk.count(b"\n", counted - pos, m.start())
                    counted = at
                    depth, region, region_line = 1, at + 1, lines
                elif ch in b"[{":
                    depth += 1
                elif ch in b"]}" and depth > 1:
                    depth -= 1
                elif ch == b"," and depth > 1 or ch == b"}":
                    continue  # inside a nested value, or a stray '}' that json.loads will report
                else:  # ',' or the closing ']' of the array itself: one element ends here
                    lines += chunk.count(b"\n", counted - pos, m.start())
                    counted = at
                    index += 1
                    closing = ch == b"]"
                    if closing and commas == 0 and not _has_content(fh, region, at):
                        return  # []
                    yield _Span(region, at, region_line)
                    if closing:
                        return
                    commas += 1
                    region, region_line = at + 1, lines
            lines += chunk.count(b"\n", max(counted - pos, 0))
            counted = pos = pos + len(chunk)
    if depth == 0:
        yield SourceError(1, "the file holds no JSON array")
    else:
        yield SourceError(index + 1, f"the JSON array is not closed: element {index + 1} (file line "
                                     f"{region_line}) and everything after it cannot be read")


def _has_content(fh: Any, start: int, end: int) -> bool:
    here = fh.tell()
    fh.seek(start)
    blob = fh.read(end - start)
    fh.seek(here)
    return bool(blob.strip())


def _read_span(fh: Any, span: _Span, index: int) -> SourceItem:
    fh.seek(span.start)
    raw = fh.read(span.end - span.start)
    body = raw.lstrip()
    line = span.line + raw[: len(raw) - len(body)].count(b"\n")
    if not body.strip():
        return SourceError(index, f"element {index} (file line {line}) is empty: two commas in a row "
                                  "or a trailing comma")
    try:
        row = json.loads(body.decode("utf-8"))
    except UnicodeDecodeError as exc:
        return SourceError(index, f"element {index} (file line {line}) is not valid UTF-8 (byte {exc.start + 1})")
    except json.JSONDecodeError as exc:
        return SourceError(index, f"bad JSON in element {index} at file line {line + exc.lineno - 1}: "
                                  f"{json_problem(exc)} (column {exc.colno} of the element's line {exc.lineno})")
    if not isinstance(row, dict):
        return SourceError(index, f"element {index} is {kind(row)}, not a JSON object")
    return SourceRow(index, row)


def _json_array(ds: DatasetConfig) -> Generator[SourceItem, None, None]:
    with open(ds.path, "rb") as fh:
        if not ds.shuffle:
            for n, span in enumerate(_array_spans(ds.path), start=1):
                yield span if isinstance(span, SourceError) else _read_span(fh, span, n)
            return
        import numpy as np

        spans = array.array("q")  # start, end, line of each element: 24 bytes, no Python objects
        tail: SourceError | None = None
        for span in _array_spans(ds.path):
            if isinstance(span, SourceError):
                tail = span
            else:
                spans.extend((span.start, span.end, span.line))
        table = np.frombuffer(spans, dtype=np.int64).reshape(-1, 3)
        for idx in permutation(len(table), ds.shuffle_seed):
            start, end, line = (int(v) for v in table[idx])
            yield _read_span(fh, _Span(start, end, line), int(idx) + 1)
        if tail is not None:
            yield tail
