"""Job payloads (producer -> worker) and output rows (worker -> collector), as JSON."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str


class SamplingParams(BaseModel):
    """Per-dataset sampling; the same model is the config block and the job payload field."""

    model_config = ConfigDict(extra="forbid")
    max_tokens: int = Field(default=8192, gt=0)
    temperature: float = Field(default=0.7, ge=0)
    top_p: float = Field(default=1.0, gt=0, le=1)
    top_k: int | None = None
    min_p: float | None = Field(default=None, ge=0, le=1)
    stop: list[str] | None = None
    seed: int | None = None
    # Anything else SGLang accepts (e.g. repetition_penalty), passed through unchanged.
    extra: dict[str, Any] = Field(default_factory=dict)


class JobPayload(BaseModel):
    """What one RQ job carries. Holds no secret: workers know the server and its key."""

    model_config = ConfigDict(extra="forbid")
    id: str
    dataset: str
    messages: list[Message]
    # api=generate: the chat template applied by the producer's tokenizer.
    input_ids: list[int] | None = None
    # Known when the producer tokenized the prompt (used for count=total reservations).
    prompt_tokens: int | None = None
    sampling: SamplingParams
    # api=chat: passed to the server's chat template (e.g. {"enable_thinking": false}).
    chat_template_kwargs: dict[str, Any] | None = None
    # Where a reasoning model's thinking goes in the output row (see DatasetConfig.thinking).
    thinking: Literal["separate", "inline", "drop"] = "separate"


class ResultRow(BaseModel):
    """One line of out/<dataset>.jsonl (SpecForge-compatible ``conversations``)."""

    id: str
    dataset: str
    conversations: list[Message]
    # The server's reasoning parser output (thinking), kept apart from the answer.
    reasoning_content: str | None = None
    prompt_tokens: int
    completion_tokens: int
    finish_reason: Literal["stop", "length", "abort", "tool_calls"] | str
    model: str
    endpoint: str
    latency_s: float

