"""Hidden-state shards of one dataset on disk: out/<ds>/features/<n>.safetensors + index.jsonl.

A shard is gathered in memory and written whole (tmp + fsync + rename) once it reaches
features.shard_mb (or at the end of a pass), then its samples' index rows are appended (one write,
fsync). Each shard is self-describing: its ``__metadata__`` lists its samples and it holds their
``input_ids`` and ``loss_mask``, so opening the store repairs a crash between the two steps by
indexing what a shard holds and the index is missing. A leftover ``.tmp`` (killed mid-write) is
removed. Whatever crashed when, a sample id is indexed at most once: a retried job's copy of an
id already on disk is dropped (``add`` returns False).

With ``features.store`` the features workers write shards themselves (``write_sample_shard``: one sample a
shard, named ``w-<random>``, written in ``incoming/`` and renamed into place) and send the collector an index
message; ``adopt`` indexes the shard, or deletes it when its id is indexed in another shard already (a job run
twice). Opening the store (and ``reconcile`` at the end of a pass) indexes a shard no message announced (a
worker killed between its rename and its message) and deletes one whose samples are all indexed elsewhere,
so each sample is in exactly one shard and no shard is read twice. ``incoming/`` also holds what the vLLM
engines write for the vllm backend; ``sweep_leftovers`` empties it, and ``engine/`` (single_pass), once no features
job runs.

Index row: id, shard, key, shape [tokens, hidden], dtype, input_ids, loss_mask (1 on the
generated answer's tokens), and aux_shape [tokens, 3 x hidden] when an aux server answered too.
Tensors of a sample in its shard: ``<key>.hidden_state``, ``<key>.input_ids`` (I32),
``<key>.loss_mask`` (U8), ``<key>.aux_hidden_state`` (with aux_shape).
"""

from __future__ import annotations

import json
import logging
import os
import re
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from budgetq.hidden_states.schema import FeaturesMeta
from budgetq.hidden_states.store import fault_points, fp8
from budgetq.hidden_states.store.safetensors_io import (
    DTYPES,
    ShardError,
    Tensor,
    read_header,
    read_tensor,
    write_atomic,
)
from budgetq.shared.config import Config
from budgetq.shared.config_features import ENGINE_DIR
from budgetq.shared.identity import encode_id

log = logging.getLogger("budgetq.features")
FORMAT = "budgetq-features-1"
SHARD_SUFFIX = ".safetensors"
# Set (tests only): SIGKILL this process between a shard's rename and its index rows (the collector); the
# second, a features worker between its shard's rename and its index message (features.store). Older names of
# two of store/fault_points.py's points.
CRASH_ENV = fault_points.LEGACY[fault_points.BEFORE_INDEX_ROWS]
WORKER_CRASH_ENV = fault_points.LEGACY[fault_points.BEFORE_INDEX_MESSAGE]
INCOMING = "incoming"      # in a features directory: files being written (worker shards' tmp, vLLM's files)
WORKER_PREFIX = "w-"       # shards a features worker wrote (one sample each)
# The only shard names an index message may carry: what write_sample_shard makes. The name comes from Redis,
# and adopt deletes a second copy by it: anything else (a slash, "..", an absolute path, other characters) is
# refused, so no message can make the collector touch a file outside the store.
WORKER_SHARD_NAME = re.compile(r"w-[0-9a-f]{16}\.safetensors", re.ASCII)


def features_root(cfg: Config) -> Path:
    """Where the datasets' features directories are: features.store when set (a volume the workers share),
    else output_dir (the collector writes every shard)."""
    return Path(cfg.features.store) if cfg.features.store else cfg.output_dir


def features_dir(out_dir: Path, ds: str) -> Path:
    return out_dir / ds / "features"


def sample_tensors(meta: FeaturesMeta, data: bytes | memoryview, aux: bytes | memoryview | None) -> tuple[
        list[Tensor], dict, list[int]]:
    """A sample's tensors in a shard, its ``__metadata__.samples`` entry, and its loss mask."""
    key = encode_id(meta.id)
    n = len(meta.input_ids)
    mask = meta.loss_mask()
    tensors = [*_layers(f"{key}.hidden_state", meta.dtype, meta.shape, meta.shape[1] if meta.shape else 1, data),
               Tensor(f"{key}.input_ids", "I32", [n], np.asarray(meta.input_ids, "<i4").tobytes()),
               Tensor(f"{key}.loss_mask", "U8", [n], np.asarray(mask, "u1").tobytes())]
    sample: dict = {"id": meta.id, "key": key, "shape": meta.shape, "dtype": meta.dtype}
    if meta.from_generation:
        sample["source"] = "generation"
    if aux is not None and meta.aux_shape is not None:
        tensors += _layers(f"{key}.aux_hidden_state", meta.dtype, meta.aux_shape, meta.shape[1], aux)
        sample["aux_shape"] = meta.aux_shape
    return tensors, sample, mask


def _layers(name: str, dtype: str, shape: list[int], hidden: int, data: bytes | memoryview) -> list[Tensor]:
    """A block of layers ``[tokens, layers x hidden]`` as stored: as it came, or (fp8) its bf16 bytes as
    e4m3fn codes and ``<name>_scale`` float32 ``[tokens, layers]`` (store/fp8.py)."""
    if dtype != "fp8" or not data:   # no data: an adopted worker shard's index row only
        return [Tensor(name, DTYPES[dtype], shape, data)]
    layers = shape[1] // hidden
    codes, scales = fp8.quantize(data, shape[0], layers, hidden)
    return [Tensor(name, fp8.SAFETENSORS_DTYPE, shape, codes), Tensor(f"{name}_scale", "F32", [shape[0], layers],
                                                                        scales)]


def write_sample_shard(d: Path, meta: FeaturesMeta, data: bytes | memoryview,
                       aux: bytes | memoryview | None) -> tuple[str, int]:
    """A features worker's shard of one sample, in features directory ``d``: written in ``incoming/``, fsynced,
    renamed into place (a fresh name per attempt: two runs of a job never write the same file). Returns
    (its file name, its size); the caller then sends the index message."""
    tensors, sample, _ = sample_tensors(meta, data, aux)
    name = f"{WORKER_PREFIX}{uuid.uuid4().hex[:16]}{SHARD_SUFFIX}"
    (d / INCOMING).mkdir(parents=True, exist_ok=True)
    size = write_atomic(d / name, tensors, {"format": FORMAT, "dataset": meta.dataset,
                                            "samples": json.dumps([sample], separators=(",", ":"))},
                        tmp=d / INCOMING / f"{name}.tmp")
    return name, size


def _samples(header: dict) -> list[dict]:
    return json.loads(header.get("__metadata__", {}).get("samples", "[]"))


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
    duplicates_removed: int = 0


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
        self.adopted: list[dict] = []    # index rows of worker shards, appended at the next flush
        self.where: dict[str, str] = {}  # id -> the shard its index row names
        self.flushed: list[tuple[str, int, int]] = []  # (id, bytes, tokens) of the samples the last flush indexed
        for tmp in self.dir.glob("*.tmp"):
            tmp.unlink()
            self.recovered.tmp_removed += 1
        _cut_torn_tail(self.index)
        self.reconcile()

    # -- opening -------------------------------------------------------------------------
    def shards(self) -> list[Path]:
        return sorted(self.dir.glob(f"*{SHARD_SUFFIX}"))

    def reconcile(self) -> None:
        """Make the index and the shards agree (at opening, and at the end of a pass): index what a shard holds
        and the index misses (a crash between the two writes), delete a shard none of whose samples is indexed
        in it while each is indexed in another (a second copy), and count what is on disk."""
        rows = index_rows(self.index)
        indexed = {(r["shard"], r["key"]) for r in rows}
        self.where = {r["id"]: r["shard"] for r in rows}
        self.ids = set(self.where)
        self.bytes_on_disk = self.tokens_on_disk = 0
        missing: list[dict] = []
        for shard in self.shards():
            header, start = read_header(shard)
            samples = _samples(header)
            if samples and not any((shard.name, s["key"]) in indexed for s in samples) and all(
                    self.where.get(s["id"], shard.name) != shard.name for s in samples):
                log.warning("features %s: %s holds only samples indexed in other shards (a job that ran twice): "
                            "removed", self.ds, shard.name)
                shard.unlink()
                self.recovered.duplicates_removed += 1
                continue
            self.bytes_on_disk += shard.stat().st_size
            for s in samples:
                self.tokens_on_disk += int(s["shape"][0])
                if (shard.name, s["key"]) in indexed or s["id"] in self.ids:
                    continue
                ids = np.frombuffer(read_tensor(shard, f"{s['key']}.input_ids", header, start).data, "<i4")
                mask = np.frombuffer(read_tensor(shard, f"{s['key']}.loss_mask", header, start).data, "u1")
                missing.append({**s, "shard": shard.name, "input_ids": ids.tolist(), "loss_mask": mask.tolist()})
                self.ids.add(s["id"])
                self.where[s["id"]] = shard.name
        if missing:
            self._append_index(missing)
            self.recovered.reindexed += len(missing)
            log.warning("features %s: indexed %d samples a shard held but the index missed (a crash between "
                        "the two writes)", self.ds, len(missing))

    def sweep_leftovers(self) -> int:
        """Remove what ``incoming/`` holds: call only when no features job is queued or running (then a file
        there is a write that never finished, or an engine's file a killed worker never read). ``engine/``
        (features.vllm.single_pass) too: a file there is a generation attempt whose row was never kept (aborted,
        requeued, a second attempt) or whose row is already captured; one of a row still being generated by a
        producer running meanwhile costs that row a prefill (its features job finds no file), nothing more."""
        n = 0
        for sub in (INCOMING, ENGINE_DIR):
            swept = [f for f in (self.dir / sub).glob("*") if f.is_file()]
            for f in swept:
                f.unlink(missing_ok=True)
            if swept:
                log.warning("features %s: removed %d %s from %s", self.ds, len(swept), "unfinished files"
                            if sub == INCOMING else "files of generation requests no row kept", self.dir / sub)
            n += len(swept)
        return n

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

    def adopt(self, meta: FeaturesMeta) -> str:
        """A worker's index message for shard ``meta.shard``: "new" (its row is appended at the next flush),
        "duplicate" (the id is indexed or adopted in another shard: this one is deleted; or it is this very
        shard, announced again), "missing" (no such shard: the job's sample is not on disk), or "refused" (a shard
        name no worker makes, logged in one line naming it: nothing is read, indexed or deleted by that name)."""
        assert meta.shard is not None
        if not WORKER_SHARD_NAME.fullmatch(meta.shard):
            log.error("features %s: index message for %s refused: shard name %r is not one a features worker "
                      "writes (w-<16 hex>%s): nothing read or deleted by it", self.ds, meta.id, meta.shard,
                      SHARD_SUFFIX)
            return "refused"
        if self.has(meta.id):
            if self.where.get(meta.id) != meta.shard:
                (self.dir / meta.shard).unlink(missing_ok=True)
            return "duplicate"
        if not (self.dir / meta.shard).is_file():
            return "missing"
        _, sample, mask = sample_tensors(meta, b"", None)
        if meta.aux_shape is not None:
            sample["aux_shape"] = meta.aux_shape
        self.adopted.append({**sample, "shard": meta.shard, "input_ids": meta.input_ids, "loss_mask": mask,
                             "_bytes": meta.shard_bytes or 0})
        self._buffered.add(meta.id)
        self.where[meta.id] = meta.shard
        return "new"

    def flush(self) -> list[str]:
        """Write the buffered samples as one shard, then their index rows and those of adopted worker shards
        (one append); returns their ids (``flushed``: their bytes and tokens too)."""
        rows = []
        if self.buffer:
            path = self._next_shard()
            tensors: list[Tensor] = []
            samples = []
            for meta, data, aux in self.buffer:
                ts, sample, mask = sample_tensors(meta, data, aux)
                tensors += ts
                samples.append(sample)
                rows.append({**sample, "shard": path.name, "input_ids": meta.input_ids, "loss_mask": mask})
                self.where[meta.id] = path.name
            size = write_atomic(path, tensors, {"format": FORMAT, "dataset": self.ds,
                                                "samples": json.dumps(samples, separators=(",", ":"))})
            self.bytes_on_disk += size
            self.tokens_on_disk += sum(m.shape[0] for m, _, _ in self.buffer)
            # the shard's bytes over its samples by their data (the byte budget counts them per sample)
            weights = [len(d) + (len(a) if a else 0) + 1 for _, d, a in self.buffer]
            parts = [size * n // sum(weights) for n in weights]
            parts[-1] += size - sum(parts)
            self.flushed = [(m.id, b, m.shape[0]) for (m, _, _), b in zip(self.buffer, parts, strict=True)]
        else:
            self.flushed = []
        for r in self.adopted:
            self.flushed.append((r["id"], r["_bytes"], r["shape"][0]))
            self.bytes_on_disk += r.pop("_bytes")
            self.tokens_on_disk += r["shape"][0]
            rows.append(r)
        if not rows:
            return []
        # A kill here: the shards are on disk, the index misses their rows; reconcile adds them.
        fault_points.reached(fault_points.BEFORE_INDEX_ROWS)
        self._append_index(rows)
        ids = [r["id"] for r in rows]
        self.ids.update(ids)
        self.buffer.clear()
        self.adopted.clear()
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
        for s in _samples(headers[shard.name]):
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
    for leftover in sorted((d / INCOMING).glob("*")):
        problems.append(f"{leftover}: a capture in flight, or one that never finished (removed once a "
                        "`budgetq features` ends with no features job running)")
    return problems
