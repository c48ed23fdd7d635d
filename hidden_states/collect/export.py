"""``budgetq export --format specforge-offline``: the hidden-state shards as SpecForge's offline files.

SpecForge's offline EAGLE-3 training (specforge/data/preprocessing.py ``OfflineEagle3Dataset``,
files found by ``list_local_files``: every ``*.ckpt`` under a directory, sorted) loads each file
with ``torch.load`` and reads four keys, as its scripts/prepare_hidden_states.py writes them
(``_save_tensor``): ``input_ids`` and ``loss_mask`` (1-D, int64), ``hidden_state`` ([1, L, H], the
target: the last layer) and ``aux_hidden_state`` ([1, L, 3H]: three intermediate layers
concatenated, the drafter's input). Files go to ``rows_<start>-<end>/data_<idx>.ckpt`` in groups
of 5000, like prepare_hidden_states.py.

A stock SGLang server returns the last layer only (``return_hidden_states``), so ``aux_hidden_state``
is written only for samples whose shard holds ``<key>.aux_hidden_state``; without it SpecForge's
loader fails on the missing key (the export says so). docs/hidden_states.md describes how a server
that returns the aux layers plugs in.

torch.save's format is a pickle inside a zip: torch is needed where this runs (it is not a budgetq
dependency); everything up to the file write is here without it, and tested.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from budgetq.hidden_states.store import fp8
from budgetq.hidden_states.store.safetensors_io import read_header, read_tensor
from budgetq.hidden_states.store.shards import features_dir, index_rows
from budgetq.shared.errors import BudgetqError

log = logging.getLogger("budgetq.export")
GROUP = 5000  # prepare_hidden_states.py's group_size


@dataclass(frozen=True)
class OfflineSample:
    path: str                  # relative: rows_<start>-<end>/data_<idx>.ckpt
    input_ids: np.ndarray      # int64 [L]
    loss_mask: np.ndarray      # int64 [L]
    hidden_state: tuple[str, list[int], bytes | memoryview]           # (dtype, [1, L, H], raw bytes)
    aux_hidden_state: tuple[str, list[int], bytes | memoryview] | None


def offline_path(idx: int) -> str:
    start = idx // GROUP * GROUP
    return f"rows_{start}-{start + GROUP}/data_{idx}.ckpt"


def offline_samples(out_dir: Path, ds: str) -> Iterator[OfflineSample]:
    """Every indexed sample, in index order, as SpecForge's offline loader wants it."""
    d = features_dir(out_dir, ds)
    headers: dict[str, tuple[dict, int]] = {}
    for idx, row in enumerate(index_rows(d / "index.jsonl")):
        shard = d / row["shard"]
        if row["shard"] not in headers:
            headers[row["shard"]] = read_header(shard)
        header, start = headers[row["shard"]]
        hidden = _block(shard, f"{row['key']}.hidden_state", row, header, start)
        aux_name = f"{row['key']}.aux_hidden_state"
        aux = _block(shard, aux_name, row, header, start) if aux_name in header else None
        yield OfflineSample(
            offline_path(idx), np.asarray(row["input_ids"], np.int64), np.asarray(row["loss_mask"], np.int64),
            hidden, aux)


def _block(shard: Path, name: str, row: dict, header: dict, start: int) -> tuple[str, list[int], bytes | memoryview]:
    """(dtype, [1, L, width], bytes) of a stored block; fp8 (codes and a scale per token and layer) comes back
    as bf16, what SpecForge's loader reads (store/fp8.py)."""
    t = read_tensor(shard, name, header, start)
    if row["dtype"] != "fp8":
        return row["dtype"], [1, *t.shape], t.data
    scales = read_tensor(shard, f"{name}_scale", header, start)
    tokens, width = t.shape
    layers = scales.shape[1]
    return "bfloat16", [1, *t.shape], fp8.dequantize_bf16(t.data, scales.data, tokens, layers, width // layers)


@dataclass
class OfflineResult:
    target: Path
    written: int = 0
    kept: int = 0
    without_aux: int = 0


def _tensor(torch: Any, spec: tuple[str, list[int], bytes | memoryview]) -> Any:
    dtype, shape, data = spec
    return torch.frombuffer(bytearray(data), dtype=getattr(torch, dtype)).reshape(shape)


def export_specforge_offline(out_dir: Path, ds: str, target: Path) -> OfflineResult:
    """Write the files (each to a .tmp, then renamed; an existing file is kept, so a rerun resumes)."""
    try:
        import torch
    except ImportError:
        raise BudgetqError("export --format specforge-offline writes torch.save files (what SpecForge loads): "
                           "install torch where you export (pip install torch)") from None
    if not (features_dir(out_dir, ds) / "index.jsonl").exists():
        raise BudgetqError(f"{ds}: no {features_dir(out_dir, ds) / 'index.jsonl'}: run `budgetq features` first")
    res = OfflineResult(target)
    for s in offline_samples(out_dir, ds):
        path = target / s.path
        if path.exists():
            res.kept += 1
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        point = {"input_ids": torch.from_numpy(s.input_ids), "loss_mask": torch.from_numpy(s.loss_mask),
                 "hidden_state": _tensor(torch, s.hidden_state)}
        if s.aux_hidden_state is not None:
            point["aux_hidden_state"] = _tensor(torch, s.aux_hidden_state)
        else:
            res.without_aux += 1
        tmp = path.with_name(path.name + ".tmp")
        torch.save(point, tmp)
        os.replace(tmp, path)
        res.written += 1
    return res


def offline_note(res: OfflineResult) -> str:
    if not res.without_aux:
        return ""
    return (f"; {res.without_aux} file(s) have no aux_hidden_state (a stock SGLang server returns the last layer "
            "only): SpecForge's OfflineEagle3Dataset needs it, see docs/hidden_states.md")
