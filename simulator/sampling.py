"""SGLang 0.5.23's checks of sampling parameters, with its messages (see docs/simulator.md).

Two stages, as in SGLang:
- /generate only: the JSON contract gate (sglang/api/v1/api_types.py, decode_SamplingParams)
  refuses unknown keys and wrong JSON types before anything runs; http_server.generate_request
  answers 400 ``{"error": "<text>"}`` (a string, not an object).
- every route: ``SamplingParams.__post_init__`` then ``verify()``
  (srt/sampling/sampling_params.py); a ValueError there is a 400 with its message.
tests/test_sglang_conformance.py checks the field list and the messages against the wheel.
"""

from __future__ import annotations

import math

# decode_SamplingParams' field order (the unknown-field message lists them in this order).
CONTRACT_FIELDS: tuple[str, ...] = (
    "max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k", "min_p",
    "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens", "n", "json_schema", "regex",
    "ebnf", "structural_tag", "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim",
    "stream_interval", "logit_bias", "sampling_seed", "custom_params", "beam_width", "watermark", "choice",
)
_INTS = {"max_new_tokens", "top_k", "min_new_tokens", "n", "stream_interval", "sampling_seed", "beam_width"}
_FLOATS = {"temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty"}
_BOOLS = {"ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim"}
_STRS = {"json_schema", "regex", "ebnf", "structural_tag"}
_EPS = 1e-6
TOP_K_ALL = 1 << 30
DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "frequency_penalty": 0.0,
            "presence_penalty": 0.0, "repetition_penalty": 1.0, "min_new_tokens": 0}


class SamplingError(ValueError):
    """A sampling parameter SGLang refuses; ``contract`` marks the /generate JSON gate."""

    def __init__(self, message: str, contract: bool = False) -> None:
        super().__init__(message)
        self.contract = contract


def unexpected(v: object) -> str:
    # serde's `Unexpected` wording, which the contract gate reproduces.
    if v is None:
        return "null"
    if isinstance(v, bool):
        return f"boolean `{'true' if v else 'false'}`"
    if isinstance(v, int):
        return f"integer `{v}`"
    if isinstance(v, float):
        return f"floating point `{v}`"
    if isinstance(v, str):
        return f'string "{v}"'
    return "sequence" if isinstance(v, list) else "map" if isinstance(v, dict) else type(v).__name__


def check_contract(params: object) -> None:
    """/generate's JSON gate over one ``sampling_params`` object: keys and JSON types."""
    if not isinstance(params, dict):
        raise SamplingError(f"invalid type: {unexpected(params)}, expected struct SamplingParams", contract=True)
    for key, v in params.items():
        if key not in CONTRACT_FIELDS:
            listed = ", ".join(f"`{f}`" for f in CONTRACT_FIELDS)
            raise SamplingError(f"unknown field `{key}`, expected one of {listed}", contract=True)
        if v is None:
            continue
        if key in _INTS and (isinstance(v, bool) or not isinstance(v, int)):
            raise SamplingError(f"invalid type: {unexpected(v)}, expected i64", contract=True)
        if key in _FLOATS and (isinstance(v, bool) or not isinstance(v, int | float)):
            raise SamplingError(f"invalid type: {unexpected(v)}, expected f64", contract=True)
        if key in _BOOLS and not isinstance(v, bool):
            raise SamplingError(f"invalid type: {unexpected(v)}, expected a boolean", contract=True)
        if key in _STRS and not isinstance(v, str):
            raise SamplingError(f"invalid type: {unexpected(v)}, expected a string", contract=True)


def verify(params: dict) -> None:
    """``SamplingParams(**params)`` normalisation then ``verify()``: raises SamplingError with SGLang's text."""
    # Values stay as sent: the msgspec Struct does not coerce, so /generate's top_p 0 reads "got 0."
    # (chat's pydantic model has already made it 0.0).
    p = {k: (DEFAULTS[k] if v is None and k in DEFAULTS else v) for k, v in params.items()}
    temperature = p.get("temperature", 1.0)
    top_k = p.get("top_k", -1)
    if 0 <= temperature < _EPS:        # greedy: __post_init__ turns it into top_k = 1
        temperature, top_k = 1.0, 1
    if top_k == -1:
        top_k = TOP_K_ALL
    top_p, min_p = p.get("top_p", 1.0), p.get("min_p", 0.0)
    freq, pres = p.get("frequency_penalty", 0.0), p.get("presence_penalty", 0.0)
    rep = p.get("repetition_penalty", 1.0)
    min_new, max_new = p.get("min_new_tokens", 0), p.get("max_new_tokens", 128)
    beam = p.get("beam_width")
    if beam is not None and beam < 1:
        raise SamplingError(f"beam_width must be at least 1, got {beam}.")
    if not math.isfinite(temperature) or temperature < 0.0:
        raise SamplingError(f"temperature must be a non-negative finite number, got {temperature}.")
    if not 0.0 < top_p <= 1.0:
        raise SamplingError(f"top_p must be in (0, 1], got {top_p}.")
    if not 0.0 <= min_p <= 1.0:
        raise SamplingError(f"min_p must be in [0, 1], got {min_p}.")
    if top_k < 1 or top_k == -1:
        raise SamplingError(f"top_k must be -1 (disable) or at least 1, got {top_k}.")
    if not -2.0 <= freq <= 2.0:
        raise SamplingError(f"frequency_penalty must be in [-2, 2], got {freq}.")
    if not -2.0 <= pres <= 2.0:
        raise SamplingError(f"presence_penalty must be in [-2, 2], got {pres}.")
    if not 0.0 < rep <= 2.0:
        raise SamplingError(f"repetition_penalty must be in (0, 2] (1.0 = no penalty), got {rep}.")
    if not 0 <= min_new:
        raise SamplingError(f"min_new_tokens must be in [0, max_new_tokens], got {min_new}.")
    if max_new is not None:
        if max_new < 0:
            raise SamplingError(f"max_new_tokens must be at least 0, got {max_new}.")
        if not min_new <= max_new:
            raise SamplingError(f"min_new_tokens must be in [0, max_new_tokens({max_new})], got {min_new}.")
    seed = p.get("sampling_seed")
    if seed is not None:
        if not isinstance(seed, int):
            raise SamplingError(f"sampling_seed must be an integer, got {type(seed).__name__}.")
        if not -(2**63) <= seed <= 2**63 - 1:
            raise SamplingError(f"sampling_seed must be in [-2**63, 2**63 - 1], got {seed}.")
    if sum(p.get(k) is not None for k in ("json_schema", "regex", "ebnf", "structural_tag")) > 1:
        raise SamplingError("Only one of json_schema, regex, ebnf, or structural_tag can be set.")


# ChatCompletionRequest.to_sampling_params: request value > generation_config > these defaults.
CHAT_DEFAULTED = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0}


def chat_sampling(body: dict, generation_config: dict[str, float]) -> dict:
    """The sampling parameters SGLang's chat route builds from a request (the ones that matter here).
    ChatCompletionRequest's float fields are pydantic floats, so an int arrives as a float."""
    out: dict = {}
    for name, default in CHAT_DEFAULTED.items():
        value = body.get(name)
        out[name] = generation_config.get(name, default) if value is None else value
    for name in _FLOATS:
        if isinstance(out.get(name), int) and not isinstance(out.get(name), bool):
            out[name] = float(out[name])
    out["max_new_tokens"] = body.get("max_completion_tokens") or body.get("max_tokens")
    out["min_new_tokens"] = body.get("min_tokens", 0)
    for name in ("frequency_penalty", "presence_penalty"):
        value = body.get(name)
        out[name] = 0.0 if value is None else float(value) if isinstance(value, int | float) else value
    out["sampling_seed"] = body.get("seed")
    for name in ("regex", "ebnf"):
        out[name] = body.get(name)
    out["n"] = body.get("n", 1)
    return out
