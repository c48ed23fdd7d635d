"""Format readers: stream raw rows (dicts) out of JSONL, JSON arrays, Parquet and HF datasets.

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
import base64
import datetime as dt
import decimal
import json
import re
import tempfile
from collections.abc import Generator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shared.config import DatasetConfig
from shared.errors import ConfigError

if TYPE_CHECKING:
    import numpy as np
    import pyarrow as pa

HF_PREFIX = "hf://"
CHUNK = 1 << 20          # bytes read at a time while scanning files
TAKE_WINDOW = 1024       # rows fetched per random-access batch when shuffled
_EXTENSIONS = {".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "json", ".parquet": "parquet", ".pq": "parquet"}


@dataclass(frozen=True)
class SourceRow:
    line: int
    data: dict[str, Any]


@dataclass(frozen=True)
class SourceError:
    line: int
    reason: str


SourceItem = SourceRow | SourceError


def kind(value: Any) -> str:
    """A JSON value's type as a person says it: 'a string', 'an array', 'null'."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list | tuple):
        return "an array"
    if isinstance(value, dict):
        return "an object"
    return f"a {type(value).__name__}"


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
    readers = {"jsonl": _jsonl, "json": _json_array, "parquet": _parquet, "hf": _hf}
    return readers[fmt](ds)


def _permutation(n: int, seed: int) -> np.ndarray:
    import numpy as np

    return np.random.default_rng(seed).permutation(n)


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
        row = json.loads(text)
    except json.JSONDecodeError as exc:
        return SourceError(line_no, f"bad JSON at column {exc.colno}: {exc.msg}")
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


def _jsonl(ds: DatasetConfig) -> Iterator[SourceItem]:
    with open(ds.path, "rb") as fh:
        if not ds.shuffle:
            for line_no, raw in enumerate(fh, start=1):
                if (item := _parse_object(raw, line_no)) is not None:
                    yield item
            return
        offsets = _line_offsets(ds.path)
        for idx in _permutation(len(offsets), ds.shuffle_seed):
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
        return SourceError(index, f"bad JSON in element {index} at file line {line + exc.lineno - 1}: {exc.msg} "
                                  f"(column {exc.colno} of the element's line {exc.lineno})")
    if not isinstance(row, dict):
        return SourceError(index, f"element {index} is {kind(row)}, not a JSON object")
    return SourceRow(index, row)


def _json_array(ds: DatasetConfig) -> Iterator[SourceItem]:
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
        for idx in _permutation(len(table), ds.shuffle_seed):
            start, end, line = (int(v) for v in table[idx])
            yield _read_span(fh, _Span(start, end, line), int(idx) + 1)
        if tail is not None:
            yield tail


# ---- Arrow-backed formats (Parquet, HF) ----------------------------------------------------

def plain(value: Any) -> Any:
    """A JSON-serialisable copy of an Arrow row value (bytes, dates, decimals), for hashing."""
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [plain(v) for v in value]
    if value is None or isinstance(value, str | int | float | bool):
        return value
    if isinstance(value, bytes):
        return "base64:" + base64.b64encode(value).decode()
    if isinstance(value, dt.date | dt.time | dt.datetime):
        return value.isoformat()
    if isinstance(value, decimal.Decimal | dt.timedelta):
        return str(value)
    return str(value)


def _table_rows(table: pa.Table, lines: list[int]) -> Iterator[SourceRow]:
    for line, row in zip(lines, table.to_pylist(), strict=True):
        yield SourceRow(line, row)


def _take_shuffled(n: int, seed: int, take: Any) -> Iterator[SourceRow]:
    """Rows in a seeded permutation, fetched TAKE_WINDOW at a time with ``take(indices)``."""
    perm = _permutation(n, seed)
    for lo in range(0, n, TAKE_WINDOW):
        idx = perm[lo:lo + TAKE_WINDOW]
        yield from _table_rows(take(idx), [int(i) + 1 for i in idx])


def _parquet(ds: DatasetConfig) -> Iterator[SourceItem]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        # A buffered stream decodes page by page instead of holding a whole row group's bytes.
        pf = pq.ParquetFile(ds.path, buffer_size=CHUNK, pre_buffer=False)
    except (pa.ArrowException, OSError) as exc:
        raise ConfigError(f"dataset {ds.name}: cannot read {ds.path} as Parquet: {exc}") from exc
    if not ds.shuffle:
        line = 1
        for batch in pf.iter_batches(batch_size=TAKE_WINDOW):
            yield from _table_rows(pa.Table.from_batches([batch]), list(range(line, line + batch.num_rows)))
            line += batch.num_rows
        return
    # Random access into compressed row groups would decode a row group per row: decode the
    # file once into a memory-mapped Arrow file instead, then take rows from it.
    with tempfile.TemporaryDirectory(prefix="budgetq-shuffle-") as tmp:
        spill = str(Path(tmp) / "rows.arrow")
        with pa.OSFile(spill, "wb") as sink, pa.ipc.new_file(sink, pf.schema_arrow) as writer:
            for batch in pf.iter_batches(batch_size=8 * TAKE_WINDOW):
                writer.write_batch(batch)
        with pa.memory_map(spill) as source:
            reader = pa.ipc.open_file(source)
            yield from _take_shuffled(pf.metadata.num_rows, ds.shuffle_seed, _BatchTaker(reader))
            del reader


class _BatchTaker:
    """``take(indices)`` over a memory-mapped Arrow file, one record batch at a time.

    Table.take on a many-chunk table concatenates the chunks first (the whole file in RAM);
    taking from each batch separately touches only the mapped pages it needs.
    """

    def __init__(self, reader: pa.ipc.RecordBatchFileReader) -> None:
        import numpy as np

        self.reader = reader
        sizes = [reader.get_batch(i).num_rows for i in range(reader.num_record_batches)]
        self.starts = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)])

    def __call__(self, idx: np.ndarray) -> pa.Table:
        import numpy as np
        import pyarrow as pa

        which = np.searchsorted(self.starts, idx, side="right") - 1
        parts, order = [], []
        for b in np.unique(which):
            mask = which == b
            parts.append(self.reader.get_batch(int(b)).take(pa.array(idx[mask] - self.starts[b])))
            order.append(np.flatnonzero(mask))
        # back to the permutation's order
        table = pa.Table.from_batches(parts, schema=self.reader.schema)
        return table.take(pa.array(np.argsort(np.concatenate(order), kind="stable")))


def _pick_split(ds: DatasetConfig, splits: list[str]) -> str:
    if ds.split is not None:
        if ds.split not in splits:
            raise ConfigError(f"dataset {ds.name}: split {ds.split!r} not in {ds.path} (splits: {', '.join(splits)})")
        return ds.split
    if len(splits) == 1:
        return splits[0]
    if "train" in splits:
        return "train"
    raise ConfigError(f"dataset {ds.name}: {ds.path} has splits {', '.join(splits)}; set split:")


def open_hf(ds: DatasetConfig) -> Any:
    """The ``datasets.Dataset`` for ``ds`` (a save_to_disk directory or hf://org/name)."""
    import datasets  # lazily: it takes a second to import and only this format needs it

    if ds.path.startswith(HF_PREFIX):
        name = ds.path[len(HF_PREFIX):]
        try:
            # Choose the split first so only that split is downloaded, not every one.
            split = ds.split or _pick_split(ds, datasets.get_dataset_split_names(name, ds.subset))
            obj = datasets.load_dataset(name, ds.subset, split=split)
        except ConfigError:
            raise
        except Exception as exc:  # noqa: BLE001 - hub errors come in many types; all are fatal here
            raise ConfigError(f"dataset {ds.name}: cannot load {ds.path} from the Hugging Face hub: {exc}") from exc
    else:
        if ds.subset is not None:
            raise ConfigError(f"dataset {ds.name}: subset applies to hub datasets (hf://...), not to {ds.path}")
        try:
            obj = datasets.load_from_disk(ds.path)
        except (OSError, ValueError) as exc:
            raise ConfigError(f"dataset {ds.name}: cannot load {ds.path} with datasets.load_from_disk: "
                              f"{exc}") from exc
    if isinstance(obj, datasets.DatasetDict):
        obj = obj[_pick_split(ds, list(obj))]
    elif ds.split is not None and obj.split is not None and str(obj.split) != ds.split:
        raise ConfigError(f"dataset {ds.name}: {ds.path} holds split {str(obj.split)!r}, not {ds.split!r}")
    if not isinstance(obj, datasets.Dataset):
        raise ConfigError(f"dataset {ds.name}: {ds.path} loaded as {type(obj).__name__}, not a Dataset")
    return obj


def _hf(ds: DatasetConfig) -> Iterator[SourceItem]:
    # Arrow format: raw storage values (an Image column stays {bytes, path}), no decoding.
    dataset = open_hf(ds).with_format("arrow")
    if not ds.shuffle:
        line = 1
        for table in dataset.iter(batch_size=TAKE_WINDOW):
            yield from _table_rows(table, list(range(line, line + table.num_rows)))
            line += table.num_rows
        return
    yield from _take_shuffled(len(dataset), ds.shuffle_seed, lambda idx: dataset[idx.tolist()])
