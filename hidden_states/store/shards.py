"""Hidden-state shards of one dataset on disk: out/<ds>/features/<n>.safetensors + index.jsonl.

A shard is gathered in memory and written whole (tmp + fsync + rename) once it reaches
features.shard_mb (or at the end of a pass), then its samples' index rows are appended (one write,
fsync). Each shard is self-describing: its ``__metadata__`` lists its samples and it holds their
``input_ids`` and ``loss_mask``, so opening the store repairs a crash between the two steps by
indexing what a shard holds and the index is missing. A leftover ``.tmp`` (killed mid-write) is
removed. Whatever crashed when, a sample id is indexed at most once: a retried job's copy of an
id already on disk is dropped (``add`` returns False).

Index row: id, shard, key, shape [tokens, hidden], dtype, input_ids, loss_mask (1 on the
generated answer's tokens), and aux_shape [tokens, 3 x hidden] when an aux server answered too.
Tensors of a sample in its shard: ``<key>.hidden_state``, ``<key>.input_ids`` (I32),
``<key>.loss_mask`` (U8), ``<key>.aux_hidden_state`` (with aux_shape).
"""

from __future__ import annotations

import json
import logging
import os
import signal
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from budgetq.hidden_states.schema import FeaturesMeta
from budgetq.hidden_states.store.safetensors_io import (
    DTYPES,
    ShardError,
    Tensor,
    read_header,
    read_tensor,
    write_atomic,
)
from budgetq.shared.identity import encode_id

log = logging.getLogger("budgetq.features")
FORMAT = "budgetq-features-1"
SHARD_SUFFIX = ".safetensors"
# Set (tests only): SIGKILL this process between a shard's rename and its index rows.
CRASH_ENV = "BUDGETQ_FEATURES_CRASH_AFTER_SHARD"


def features_dir(out_dir: Path, ds: str) -> Path:
    return out_dir / ds / "features"


def index_rows(path: Path) -> list[dict]:
    """The index's rows (a torn last line, from a kill mid-append, is ignored)."""
    if not path.exists():
        return []
    out = []
    with open(path, encoding="utf-8") as fh:
        for line_no, line in enumerate(fh, start=1):
            if not line.endswith("\n"):
                break
            try:
                out.append(json.loads(line))
            except ValueError:
                log.warning("%s:%d: unreadable index row skipped", path, line_no)
    return out


def _cut_torn_tail(path: Path) -> None:
    if not path.exists() or path.stat().st_size == 0:
        return
    with open(path, "rb+") as fh:
        data = fh.read()
        if data.endswith(b"\n"):
            return
        fh.truncate(data.rfind(b"\n") + 1)


@dataclass
class Recovered:
    tmp_removed: int = 0
    reindexed: int = 0


@dataclass
class FeatureStore:
    out_dir: Path
    ds: str
    shard_bytes: int
    ids: set[str] = field(default_factory=set)
    bytes_on_disk: int = 0
    tokens_on_disk: int = 0
    buffer: list[tuple[FeaturesMeta, bytes, bytes | None]] = field(default_factory=list)
    buffer_bytes: int = 0
    recovered: Recovered = field(default_factory=Recovered)

    def __post_init__(self) -> None:
        self.dir = features_dir(self.out_dir, self.ds)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.index = self.dir / "index.jsonl"
        self._buffered: set[str] = set()
        self._recover()

    # -- opening -------------------------------------------------------------------------
    def shards(self) -> list[Path]:
        return sorted(self.dir.glob(f"*{SHARD_SUFFIX}"))

    def _recover(self) -> None:
        for tmp in self.dir.glob("*.tmp"):
            tmp.unlink()
            self.recovered.tmp_removed += 1
        _cut_torn_tail(self.index)
        indexed = {(r["shard"], r["key"]) for r in index_rows(self.index)}
        self.ids = {r["id"] for r in index_rows(self.index)}
        missing: list[dict] = []
        for shard in self.shards():
            self.bytes_on_disk += shard.stat().st_size
            header, start = read_header(shard)
            for s in json.loads(header.get("__metadata__", {}).get("samples", "[]")):
                self.tokens_on_disk += int(s["shape"][0])
                if (shard.name, s["key"]) in indexed or s["id"] in self.ids:
                    continue
                ids = np.frombuffer(read_tensor(shard, f"{s['key']}.input_ids", header, start).data, "<i4")
                mask = np.frombuffer(read_tensor(shard, f"{s['key']}.loss_mask", header, start).data, "u1")
                missing.append({**s, "shard": shard.name, "input_ids": ids.tolist(), "loss_mask": mask.tolist()})
                self.ids.add(s["id"])
        if missing:
            self._append_index(missing)
            self.recovered.reindexed = len(missing)
            log.warning("features %s: indexed %d samples a shard held but the index missed (a crash between "
                        "the two writes)", self.ds, len(missing))

    def _next_shard(self) -> Path:
        numbers = [int(p.stem) for p in self.shards() if p.stem.isdigit()]
        return self.dir / f"{max(numbers, default=-1) + 1:06d}{SHARD_SUFFIX}"

    # -- writing -------------------------------------------------------------------------
    def has(self, pid: str) -> bool:
        return pid in self.ids or pid in self._buffered

    def add(self, meta: FeaturesMeta, data: bytes, aux: bytes | None = None) -> bool:
        """Buffer one sample (and its aux layers, if any) for the next shard; False (dropped) if its id is on
        disk or buffered already."""
        if self.has(meta.id):
            return False
        self.buffer.append((meta, data, aux))
        self._buffered.add(meta.id)
        self.buffer_bytes += len(data) + (len(aux) if aux else 0)
        return True

    @property
    def full(self) -> bool:
        return self.buffer_bytes >= self.shard_bytes

    def flush(self) -> list[str]:
        """Write the buffered samples as one shard, then their index rows; returns their ids."""
        if not self.buffer:
            return []
        path = self._next_shard()
        tensors: list[Tensor] = []
        samples, rows = [], []
        for meta, data, aux in self.buffer:
            key = encode_id(meta.id)
            n = len(meta.input_ids)
            mask = meta.loss_mask()
            tensors += [Tensor(f"{key}.hidden_state", DTYPES[meta.dtype], meta.shape, data),
                        Tensor(f"{key}.input_ids", "I32", [n], np.asarray(meta.input_ids, "<i4").tobytes()),
                        Tensor(f"{key}.loss_mask", "U8", [n], np.asarray(mask, "u1").tobytes())]
            sample: dict = {"id": meta.id, "key": key, "shape": meta.shape, "dtype": meta.dtype}
            if aux is not None and meta.aux_shape is not None:
                tensors.append(Tensor(f"{key}.aux_hidden_state", DTYPES[meta.dtype], meta.aux_shape, aux))
                sample["aux_shape"] = meta.aux_shape
            samples.append(sample)
            rows.append({**sample, "shard": path.name, "input_ids": meta.input_ids, "loss_mask": mask})
        size = write_atomic(path, tensors, {"format": FORMAT, "dataset": self.ds,
                                            "samples": json.dumps(samples, separators=(",", ":"))})
        # A kill here: the shard is on disk, the index misses its rows; _recover adds them.
        if os.environ.get(CRASH_ENV):  # tests/test_features.py kills the pass exactly here
            os.kill(os.getpid(), signal.SIGKILL)
        self._append_index(rows)
        ids = [m.id for m, _, _ in self.buffer]
        self.ids.update(ids)
        self.bytes_on_disk += size
        self.tokens_on_disk += sum(m.shape[0] for m, _, _ in self.buffer)
        self.buffer.clear()
        self._buffered.clear()
        self.buffer_bytes = 0
        return ids

    def _append_index(self, rows: list[dict]) -> None:
        text = "".join(json.dumps(r, separators=(",", ":"), ensure_ascii=False) + "\n" for r in rows)
        with open(self.index, "a", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())

    @property
    def bytes_per_token(self) -> float | None:
        """Disk bytes per token learnt from what is written (None before the first shard)."""
        return self.bytes_on_disk / self.tokens_on_disk if self.tokens_on_disk else None


def check_store(out_dir: Path, ds: str, row_ids: set[str]) -> list[str]:
    """Problems between rows <-> index <-> shards (empty: consistent); reads headers, not tensor data."""
    d = features_dir(out_dir, ds)
    problems: list[str] = []
    rows = index_rows(d / "index.jsonl")
    seen: set[str] = set()
    headers: dict[str, dict] = {}
    in_shards: set[tuple[str, str]] = set()
    for shard in sorted(d.glob(f"*{SHARD_SUFFIX}")):
        try:
            headers[shard.name], _ = read_header(shard)
        except ShardError as exc:
            problems.append(str(exc))
            continue
        for s in json.loads(headers[shard.name].get("__metadata__", {}).get("samples", "[]")):
            in_shards.add((shard.name, s["key"]))
    for r in rows:
        where = f"{d / 'index.jsonl'}: id {r.get('id')!r}"
        if r["id"] in seen:
            problems.append(f"{where} is indexed twice")
        seen.add(r["id"])
        if r["id"] not in row_ids:
            problems.append(f"{where} has no row in out/{ds}.jsonl")
        h = headers.get(r["shard"])
        info = h.get(f"{r['key']}.hidden_state") if h else None
        if info is None:
            problems.append(f"{where}: shard {r['shard']} holds no tensor {r['key']}.hidden_state")
            continue
        if list(info["shape"]) != list(r["shape"]) or info["dtype"] != DTYPES[r["dtype"]]:
            problems.append(f"{where}: shard says {info['dtype']} {info['shape']}, index {r['dtype']} {r['shape']}")
        if r.get("aux_shape") is not None:
            aux = h.get(f"{r['key']}.aux_hidden_state") if h else None
            if aux is None or list(aux["shape"]) != list(r["aux_shape"]) or r["aux_shape"][0] != r["shape"][0]:
                problems.append(f"{where}: aux_hidden_state {r['aux_shape']} does not match the shard or the tokens")
        if not len(r["input_ids"]) == len(r["loss_mask"]) == r["shape"][0]:
            problems.append(f"{where}: {len(r['input_ids'])} input ids, {len(r['loss_mask'])} mask entries, "
                            f"{r['shape'][0]} hidden-state rows")
        in_shards.discard((r["shard"], r["key"]))
    for shard_name, key in sorted(in_shards):
        problems.append(f"{d / shard_name}: sample {key} is in no index row (run `budgetq features` to index it)")
    for leftover in d.glob("*.tmp"):
        problems.append(f"{leftover}: a shard write that never finished (removed by the next `budgetq features`)")
    return problems
