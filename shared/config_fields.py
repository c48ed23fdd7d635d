"""The field types and the strict base every section of the config model uses."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict

from budgetq.shared.tokens import parse_signed_tokens, parse_tokens, shown

TokenCount = Annotated[int, BeforeValidator(parse_tokens)]


def positive_budget(tokens: int, given: int | float | str | None = None) -> int:
    """A budget is above 0: a 0 budget would admit nothing and end the dataset at once, which
    is what `budgetq pause` is for (and pause can be undone without knowing the old budget).
    ``given``: the value as written, named in the message (else ``tokens``)."""
    if tokens <= 0:
        raise ValueError(f"a budget must be above 0 (got {shown(tokens if given is None else given)}); "
                         "to stop a dataset, pause it: budgetq pause NAME")
    return tokens


def parse_budget(value: int | float | str) -> int:
    """A budget as written (10M, 2.5k, 10_000_000): 0 and below are one mistake with one message,
    whether the config or `budget set` says it."""
    return positive_budget(parse_signed_tokens(value), value)


Budget = Annotated[int, BeforeValidator(parse_budget)]


def parse_total(value: int | float | str) -> int:
    """A total budget as written: above 0, like a dataset's (0 would end every dataset at once)."""
    tokens = parse_signed_tokens(value)
    if tokens <= 0:
        raise ValueError(f"a total budget must be above 0 (got {shown(value)}); for no total, leave "
                         "run.total_budget out (budgetq budget total none)")
    return tokens


TotalBudget = Annotated[int, BeforeValidator(parse_total)]


def yaml_bools(false: str, true: str) -> BeforeValidator:
    """For a Literal field with a word YAML 1.1 reads as a boolean: ``progress: off`` arrives as
    False (so do no/false; on/yes/true as True). Take the boolean as the word meant, rather than
    refusing the user's plain YAML with "(got False)"."""
    def convert(value: Any) -> Any:
        if isinstance(value, bool):
            return true if value else false
        return value
    return BeforeValidator(convert)


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")
