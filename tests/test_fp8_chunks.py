"""fp8 encoding of samples that span several of quantize's chunks (fp8.CHUNK_VALUES values each), at the widths
`budgetq plan` shows (576: SmolLM2-135M, 4096: an 8B, 7168: DeepSeek-V3 / Kimi-K2).

Each token's codes and scales are (a) those of the same token quantized alone, so nothing of one token or
chunk reaches the next, and (b) exactly torch's ``float8_e4m3fn`` cast of ``x * (448 / amax)`` computed in
float32 from the bf16 input, for every value: the values that land exactly on an e4m3fn tie (rounded to even),
negative values that round to zero (``-0``, code 0x80) and everything else."""

from __future__ import annotations

import numpy as np
import pytest

from budgetq.hidden_states.store import fp8

torch = pytest.importorskip("torch")

LAYERS = 2


def _ties(rng: np.random.Generator, n: int) -> np.ndarray:
    """n e4m3fn tie points (midway between two neighbouring finite codes, below 448), random signs: each is a
    bfloat16 value, so a bf16 input holds it exactly."""
    pos = fp8.DECODE[:0x7F].astype(np.float64)
    mids = (pos[:-1] + pos[1:]) / 2
    return (rng.choice(mids, n) * rng.choice([-1.0, 1.0], n)).astype(np.float32)


def _sample(tokens: int, hidden: int, seed: int) -> np.ndarray:
    """bf16 bit patterns ``[tokens, LAYERS x hidden]``: a residual-stream-like spread (a few channels far larger,
    each token at its own magnitude), every third token a row whose products land on ties: its largest value
    is 448 x 2^k, so 448 / amax is a power of two and the product of each tie x 2^k is the tie itself; and
    small negative values that round to -0."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((tokens, LAYERS, hidden)).astype(np.float32)
    x[..., rng.choice(hidden, 3, replace=False)] *= 60.0
    x *= (10.0 ** rng.uniform(-3, 3, (tokens, LAYERS, 1))).astype(np.float32)
    for t in range(0, tokens, 3):
        for layer in range(LAYERS):
            k = float(2.0 ** int(rng.integers(-6, 7)))
            row = _ties(rng, hidden) * np.float32(k)
            row[rng.integers(hidden)] = np.float32(448.0 * k) * rng.choice([-1, 1])
            row[rng.choice(hidden, 4, replace=False)] = np.float32(-2.0 ** -12 * k)   # -> -0 (0x80)
            x[t, layer] = row
    bits = fp8.f32_to_bf16(x.reshape(tokens, LAYERS * hidden))
    assert np.array_equal(fp8.bf16_to_f32(bits.tobytes(), (tokens, LAYERS, hidden))[::3], x[::3]), \
        "the tie rows are bf16 values exactly"
    return bits


def _torch_cast(bits: np.ndarray, tokens: int, hidden: int) -> tuple[np.ndarray, np.ndarray]:
    """torch's codes and scales: bf16 -> float32, x * (448 / amax) per token and layer, cast to float8_e4m3fn."""
    x = torch.from_numpy(bits.view(np.int16).copy()).view(torch.bfloat16).float().reshape(tokens, LAYERS, hidden)
    amax = x.abs().amax(dim=-1, keepdim=True)
    # 448 / amax rounded once to float32 (torch's ``448.0 / amax`` is amax.reciprocal() * 448: two roundings)
    codes = (x * (torch.full_like(amax, 448.0) / amax)).to(torch.float8_e4m3fn).view(torch.uint8)
    return codes.reshape(tokens, LAYERS * hidden).numpy(), (amax / 448.0).reshape(tokens, LAYERS).numpy()


@pytest.mark.parametrize("hidden", [576, 4096, 7168])
def test_each_token_is_encoded_alone_and_as_torch_casts_it(hidden):
    rows = fp8.CHUNK_VALUES // (LAYERS * hidden)
    tokens = 3 * rows + rows // 2 + 1          # three whole chunks and a part
    bits = _sample(tokens, hidden, seed=hidden)
    codes_b, scales_b = fp8.quantize(bits.tobytes(), tokens, LAYERS, hidden)
    codes = np.frombuffer(codes_b, np.uint8).reshape(tokens, LAYERS * hidden)
    scales = np.frombuffer(scales_b, "<f4").reshape(tokens, LAYERS)

    # (a) each token as it is alone: nothing of the tokens (chunks) before it reaches it
    alone = [fp8.quantize(bits[t].tobytes(), 1, LAYERS, hidden) for t in range(tokens)]
    unlike = [t for t in range(tokens) if alone[t][0] != codes[t].tobytes() or alone[t][1] != scales[t].tobytes()]
    assert not unlike, (f"hidden {hidden}: {len(unlike)} tokens encoded unlike themselves alone, the first token "
                        f"{unlike[0]} (chunk {unlike[0] // rows} of {rows} tokens)")

    # (b) torch's cast, every value
    want_codes, want_scales = _torch_cast(bits, tokens, hidden)
    wrong = np.flatnonzero((codes != want_codes).any(axis=1))
    assert wrong.size == 0, (f"hidden {hidden}: {int((codes != want_codes).sum())} codes in {wrong.size} tokens "
                             f"differ from torch's cast, the first at token {wrong[0]} (chunk {wrong[0] // rows})")
    assert np.array_equal(scales, want_scales), f"hidden {hidden}: scales differ from amax / 448"

    # what makes the sample hard: ties rounded both ways (to even, down and up), -0, several chunks
    x = fp8.bf16_to_f32(bits.tobytes(), (tokens, LAYERS, hidden))[::3]
    y = x * (np.float32(448.0) / np.abs(x).max(axis=2, keepdims=True))
    at_tie = np.isin(np.abs(y), (fp8.DECODE[:0x7E].astype(np.float64) + fp8.DECODE[1:0x7F]) / 2)
    tie_codes = want_codes[::3].reshape(y.shape)[at_tie] & 0x7F
    down = np.abs(fp8.DECODE[tie_codes]) < np.abs(y[at_tie])
    assert at_tie.sum() > 1000 and down.any() and (~down).any() and np.all(tie_codes % 2 == 0)
    assert (want_codes == 0x80).sum() >= tokens // 3, "negative values rounding to -0 are in the sample"
    assert tokens > 3 * rows
