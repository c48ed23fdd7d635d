"""The field types and the strict base every section of the config model uses."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict

from budgetq.shared.tokens import parse_tokens

TokenCount = Annotated[int, BeforeValidator(parse_tokens)]


def positive_budget(tokens: int) -> int:
    """A budget is above 0: a 0 budget would admit nothing and end the dataset at once, which
    is what `budgetq pause` is for (and pause can be undone without knowing the old budget)."""
    if tokens <= 0:
        raise ValueError(f"a budget must be above 0 (got {tokens}); to stop a dataset, pause it: budgetq pause NAME")
    return tokens


def _budget(value: Any) -> int:
    return positive_budget(parse_tokens(value))


Budget = Annotated[int, BeforeValidator(_budget)]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")
