"""A dataset's ``guard:`` and ``gates:`` sections: what the worker refuses to keep (docs/datasets.md
"Guard and gates"). The guard cuts a streamed answer that fell into an exact loop
(worker/degeneration.py); the gates judge finished answers (worker/quality.py)."""

from __future__ import annotations

import importlib.util
import re
from typing import Annotated, Any

from pydantic import BeforeValidator, Field, field_validator

from budgetq.shared.config_fields import Strict

# module.path:function, as a console_scripts entry point names one.
_VALIDATOR = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*")


class GuardConfig(Strict):
    """The degeneration guard: an answer (or its reasoning) whose tail is one exact cycle, repeated
    long enough that ordinary text does not (the defaults: 0 false positives on the corpus of
    tests/test_guard_corpus.py), is aborted at the engine and discarded as ``loop``.

    A cycle is cut once it covers at least ``min_span_tokens`` tokens *and* ``min_repeats`` periods:
    a one-token loop (``the the the``) after 384 tokens, a 300-token loop after 4 x 300 = 1200.
    Tables, lists and code repeat a line a few times, never hundreds of tokens of one exact cycle."""

    enabled: bool = True
    # Longest cycle looked for, in tokens (the reports: 1 to a few hundred).
    max_period_tokens: int = Field(default=300, ge=1, le=4096)
    # The repeated stretch must cover this many tokens ...
    min_span_tokens: int = Field(default=384, ge=16, le=1_000_000)
    # ... and hold the cycle this many times in a row.
    min_repeats: int = Field(default=4, ge=2, le=100_000)


class GatesConfig(Strict):
    """Checks on every finished answer; a failed one discards the answer with its reason."""

    # No content and no reasoning (nothing to train on).
    empty: bool = True
    # Reasoning that never closed (a <think> without </think>, or reasoning and no answer after it).
    unclosed_reasoning: bool = True
    # <think> / </think> left in the answer's content (the reasoning parser missed them).
    think_tags: bool = True
    # "module:function" called as function(row) with the row as written to out/<ds>.jsonl (a dict);
    # it returns a reason (str) to discard the answer, or None to keep it. Runs in the worker.
    validator: str | None = None
    # Seconds its import, and each call, may take: one past it fails the job (import) or discards the answer
    # (call) with that reason; the worker never waits on it (it runs in a thread of its own).
    validator_timeout_s: float = Field(default=60.0, gt=0, le=86_400)

    @field_validator("validator")
    @classmethod
    def _check_validator(cls, value: str | None) -> str | None:
        if value is not None and not _VALIDATOR.fullmatch(value):
            raise ValueError(f"validator {value!r} is not module:function (e.g. mychecks:no_refusals)")
        return value


def validator_module_missing(spec: str) -> str | None:
    """The module of ``gates.validator`` when this process cannot find it (``budgetq check`` and
    ``produce`` say so: the workers, where it runs, need it), else None. Found, not imported: a
    module is not run in the producer for a check."""
    module = spec.partition(":")[0]
    try:
        return None if importlib.util.find_spec(module) is not None else module
    except (ImportError, ValueError):
        return module


def validator_warnings(dataset: str, spec: str | None) -> list[str]:
    """``produce``'s start-up warning for a validator this process cannot find."""
    missing = validator_module_missing(spec) if spec else None
    return [f"dataset {dataset}: gates.validator {spec}: {missing} is not importable here; a worker that cannot "
            "import it fails each job before sending it"] if missing else []


def guard_shorthand(value: Any) -> Any:
    """``guard: off`` (YAML reads it as False) / ``guard: on`` / true / false: the guard off or on with
    its defaults, in one line."""
    if isinstance(value, bool):
        return {"enabled": value}
    if isinstance(value, str) and value.lower() in ("off", "on"):
        return {"enabled": value.lower() == "on"}
    return value


def gates_shorthand(value: Any) -> Any:
    """``gates: off`` turns every built-in gate off (and no validator); ``gates: on`` the defaults."""
    if isinstance(value, bool) or (isinstance(value, str) and value.lower() in ("off", "on")):
        on = value is True or (isinstance(value, str) and value.lower() == "on")
        return {"empty": on, "unclosed_reasoning": on, "think_tags": on}
    return value


Guard = Annotated[GuardConfig, BeforeValidator(guard_shorthand)]
Gates = Annotated[GatesConfig, BeforeValidator(gates_shorthand)]
