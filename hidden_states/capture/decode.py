"""Turn a hidden-state /generate response into tensor bytes: runs in worker processes, off the event loop.

A 4k-token prefill of a 4096-wide model answers with ~16M floats as JSON (~150 MB); parsing
that on the event loop would stall every other request of the worker for seconds.
"""

from __future__ import annotations

import numpy as np
import orjson


class HiddenStatesError(ValueError):
    """The response holds no usable hidden states for this request (the message says why)."""


def to_dtype(arr: np.ndarray, dtype: str) -> bytes:
    """float32 -> little-endian float16 or bfloat16 bytes (bfloat16: the top 16 bits, rounded to nearest even)."""
    if dtype == "float16":
        return arr.astype("<f2").tobytes()
    if dtype == "bfloat16":
        bits = np.ascontiguousarray(arr, dtype="<f4").view("<u4")
        rounded = (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
        return rounded.astype("<u2").tobytes()
    raise ValueError(f"unknown dtype {dtype!r}")


def from_dtype(data: bytes, dtype: str, shape: list[int]) -> np.ndarray:
    """The inverse, as float32 (for tests, checks and exports)."""
    if dtype == "float16":
        return np.frombuffer(data, dtype="<f2").astype(np.float32).reshape(shape)
    if dtype == "bfloat16":
        return (np.frombuffer(data, dtype="<u2").astype(np.uint32) << np.uint32(16)).view("<f4").reshape(shape)
    raise ValueError(f"unknown dtype {dtype!r}")


def decode(body: bytes, n_tokens: int, dtype: str) -> tuple[bytes, list[int]]:
    """(tensor bytes, [n_tokens, hidden]) of the prefill block of ``meta_info.hidden_states``.

    SGLang (full mode) answers ``[[row] * computed_tokens, decode rows...]``: the first element is
    the prefill block (simulator/hidden.py names the SGLang functions). Only tokens the prefill
    computed have rows, so a prefix-cache hit or a chunked prefill shows up as too few rows.
    """
    try:
        data = orjson.loads(body)
        states = data["meta_info"]["hidden_states"]
    except (orjson.JSONDecodeError, KeyError, TypeError) as exc:
        raise HiddenStatesError(f"response has no meta_info.hidden_states ({exc!r}): {body[:200]!r}") from None
    if not isinstance(states, list) or not states or not isinstance(states[0], list) \
            or not states[0] or not isinstance(states[0][0], list):
        raise HiddenStatesError("meta_info.hidden_states is not a [tokens][hidden] block: the request must use "
                                "return_hidden_states=true on a server with --return-hidden-states-mode full")
    arr = np.array(states[0], dtype=np.float32)
    if arr.ndim != 2:
        raise HiddenStatesError(f"hidden-state block has shape {list(arr.shape)}, expected [tokens, hidden]")
    if arr.shape[0] != n_tokens:
        raise HiddenStatesError(
            f"server returned hidden states for {arr.shape[0]} of {n_tokens} tokens: SGLang returns rows only for "
            "tokens it prefilled, so a prefix-cache hit or a chunked prefill loses rows; start the features "
            "server with --disable-radix-cache and --chunked-prefill-size above the longest sample")
    if not np.isfinite(arr).all():
        raise HiddenStatesError("hidden states hold NaN or inf")
    return to_dtype(arr, dtype), [int(arr.shape[0]), int(arr.shape[1])]
