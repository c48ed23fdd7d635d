"""Job payloads (producer -> worker) and output rows (worker -> collector), as JSON."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializationInfo,
    SerializerFunctionWrapHandler,
    StrictInt,
    field_validator,
    model_serializer,
    model_validator,
)


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str


class SamplingParams(BaseModel):
    """Per-dataset sampling; the same model is the config block and the job payload field.

    temperature, top_p, top_k, min_p and repetition_penalty left unset (null) are filled by the
    producer from the model's generation_config.json, else SGLang's defaults, and then sent
    explicitly on both APIs (shared/sampling.py says why). Ranges are SGLang's
    ``SamplingParams.verify()``: a value the server would reject fails at config load.
    """

    model_config = ConfigDict(extra="forbid")
    max_tokens: int = Field(default=8192, gt=0)
    temperature: float | None = Field(default=None, ge=0, allow_inf_nan=False)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = None
    min_p: float | None = Field(default=None, ge=0, le=1)
    repetition_penalty: float | None = Field(default=None, gt=0, le=2)
    stop: list[str] | None = None
    seed: int | None = Field(default=None, ge=-(2**63), le=2**63 - 1)
    # Anything else the chosen API accepts (e.g. min_new_tokens on /generate, min_tokens on
    # chat), checked against SGLang's own names at config load (shared/sampling.py).
    extra: dict[str, Any] = Field(default_factory=dict)

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, v: int | None) -> int | None:
        if v is not None and v != -1 and v < 1:
            raise ValueError(f"top_k must be -1 (whole vocabulary) or at least 1, got {v}")
        return v


class JobPayload(BaseModel):
    """What one RQ job carries. Holds no secret: workers know the server and its key."""

    model_config = ConfigDict(extra="forbid")
    # The dataset's id as the output row keeps it: a string, or an integer (never coerced: "12"
    # stays a string). Job ids use its string form (shared/identity.py id_text).
    id: StrictInt | str
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
    # regenerate: all: the later user turns, asked one after another once ``messages`` (the
    # system prompt and the first user turn) is answered, each with the model's own earlier
    # answers as context (worker/turns.py). None: one request (a single turn or regenerate: last).
    turns: list[Message] | None = None
    # features.vllm.single_pass: the directory where the engine writes this request's hidden states
    # (``kv_transfer_params``); the worker names the file per attempt. None: a plain generation request.
    hidden_states_dir: str | None = None
    # samples > 1: which answer of its prompt this job is (1-based; ``id`` is then the answer id,
    # shared/identity.py answer_id). None: the dataset's one answer per prompt.
    sample: int | None = Field(default=None, ge=1)

    @field_validator("turns")
    @classmethod
    def _user_turns(cls, v: list[Message] | None) -> list[Message] | None:
        if v is None:
            return None
        if not v:
            raise ValueError("turns, when set, must hold at least one user turn (leave it out for one request)")
        for i, m in enumerate(v):
            if m.role != "user":
                raise ValueError(f"turns[{i}] has role {m.role!r}: only user turns are asked")
            if not m.content.strip():
                raise ValueError(f"turns[{i}] is an empty user turn")
        return v

    @model_validator(mode="after")
    def _first_request(self) -> JobPayload:
        if self.turns is not None and (not self.messages or self.messages[-1].role != "user"):
            raise ValueError("with turns, messages must end with the first user turn")
        return self

    @property
    def requests(self) -> int:
        """How many requests this job sends: one per user turn still to answer."""
        return 1 + len(self.turns or ())


class ResultRow(BaseModel):
    """One line of out/<dataset>.jsonl, in SpecForge's regenerated-data layout.

    The layout of SpecForge's scripts/regenerate_train_data.py, checked by its
    scripts/validate_regenerated_data.py (``validate_row``): ``conversations`` ends with the
    generated assistant message, which carries the server's reasoning as its own
    ``reasoning_content`` (thinking: separate; where SpecForge's ThinkingParser and chat
    templates read it), and ``status`` is "success". No top-level reasoning copy: one place only.
    With regenerate: all every assistant message is generated (each with its own
    reasoning_content), prompt_tokens and completion_tokens are summed over the requests,
    finish_reason is the last request's, and ``turns`` lists each request's counts.
    """

    # The key (string form) of the dataset's id; ``int_id``: the dataset gave an integer, and the
    # file holds it as one ("id": 12). Reading a row back gives the key again, so every reader
    # (collector, reconcile, exports, features) compares ids the one way.
    id: str
    int_id: bool = Field(default=False, exclude=True)
    dataset: str
    conversations: list[Message]
    # SpecForge's validator accepts only "success"; a row budgetq writes is always one
    # (failures never reach the results file).
    status: Literal["success"] = "success"
    prompt_tokens: int
    completion_tokens: int
    finish_reason: Literal["stop", "length", "abort", "tool_calls"] | str
    model: str
    endpoint: str
    latency_s: float
    # regenerate: all only (None otherwise, left out of the file): one entry per request, in
    # order: {"prompt_tokens", "completion_tokens", "finish_reason"}.
    turns: list[dict[str, Any]] | None = None
    # features.vllm.single_pass: the file the engine wrote this answer's hidden states to (prompt + answer,
    # but the last sampled token); its features job stores it instead of prefilling again. Left out when None.
    hidden_states_file: str | None = None
    # samples > 1: which answer of its prompt this row is (1-based); ``id`` is the answer id, the
    # prompt's id with ``#<sample>`` for sample 2 on. Left out when None (samples: 1).
    sample: int | None = None

    @model_validator(mode="before")
    @classmethod
    def _integer_id(cls, data: Any) -> Any:
        if isinstance(data, dict) and isinstance(data.get("id"), int) and not isinstance(data["id"], bool):
            return {**data, "id": str(data["id"]), "int_id": True}
        return data

    @model_serializer(mode="wrap")
    def _leave_out_turns(self, handler: SerializerFunctionWrapHandler, info: SerializationInfo) -> dict[str, Any]:
        """A single-request row is written as before: no ``turns`` key at all. An integer id is
        written as an integer in JSON (the file); Python dumps keep the key (a string)."""
        out: dict[str, Any] = handler(self)
        for key in ("turns", "hidden_states_file", "sample"):
            if key in out and out[key] is None:
                del out[key]
        if self.int_id and info.mode_is_json() and "id" in out:
            out["id"] = int(self.id)
        return out

    @property
    def reasoning(self) -> str | None:
        """The generated answer's reasoning (None when there is none or it was dropped/inlined)."""
        return getattr(self.conversations[-1], "reasoning_content", None) if self.conversations else None
