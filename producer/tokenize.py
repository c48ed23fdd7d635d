"""The producer's tokenizer: apply the model's chat template locally, count and bound prompt tokens.

api=generate sends the resulting ``input_ids`` to SGLang's /generate; api=chat only uses the
count (the server applies its own template), so over-long prompts are recorded invalid here
instead of failing on the server.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

from shared.config import DatasetConfig, ServerConfig
from shared.errors import ConfigError
from shared.schema import Message


@functools.lru_cache(maxsize=8)
def load_tokenizer(path: str) -> Any:
    """AutoTokenizer for a local path or hub id, loaded once per process."""
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(path)
    except Exception as exc:  # noqa: BLE001 - transformers raises OSError, ValueError, HF errors...
        raise ConfigError(f"server.tokenizer: cannot load a tokenizer from {path!r}: {exc}") from exc
    if not getattr(tok, "chat_template", None):
        raise ConfigError(f"server.tokenizer: {path!r} has no chat template (tokenizer_config.json "
                          "chat_template or chat_template.jinja)")
    return tok


class PromptEncoder:
    """Chat template + token limits of one dataset under one server config."""

    def __init__(self, ds: DatasetConfig, server: ServerConfig, tokenizer_path: str) -> None:
        self.tokenizer = load_tokenizer(tokenizer_path)
        self.kwargs = dict(ds.chat_template_kwargs)
        self.send_ids = server.api == "generate"
        self.max_prompt_tokens = ds.max_prompt_tokens
        self.context_length = server.context_length
        self.max_tokens = ds.max_tokens
        if self.context_length is not None and self.context_length <= self.max_tokens:
            raise ConfigError(f"dataset {ds.name}: server.context_length {self.context_length} leaves no room "
                              f"for a prompt with sampling.max_tokens {self.max_tokens}")

    @classmethod
    def for_dataset(cls, ds: DatasetConfig, server: ServerConfig) -> PromptEncoder | None:
        """None when no tokenizer is configured (api=chat without counting)."""
        if server.tokenizer:
            return cls(ds, server, server.tokenizer)
        if ds.max_prompt_tokens is not None:
            raise ConfigError(f"dataset {ds.name}: max_prompt_tokens needs server.tokenizer to count tokens")
        return None

    def encode(self, messages: list[Message]) -> list[int]:
        """The chat template applied with a generation prompt, as token ids."""
        out = self.tokenizer.apply_chat_template([m.model_dump() for m in messages], add_generation_prompt=True,
                                                 tokenize=True, **self.kwargs)
        # transformers 5 returns a BatchEncoding by default, 4.x a plain list.
        ids = out["input_ids"] if isinstance(out, Mapping) else out
        return [int(i) for i in ids]

    def too_long(self, prompt_tokens: int) -> str | None:
        """Why a prompt of this many tokens cannot be sent, or None if it fits."""
        if self.max_prompt_tokens is not None and prompt_tokens > self.max_prompt_tokens:
            return f"prompt has {prompt_tokens} tokens, more than max_prompt_tokens {self.max_prompt_tokens}"
        if self.context_length is not None and prompt_tokens > self.context_length - self.max_tokens:
            room = self.context_length - self.max_tokens
            return (f"prompt has {prompt_tokens} tokens, more than the {room} that server.context_length "
                    f"{self.context_length} leaves after sampling.max_tokens {self.max_tokens}")
        return None
