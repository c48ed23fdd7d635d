"""Disk as a budget for hidden states: what a token weighs on disk, and what each dataset has written.

Bytes per token = layers stored x hidden x bytes a value (+ fp8's float32 scale per token and layer) + the
token's id (4 B) and loss mask (1 B) (hidden_states/store/shards.py). ``hidden`` and the layer count come from
the target model's config.json (features.model.path, else server.tokenizer when it is a model directory);
the layers stored: the last layer, plus EAGLE-3's three aux layers with the transformers and vllm backends
(features.model.aux_layers, [] = none) or with an aux server (features.server.aux_urls).

Written bytes are counted in Redis (keys.features_bytes_key) by the collector as samples are indexed
(features_mark.lua, once per sample), so `budgetq status`, /metrics and the monitor read them without the disk.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, cast

import redis

from budgetq.shared import keys
from budgetq.shared.config import Config
from budgetq.shared.redis_conn import text
from budgetq.shared.scripts import ScriptCall

VALUE_BYTES = {"float16": 2, "bfloat16": 2, "fp8": 1}
SCALE_BYTES = 4              # fp8: one float32 scale per token and layer
TOKEN_EXTRA_BYTES = 5        # the token's id (I32) and loss mask (U8)
SHOWN_HIDDEN = (576, 4096, 7168)   # `budgetq plan`'s table: SmolLM2-135M (ours), an 8B, DeepSeek-V3/Kimi-K2
STOP = "disk budget reached"  # a dataset's capture stopped at its share of features.max_bytes


def bytes_per_token(hidden: int, layers: int, dtype: str) -> int:
    """Disk bytes a token's hidden states take (tensor data; a shard's JSON header adds a few hundred bytes a
    sample)."""
    per_layer = hidden * VALUE_BYTES[dtype] + (SCALE_BYTES if dtype == "fp8" else 0)
    return layers * per_layer + TOKEN_EXTRA_BYTES


def _model_dir(cfg: Config) -> Path | None:
    for p in (cfg.features.model.path if cfg.features.model else None, cfg.server.tokenizer):
        if p and (Path(p) / "config.json").is_file():
            return Path(p)
    return None


def model_shape(cfg: Config) -> tuple[int, int] | None:
    """(hidden size, decoder layers) of the target model from its config.json, or None where no local model
    directory is configured (a hub id: nothing read over the network)."""
    if cfg.features.backend == "synthetic" and cfg.features.synthetic is not None:
        return cfg.features.synthetic.hidden_size, 0
    d = _model_dir(cfg)
    if d is None:
        return None
    try:
        c = json.loads((d / "config.json").read_text())
        c = c.get("text_config", c)
        return int(c["hidden_size"]), int(c["num_hidden_layers"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def stored_layers(cfg: Config) -> int:
    """How many layers each token stores: the last one, plus the aux layers the backend captures."""
    f = cfg.features
    if f.backend == "http":
        return 4 if f.server.aux_urls else 1
    if f.backend == "synthetic" and f.synthetic is not None:
        return 1 + f.synthetic.aux_layers
    aux = f.model.aux_layers if f.model else None
    return 1 + (3 if aux is None else len(aux))


def config_bytes_per_token(cfg: Config) -> int | None:
    shape = model_shape(cfg)
    return None if shape is None else bytes_per_token(shape[0], stored_layers(cfg), cfg.features.dtype)


def mark_done(ds: str, samples: list[tuple[str, int, int]]) -> ScriptCall[int]:
    """Mark samples (id, bytes, tokens) done and count their bytes once (features_mark.lua)."""
    args: list[Any] = [v for s in samples for v in s]
    return ScriptCall("features_mark", [keys.features_done_key(ds), keys.features_bytes_key(ds)], args, int)


def read(conn: redis.Redis, names: list[str]) -> dict[str, dict[str, Any]]:
    """Per dataset that captured hidden states: bytes and tokens written, its byte share (None: unbounded) and
    the stop reason (None while it captures). For `budgetq status` (text and --json), /metrics, the monitor.
    ``names``: the registered datasets; a dataset a `budgetq features` pass is capturing is added."""
    names = list(names) + sorted(n for n in map(text, cast(set, conn.smembers(keys.FEATURES_DATASETS)))
                                 if n not in names)
    pipe = conn.pipeline(transaction=False)
    for n in names:
        pipe.hgetall(keys.features_bytes_key(n))
    out: dict[str, dict[str, Any]] = {}
    for n, h in zip(names, pipe.execute(), strict=True):
        if not h:
            continue
        v = {k.decode(): x.decode() for k, x in h.items()}
        share = v.get("share") or None
        out[n] = {"bytes_written": int(v.get("written") or 0), "tokens": int(v.get("tokens") or 0),
                  "max_bytes": None if share is None else int(share), "stop": v.get("stop") or None}
    return out


def format_bytes(n: float | None) -> str:
    """1.5 GB, 5.30 TB (decimal units, as disks are sold)."""
    if n is None:
        return "-"
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"
