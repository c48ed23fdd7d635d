"""Sampling parity between SGLang's two APIs, and checked pass-through of ``sampling.extra``.

Why: SGLang's chat route fills the unset ones of temperature, top_p, top_k, min_p and
repetition_penalty from the model's generation_config.json (``--sampling-defaults model``,
``ModelConfig.get_default_sampling_params``); ``/generate`` never does. So the producer resolves
each field once, in this order: the dataset's ``sampling`` block, else the model's
generation_config.json next to ``server.tokenizer`` (when budgetq can read it); a field neither
gives stays unset (out/<ds>.meta.json records the values used, null for unset).

The worker then sends (``explicit``): to SGLang, all five, an unset one as SGLang's own neutral
default, so the same dataset samples the same way in ``chat`` and ``generate`` mode; to any
other OpenAI-style server (llama.cpp, vLLM, ...), only the fields that are set: SGLang's
defaults are not everyone's (llama.cpp refuses ``top_k: -1`` with a validation error).
"""

from __future__ import annotations

import difflib
import json
import logging
from pathlib import Path
from typing import Any

from budgetq.shared.errors import ConfigError
from budgetq.shared.schema import SamplingParams
from budgetq.shared.sglang_names import (
    CHAT_REQUEST_KEYS,
    GENERATE_CONTRACT_SAMPLING_KEYS,
    GENERATE_SAMPLING_KEYS,
    SGLANG_VERSION,
)

log = logging.getLogger("budgetq.sampling")

# SGLang's value when a field is unset and the model gives none (SamplingParams.__post_init__).
NEUTRAL: dict[str, float | int] = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0,
                                   "repetition_penalty": 1.0}

# Request keys budgetq sets itself, per API: where each belongs in the config instead.
_OWNED = {
    "generate": {"max_new_tokens": "sampling.max_tokens", "temperature": "sampling.temperature",
                 "top_p": "sampling.top_p", "top_k": "sampling.top_k", "min_p": "sampling.min_p",
                 "repetition_penalty": "sampling.repetition_penalty", "stop": "sampling.stop",
                 "sampling_seed": "sampling.seed",
                 "n": "samples: N (budgetq sends one request per answer: n must stay 1)"},
    "chat": {"max_tokens": "sampling.max_tokens", "max_completion_tokens": "sampling.max_tokens",
             "temperature": "sampling.temperature", "top_p": "sampling.top_p", "top_k": "sampling.top_k",
             "min_p": "sampling.min_p", "repetition_penalty": "sampling.repetition_penalty",
             "stop": "sampling.stop", "seed": "sampling.seed", "messages": "the dataset's rows",
             "model": "server.model", "rid": "nothing (budgetq sets a fresh rid per attempt)",
             "stream": "nothing (budgetq does not stream)", "stream_options": "nothing (budgetq does not stream)",
             "chat_template_kwargs": "the dataset's chat_template_kwargs",
             "n": "samples: N (budgetq sends one request per answer: n must stay 1)",
             "input_ids": "nothing (use server.api: generate to send token ids)"},
}
# The same option under the other API's (or another tool's) name.
_RENAMED = {
    "generate": {"min_tokens": "min_new_tokens", "max_tokens": "sampling.max_tokens",
                 "max_completion_tokens": "sampling.max_tokens", "seed": "sampling.seed",
                 "stop_sequences": "sampling.stop"},
    "chat": {"min_new_tokens": "min_tokens", "max_new_tokens": "sampling.max_tokens",
             "sampling_seed": "sampling.seed", "stop_sequences": "sampling.stop"},
}
# /generate: a key must pass its JSON contract gate and be a SamplingParams field (the
# internal fields __init__ also takes are refused by the gate).
_ACCEPTED = {"generate": GENERATE_SAMPLING_KEYS & GENERATE_CONTRACT_SAMPLING_KEYS, "chat": CHAT_REQUEST_KEYS}
_ROUTE = {"generate": "/generate sampling_params", "chat": "/v1/chat/completions"}


def extra_key_errors(api: str, extra: dict[str, Any]) -> list[str]:
    """One message per key of ``sampling.extra`` that SGLang's ``api`` would reject or ignore."""
    errors = []
    for key in extra:
        where = f"sampling.extra.{key}"
        if key in _OWNED[api]:
            errors.append(f"{where}: budgetq sets {key!r} itself on server.api {api!r}: use {_OWNED[api][key]}")
        elif key in _RENAMED[api]:
            new = _RENAMED[api][key]
            hint = new if new.startswith("sampling.") else f"sampling.extra.{new}"
            errors.append(f"{where}: SGLang {SGLANG_VERSION} {_ROUTE[api]} has no {key!r}: use {hint}")
        elif key not in _ACCEPTED[api]:
            close = difflib.get_close_matches(key, sorted(_ACCEPTED[api] | set(_OWNED[api])), n=1, cutoff=0.75)
            hint = ""
            if close:
                hint = f" (did you mean {_OWNED[api].get(close[0], 'sampling.extra.' + close[0])}?)"
            effect = "rejects every request (400)" if api == "generate" else "ignores it silently"
            errors.append(f"{where}: SGLang {SGLANG_VERSION} {_ROUTE[api]} has no {key!r} and {effect}{hint}")
    return errors


def generation_defaults(tokenizer: str | None) -> tuple[dict[str, Any], str]:
    """The model's generation_config.json sampling values next to the tokenizer, and where from.

    A local directory is read directly; a hub id goes through transformers (network, cached).
    Anything unreadable means "no model defaults", with a warning: never a failed run.
    """
    if not tokenizer:
        return {}, ""
    path = Path(tokenizer) / "generation_config.json"
    try:
        if Path(tokenizer).is_dir():
            if not path.exists():
                return {}, ""
            raw = json.loads(path.read_text(encoding="utf-8"))
            source = str(path)
        else:
            from transformers import GenerationConfig

            raw = GenerationConfig.from_pretrained(tokenizer).to_dict()
            source = f"{tokenizer} generation_config.json"
    except Exception as exc:  # noqa: BLE001 - missing file, bad JSON, hub unreachable: fall back
        log.warning("server.tokenizer %r: cannot read generation_config.json (%s): SGLang's neutral "
                    "sampling defaults are used for unset fields", tokenizer, exc)
        return {}, ""
    if not isinstance(raw, dict):
        return {}, ""
    found = {k: raw[k] for k in NEUTRAL if raw.get(k) is not None}
    return found, source


def resolve(sp: SamplingParams, model_defaults: dict[str, Any],
            source: str = "") -> tuple[SamplingParams, dict[str, str]]:
    """``sp`` with every parity field the config or the model sets, and where each came from (for
    the log); the others stay None (the worker fills SGLang's neutral value for SGLang only)."""
    values: dict[str, Any] = {}
    origin: dict[str, str] = {}
    for key, neutral in NEUTRAL.items():
        if getattr(sp, key) is not None:
            values[key], origin[key] = getattr(sp, key), "config"
        elif key in model_defaults:
            values[key], origin[key] = model_defaults[key], source or "model generation_config.json"
        else:
            values[key], origin[key] = None, f"unset: the server's default, SGLang's is {neutral}"
    return sp.model_copy(update=values), origin


def explicit(sp: SamplingParams, sglang: bool = True) -> dict[str, Any]:
    """The parity fields the worker sends: to SGLang all of them, SGLang's neutral default for any
    left unset; to another server only the ones that are set."""
    if not sglang:
        return {k: getattr(sp, k) for k in NEUTRAL if getattr(sp, k) is not None}
    return {k: (getattr(sp, k) if getattr(sp, k) is not None else v) for k, v in NEUTRAL.items()}


def resolve_datasets(datasets: list[Any], tokenizer: str | None) -> None:
    """Resolve every dataset's sampling in place (the producer, once at start) and log where
    each value came from, so a user sees which model defaults were honoured."""
    model_defaults, source = generation_defaults(tokenizer)
    for ds in datasets:
        ds.sampling, origin = resolve(ds.sampling, model_defaults, source)
        samples = getattr(ds, "samples", 1)
        greedy = [k for k in ("temperature", "top_k")
                  if origin[k] != "config" and getattr(ds.sampling, k) == {"temperature": 0, "top_k": 1}[k]]
        if getattr(ds, "answers_max", 1) > 1 and greedy:
            # the config check (shared/config.py) saw no greedy value: the model's defaults bring one
            raise ConfigError(f"dataset {ds.name}: samples: {samples} with {greedy[0]} "
                              f"{getattr(ds.sampling, greedy[0])} from {origin[greedy[0]]} (greedy decoding) writes "
                              f"{ds.answers_max} identical answers per prompt: set sampling.{greedy[0]} or samples: 1")
        log.info("dataset %s: sampling: %s", ds.name, sampling_summary(ds.sampling, origin))
        log.debug("dataset %s: sampling %s", ds.name,
                  ", ".join(f"{k}={getattr(ds.sampling, k)} ({origin[k]})" for k in NEUTRAL))


def sampling_summary(sp: SamplingParams, origin: dict[str, str]) -> str:
    """One short line of what an operator needs: the values set and where each came from, and
    which are left to the server (``temperature=0.7 (config); server defaults: top_p, top_k, ...``).
    The long form, with SGLang's neutral values, is at DEBUG."""
    by_origin: dict[str, list[str]] = {}
    unset = []
    for key in NEUTRAL:
        if getattr(sp, key) is None:
            unset.append(key)
        else:
            by_origin.setdefault(origin[key], []).append(f"{key}={getattr(sp, key)}")
    if not by_origin:
        return "the server's defaults (none set by the config or the model)"
    parts = [f"{', '.join(values)} ({where})" for where, values in by_origin.items()]
    if unset:
        parts.append("server defaults: " + ", ".join(unset))
    return "; ".join(parts)
