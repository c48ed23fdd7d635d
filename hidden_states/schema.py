"""What a features job carries (producer -> worker) and what its result says (worker -> collector), as JSON."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

FeaturesDtype = Literal["float16", "bfloat16", "fp8"]


def wire_dtype(dtype: str) -> str:
    """What a capture backend hands over for a stored dtype: fp8 is made from bf16 where the shard is written
    (hidden_states/store/fp8.py), so backends and the results stream carry bf16 for it."""
    return "bfloat16" if dtype == "fp8" else dtype


class FeaturesPayload(BaseModel):
    """One committed row to prefill: the whole conversation (the generated answer included) as
    token ids, through the same chat template, and where the answer's tokens are (the loss span)."""

    model_config = ConfigDict(extra="forbid")
    id: str
    dataset: str
    input_ids: list[int] = Field(min_length=1)
    loss_start: int = Field(ge=0)
    loss_end: int = Field(ge=0)
    dtype: FeaturesDtype = "bfloat16"
    # features.vllm.single_pass: the file the engine wrote during the row's generation request (the row's
    # hidden_states_file); the vllm backend stores it instead of prefilling, where its tokens agree.
    engine_file: str | None = None

    @model_validator(mode="after")
    def _span(self) -> FeaturesPayload:
        if not self.loss_start <= self.loss_end <= len(self.input_ids):
            raise ValueError(f"loss span [{self.loss_start}, {self.loss_end}) is outside the "
                             f"{len(self.input_ids)} input ids")
        return self

    def loss_mask(self) -> list[int]:
        n = len(self.input_ids)
        return [0] * self.loss_start + [1] * (self.loss_end - self.loss_start) + [0] * (n - self.loss_end)


class FeaturesMeta(FeaturesPayload):
    """The ``meta`` field of a features results-stream entry; ``data`` holds the tensor's bytes, or, with
    features.store, ``shard`` names the file the worker wrote (an index message: no bytes in Redis)."""

    shape: list[int]
    # Set when an aux server answered too (features.server.aux_urls): the stream entry's ``aux`` field.
    aux_shape: list[int] | None = None
    endpoint: str = ""
    # features.store: the worker wrote the sample's shard itself (this file name, in the dataset's features
    # directory, this many bytes); the stream entry then carries no tensor bytes, only this message.
    shard: str | None = None
    shard_bytes: int | None = None
    # The sample's hidden states come from its generation request (features.vllm.single_pass), not a prefill.
    from_generation: bool = False
