"""FP8 storage of hidden states (``features.dtype: fp8``): float8_e4m3fn with one float32 scale per token and
layer, about half the bytes of bf16.

Each token's row of each stored layer is scaled by ``amax / 448`` (448 is e4m3fn's largest finite value) and
rounded to the nearest e4m3fn value (ties to even), so every row uses the format's whole range and no value
saturates. The shard holds the codes (safetensors ``F8_E4M3``, what torch calls ``float8_e4m3fn``) and a
``<name>_scale`` tensor (``F32`` ``[tokens, layers]``); readers multiply back (``dequantize``) and the
``specforge-offline`` export writes bf16, what SpecForge's loader reads.

numpy has neither bfloat16 nor float8, so both ways go through tables. Encoding widens a few tokens at a time
(in cache) to float32, multiplies them by ``448 / amax`` into a scratch of its own (so the widening buffer's low
halves stay zero and no token's bits reach the next chunk: each token's codes and scale depend on that token
alone) and looks each code up by the top 16 bits of the float32 product. Every e4m3fn tie point is a bfloat16
value, so a product strictly between two bfloat16 values has one nearest code (table ``ENCODE``, made from the
middle of the float32s sharing those top bits) and one whose low 16 bits are zero is that bfloat16 value
exactly (table ``EXACT``: ties to even). Codes are therefore exactly torch's ``float8_e4m3fn`` cast of
``x * (448 / amax)`` in float32, sign of zero included (tests/test_fp8.py and tests/test_fp8_chunks.py check
it, across chunks, at hidden 576, 4096 and 7168). Decoding is a 256-entry table.
"""

from __future__ import annotations

import numpy as np

FP8_MAX = 448.0
CHUNK_VALUES = 1 << 17    # values encoded at a time: the float32 scratch (512 KB) stays in cache
SAFETENSORS_DTYPE = "F8_E4M3"


def _e4m3_values() -> np.ndarray:
    """The float32 value of each of the 256 e4m3fn codes (NaN for 0x7F and 0xFF; e4m3fn has no infinity)."""
    codes = np.arange(256, dtype=np.uint32)
    sign = np.where(codes & 0x80, -1.0, 1.0)
    exp = (codes >> 3) & 0xF
    man = (codes & 0x7).astype(np.float64)
    mag = np.where(exp == 0, man / 8.0 * 2.0 ** -6, (1.0 + man / 8.0) * 2.0 ** (exp.astype(np.float64) - 7))
    vals = (sign * mag).astype(np.float32)
    vals[(codes & 0x7F) == 0x7F] = np.nan
    return vals


DECODE = _e4m3_values()


def _encode_table(low: int) -> np.ndarray:
    """e4m3fn code for every bfloat16 bit pattern (the top half of a float32) completed by the low half ``low``:
    the nearest value (ties to the even code); beyond 448 the largest finite value (the scale keeps values within
    it). The sign is kept, as torch keeps it (a negative value that rounds to zero is 0x80)."""
    bits = np.arange(65536, dtype=np.uint32)
    with np.errstate(invalid="ignore"):
        x = ((bits << np.uint32(16)) | np.uint32(low)).view(np.float32).astype(np.float64)
    pos = DECODE[:0x7F].astype(np.float64)        # codes 0x00..0x7E: 0 .. 448, increasing
    mag = np.minimum(np.abs(np.nan_to_num(x, nan=0.0, posinf=FP8_MAX, neginf=FP8_MAX)), FP8_MAX)
    hi = np.clip(np.searchsorted(pos, mag, side="left"), 0, 0x7E)
    lo = np.clip(hi - 1, 0, 0x7E)
    d_lo, d_hi = mag - pos[lo], pos[hi] - mag
    pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0))
    code = np.where(pick_hi, hi, lo).astype(np.uint8)
    return np.where((bits & 0x8000) != 0, code | 0x80, code).astype(np.uint8)


ENCODE = _encode_table(0x8000)   # a float32 strictly between two bfloat16 values (no tie lies in there)
EXACT = _encode_table(0)         # a float32 that is a bfloat16 value: the tie points round to even here


def bf16_to_f32(data: bytes | memoryview, shape: tuple[int, ...]) -> np.ndarray:
    return (np.frombuffer(data, dtype="<u2").astype(np.uint32) << np.uint32(16)).view("<f4").reshape(shape)


def f32_to_bf16(x: np.ndarray) -> np.ndarray:
    """Round to nearest, ties to even (as torch's .to(torch.bfloat16)); uint16 bit patterns."""
    bits = np.ascontiguousarray(x, dtype="<f4").view("<u4")
    return ((bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)).astype("<u2")


def quantize(data: bytes | memoryview, tokens: int, layers: int, hidden: int) -> tuple[bytes, bytes]:
    """bf16 ``[tokens, layers x hidden]`` -> (e4m3fn codes, same shape; float32 scales ``[tokens, layers]``)."""
    src = np.frombuffer(data, dtype="<u2").reshape(tokens, layers, hidden)
    codes = np.empty((tokens, layers, hidden), dtype=np.uint8)
    flat = codes.reshape(-1)
    scales = np.empty((tokens, layers, 1), dtype="<f4")
    rows = max(1, CHUNK_VALUES // (layers * hidden))
    # The bf16 values widened to float32: only the top halves are ever written, the low halves stay 0.
    wide = np.zeros((rows, layers, 2 * hidden), dtype="<u2")
    prod = np.empty((rows, layers, hidden), dtype="<f4")   # x * 448 / amax: its own buffer, never ``wide``
    exact = np.empty((rows, layers, hidden), dtype=bool)
    for i in range(0, tokens, rows):
        part = src[i:i + rows]
        n = len(part)
        b = wide[:n]
        b[..., 1::2] = part
        x = b.view("<f4")
        amax = np.maximum(x.max(axis=2, keepdims=True), -x.min(axis=2, keepdims=True))
        amax[amax == 0] = FP8_MAX   # a row of zeros: scale 1
        y = prod[:n]
        np.multiply(x, np.float32(FP8_MAX) / amax, out=y)
        halves = y.view("<u2")
        np.take(ENCODE, halves[..., 1::2], out=codes[i:i + n])
        # Products that are a bfloat16 value exactly (low half 0): rare but for rows whose scale is short
        # (448 / amax a power of two ...); they may lie on a tie, where ENCODE rounds away from zero.
        e = exact[:n]
        np.equal(halves[..., 0::2], 0, out=e)
        at = np.flatnonzero(e)
        if at.size:
            flat[i * layers * hidden + at] = EXACT[y.view("<u4").reshape(-1)[at] >> np.uint32(16)]
        scales[i:i + n] = amax / np.float32(FP8_MAX)
    return codes.tobytes(), scales.reshape(tokens, layers).tobytes()


def dequantize(codes: bytes | memoryview, scales: bytes | memoryview, tokens: int, layers: int,
               hidden: int) -> np.ndarray:
    """float32 ``[tokens, layers x hidden]`` of what ``quantize`` stored."""
    q = DECODE[np.frombuffer(codes, dtype=np.uint8).reshape(tokens, layers, hidden)]
    s = np.frombuffer(scales, dtype="<f4").reshape(tokens, layers, 1)
    return (q * s).reshape(tokens, layers * hidden)


def dequantize_bf16(codes: bytes | memoryview, scales: bytes | memoryview, tokens: int, layers: int,
                    hidden: int) -> bytes:
    """The same as bfloat16 bytes (what the specforge-offline export writes)."""
    return f32_to_bf16(dequantize(codes, scales, tokens, layers, hidden)).tobytes()
