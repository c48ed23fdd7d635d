"""The producer's tokenizer: apply the model's chat template locally, count and bound prompt tokens.

api=generate sends the resulting ``input_ids`` to SGLang's /generate; api=chat only uses the
count (the server applies its own template), so over-long prompts are recorded invalid here
instead of failing on the server.
"""

from __future__ import annotations

from budgetq.shared.chat_template import encode_chat, load_tokenizer
from budgetq.shared.config import DatasetConfig, ServerConfig
from budgetq.shared.errors import ConfigError
from budgetq.shared.schema import Message


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
        return encode_chat(self.tokenizer, messages, self.kwargs)

    def conversation_tokens(self, first: list[Message], turns: list[Message]) -> tuple[list[int], int, int]:
        """regenerate: all: (ids of the first request, prompt tokens of every request without
        the answers, prompt tokens of the last request without the answers).

        Request k's prompt is the first prompt, then per earlier turn the model's answer and the
        next user turn. The answers are not known yet, so each stands as an empty assistant turn
        here: what is left is exact, and the answers are added where they are known (the worker's
        reservation adds an allowance per earlier answer, the server reports the real counts).
        """
        ids = self.encode(first)
        total = last = len(ids)
        ctx = list(first)
        for turn in turns:
            ctx += [Message(role="assistant", content=""), turn]
            last = len(self.encode(ctx))
            total += last
        return ids, total, last

    def too_long(self, prompt_tokens: int) -> str | None:
        """Why a prompt of this many tokens cannot be sent, or None if it fits."""
        if self.max_prompt_tokens is not None and prompt_tokens > self.max_prompt_tokens:
            return f"prompt has {prompt_tokens} tokens, more than max_prompt_tokens {self.max_prompt_tokens}"
        if self.context_length is not None and prompt_tokens > self.context_length - self.max_tokens:
            room = self.context_length - self.max_tokens
            return (f"prompt has {prompt_tokens} tokens, more than the {room} that server.context_length "
                    f"{self.context_length} leaves after sampling.max_tokens {self.max_tokens}")
        return None
