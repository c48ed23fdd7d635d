"""The safetensors format, written and read by hand (no torch, bfloat16 from raw bytes).

Layout (huggingface/safetensors, docs "Format"): 8 bytes little-endian u64 N, then N bytes of a
JSON header ``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {str: str}}``
(offsets relative to the byte after the header, tensors back to back, no holes), then the data.
The header is padded with spaces to a multiple of 8 so the data is aligned. The ``safetensors``
package (installed with transformers) reads these files; tests/test_features.py checks that.
It is not used to write: its numpy API has no bfloat16.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

from budgetq.hidden_states.store import fault_points

# fp8: float8_e4m3fn codes (store/fp8.py), with a float32 scale tensor beside them
DTYPES = {"float16": "F16", "bfloat16": "BF16", "float32": "F32", "int32": "I32", "int64": "I64", "uint8": "U8",
          "fp8": "F8_E4M3"}
ITEM_SIZE = {"F16": 2, "BF16": 2, "F32": 4, "I32": 4, "I64": 8, "U8": 1, "F8_E4M3": 1}
MAX_HEADER = 100 * 2**20  # the safetensors readers' own limit


class ShardError(ValueError):
    """A file that is not a readable safetensors shard (the message names it)."""


@dataclass(frozen=True)
class Tensor:
    name: str
    dtype: str          # safetensors code: F16, BF16, I32, U8 ...
    shape: list[int]
    data: bytes | memoryview


def write_atomic(path: Path, tensors: list[Tensor], metadata: dict[str, str], tmp: Path | None = None) -> int:
    """Write a shard as ``path`` all at once: tmp file, fsync, rename, fsync of the directory.
    A crash leaves either no file or the whole file (and maybe a ``.tmp`` the next open removes); a write that
    fails (OSError) removes its ``.tmp`` before raising.
    ``tmp``: where the file is written before its rename (default ``path`` + ``.tmp``; same filesystem)."""
    header: dict[str, object] = {"__metadata__": metadata}
    offset = 0
    for t in tensors:
        n = ITEM_SIZE[t.dtype]
        for d in t.shape:
            n *= d
        if n != len(t.data):
            raise ValueError(f"tensor {t.name}: {len(t.data)} bytes for shape {t.shape} of {t.dtype}")
        header[t.name] = {"dtype": t.dtype, "shape": t.shape, "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    tmp = tmp or path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as fh:
            fh.write(struct.pack("<Q", len(raw)))
            fh.write(raw)
            for t in tensors:
                fh.write(t.data)
            fh.flush()
            os.fsync(fh.fileno())
        fault_points.reached(fault_points.SHARD_TMP_WRITTEN)
        os.replace(tmp, path)
    except BaseException:
        # A failed write (ENOSPC, EIO, a stale NFS handle) leaves no .tmp behind to fill the disk further.
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass
        raise
    fault_points.reached(fault_points.SHARD_RENAMED)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return 8 + len(raw) + offset


def read_header(path: Path) -> tuple[dict, int]:
    """(header, byte offset of the data) of a shard; ShardError naming the file otherwise."""
    try:
        with open(path, "rb") as fh:
            head = fh.read(8)
            if len(head) != 8:
                raise ShardError(f"{path}: shorter than a safetensors header")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER:
                raise ShardError(f"{path}: header length {n} is not plausible")
            header = json.loads(fh.read(n))
    except (OSError, ValueError) as exc:
        if isinstance(exc, ShardError):
            raise
        raise ShardError(f"{path}: not a safetensors file: {exc}") from exc
    if not isinstance(header, dict):
        raise ShardError(f"{path}: header is not a JSON object")
    return header, 8 + n


def read_tensor(path: Path, name: str, header: dict | None = None, data_start: int | None = None) -> Tensor:
    if header is None or data_start is None:
        header, data_start = read_header(path)
    try:
        info = header[name]
        begin, end = info["data_offsets"]
    except (KeyError, TypeError, ValueError) as exc:
        raise ShardError(f"{path}: no tensor {name!r}") from exc
    with open(path, "rb") as fh:
        fh.seek(data_start + begin)
        data = fh.read(end - begin)
    if len(data) != end - begin:
        raise ShardError(f"{path}: tensor {name!r} is cut short")
    return Tensor(name, info["dtype"], list(info["shape"]), data)
