"""The ``server:`` section of the configuration (shared/config.py holds the rest of the model)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from budgetq.shared.config_fields import Strict, TokenCount


class ServerConfig(Strict):
    urls: list[str] = Field(default_factory=lambda: ["http://127.0.0.1:30000"], min_length=1)
    # chat = /v1/chat/completions (the server applies the chat template);
    # generate = /generate with input_ids from `tokenizer` (applied here, counted here).
    api: Literal["chat", "generate"] = "chat"
    # The "model" field of chat requests. None: SGLang gets "default" (it serves one model under any
    # name); another server (vLLM, llama.cpp) the one id its /v1/models lists, per endpoint; several
    # ids there stop the worker and `budgetq check` with one line (shared/server_kind.py).
    model: str | None = None
    # Never logged or put in job payloads: workers read it from their own config/env.
    api_key: str | None = Field(default=None, repr=False)
    timeout_s: float = Field(default=3600.0, gt=0)
    connect_timeout_s: float = Field(default=10.0, gt=0)
    # When budgetq gives up a request the server may still be running (budget crossed, job
    # cancelled, timeout), also POST /abort_request for its rid: SGLang notices a dropped
    # non-streaming client only at its next ~4 s poll and generates until then. Turn off only
    # for a gateway that does not route /abort_request.
    abort_on_cancel: bool = True
    # Transient failures (connection errors, timeouts, 408/429/5xx) are retried this many
    # times in all, with exponential backoff and jitter between backoff_base_s and backoff_max_s.
    max_attempts: int = Field(default=6, ge=1)
    backoff_base_s: float = Field(default=0.5, gt=0)
    backoff_max_s: float = Field(default=30.0, gt=0)
    # An endpoint failing this many times in a row is taken out until its /health answers.
    eject_after_failures: int = Field(default=3, ge=1)
    health_interval_s: float = Field(default=2.0, gt=0)
    # Tokenizer (local path or hub id) for api=generate and for counting prompt tokens.
    tokenizer: str | None = None
    # The model's context length; prompts with more than context_length - max_tokens tokens
    # are recorded invalid instead of failing on the server (needs tokenizer to count). None:
    # what the servers say (/v1/models max_model_len) when `budgetq produce` starts, if they answer.
    context_length: int | None = Field(default=None, gt=0)
    # Prompts (every message sent, UTF-8) over this many bytes are recorded invalid by the producer
    # instead of going through Redis to a server that refuses the body (HTTP 413). Accepts 8M-style counts.
    max_prompt_bytes: TokenCount = 8_000_000
    # Which endpoint a request goes to (worker/endpoints.py). least_loaded: fewest in flight.
    # prefix: requests whose first prefix_chars characters (of the rendered messages; input_ids:
    # prefix_chars / 4 tokens) match go to the same endpoint, so its radix cache holds the shared
    # prefix, while no endpoint holds more than prefix_balance x the least-loaded one's in flight (+2).
    routing: Literal["least_loaded", "prefix"] = "least_loaded"
    prefix_chars: int = Field(default=1024, ge=16)
    prefix_balance: float = Field(default=1.25, gt=1.0)
    # Stream answers (SSE): exact tokens so far for the end game, and a guard can cut a loop at the
    # engine. false: one JSON answer per request, for a server or gateway that cannot stream (docs/sglang.md).
    stream: bool = True

    @model_validator(mode="after")
    def _check_urls(self) -> ServerConfig:
        for url in self.urls:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"server.urls: {url!r} is not an http(s) URL")
        self.urls = [u.rstrip("/") for u in self.urls]
        if self.api == "generate" and not self.tokenizer:
            raise ValueError("server.api 'generate' needs server.tokenizer (a local path or hub id)")
        return self
