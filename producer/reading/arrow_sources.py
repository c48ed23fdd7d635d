"""Arrow-backed formats: Parquet files and Hugging Face datasets (save_to_disk dirs, hub names).

pyarrow and datasets are imported inside the functions: a run that reads only JSONL never
pays for them.
"""

from __future__ import annotations

import base64
import datetime as dt
import decimal
import tempfile
from collections.abc import Generator, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from budgetq.producer.reading.source_rows import CHUNK, HF_PREFIX, TAKE_WINDOW, SourceItem, SourceRow, permutation
from budgetq.shared.config import DatasetConfig
from budgetq.shared.errors import ConfigError

if TYPE_CHECKING:
    import numpy as np
    import pyarrow as pa


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
    perm = permutation(n, seed)
    for lo in range(0, n, TAKE_WINDOW):
        idx = perm[lo:lo + TAKE_WINDOW]
        yield from _table_rows(take(idx), [int(i) + 1 for i in idx])


def read_parquet(ds: DatasetConfig) -> Generator[SourceItem, None, None]:
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


def read_hf(ds: DatasetConfig) -> Generator[SourceItem, None, None]:
    # Arrow format: raw storage values (an Image column stays {bytes, path}), no decoding.
    dataset = open_hf(ds).with_format("arrow")
    if not ds.shuffle:
        line = 1
        for table in dataset.iter(batch_size=TAKE_WINDOW):
            yield from _table_rows(table, list(range(line, line + table.num_rows)))
            line += table.num_rows
        return
    yield from _take_shuffled(len(dataset), ds.shuffle_seed, lambda idx: dataset[idx.tolist()])
