"""The model's chat template, applied locally: shared by the producer and the worker.

The producer tokenizes every prompt (api=generate sends the ids, counting needs them); the
worker needs the same template only for ``regenerate: all`` with api=generate, where each
later turn's input_ids hold the model's own earlier answers, known only once they are
generated (worker/turns.py). One function so both sides render a conversation identically.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Mapping
from typing import Any

from budgetq.shared.errors import ConfigError
from budgetq.shared.schema import Message

# The worker loads from threads, several jobs at once; transformers' lazy imports are not
# safe to race ("cannot import name 'AutoTokenizer'"), and one load is enough anyway.
_LOADING = threading.Lock()


def load_tokenizer(path: str) -> Any:
    """AutoTokenizer for a local path or hub id, loaded once per process (thread-safe)."""
    with _LOADING:
        return _load(path)


@functools.lru_cache(maxsize=8)
def _load(path: str) -> Any:
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(path)
    except Exception as exc:  # noqa: BLE001 - transformers raises OSError, ValueError, HF errors...
        raise ConfigError(f"server.tokenizer: cannot load a tokenizer from {path!r}: {exc}") from exc
    if not getattr(tok, "chat_template", None):
        raise ConfigError(f"server.tokenizer: {path!r} has no chat template (tokenizer_config.json "
                          "chat_template or chat_template.jinja)")
    return tok


def encode_chat(tokenizer: Any, messages: list[Message], kwargs: Mapping[str, Any]) -> list[int]:
    """The chat template applied with a generation prompt, as token ids."""
    out = tokenizer.apply_chat_template([m.model_dump() for m in messages], add_generation_prompt=True,
                                        tokenize=True, **kwargs)
    # transformers 5 returns a BatchEncoding by default, 4.x a plain list.
    ids = out["input_ids"] if isinstance(out, Mapping) else out
    return [int(i) for i in ids]
