"""Quality gates on finished answers: each refuses an answer with a named reason, and the answer
then goes to out/<ds>.discarded.jsonl instead of the dataset (commit.lua's DISCARDED state).

Reasons, checked in this order (the first one found is the answer's):
  empty               no content and no reasoning
  unclosed_reasoning  reasoning that never closed: an inline ``<think>`` without ``</think>``, or
                      reasoning (from the server's parser) and no answer after it
  think_tags          ``<think>`` or ``</think>`` left in the answer's content
  loop                the answer's (or reasoning's) tail is an exact cycle (worker/degeneration.py):
                      for answers that were not streamed, or ended between two checks of the stream
  validator:<text>    the dataset's ``gates.validator`` (module:function) returned <text>

The user's validator is imported once per process (and by the producer at start, so a wrong name
stops ``budgetq produce`` / ``budgetq check`` with one line before anything is generated).
"""

from __future__ import annotations

import functools
import importlib
import json
import logging
from collections.abc import Callable
from typing import Any

from budgetq.shared.config_quality import GatesConfig, GuardConfig
from budgetq.worker import degeneration
from budgetq.worker.sglang_wire import Completion, split_thinking

log = logging.getLogger("budgetq.worker")

Validator = Callable[[dict[str, Any]], "str | None"]
# A validator's reason is kept to this many characters (it is a reason, not a report).
REASON_CHARS = 200


class ValidatorError(Exception):
    """The dataset's validator cannot be used: one line naming it and why."""


@functools.lru_cache(maxsize=32)
def load_validator(spec: str) -> Validator:
    """``module:function`` imported once per process; ValidatorError (one line) when it cannot be."""
    module_name, _, func_name = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:   # an ImportError, or anything the module raises at import
        raise ValidatorError(f"gates.validator {spec}: cannot import {module_name}: "
                             f"{type(exc).__name__}: {_one_line(exc)}") from None
    func = getattr(module, func_name, None)
    if not callable(func):
        raise ValidatorError(f"gates.validator {spec}: {module_name} has no function {func_name}")
    return func


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())[:REASON_CHARS] or type(exc).__name__


def settings(quality_json: str) -> tuple[GuardConfig, GatesConfig, int]:
    """The conf's ``quality`` JSON (shared/budget.py quality_json) as (guard, gates, retry_discarded);
    "" or a bad value (a dataset registered by an older producer): the defaults."""
    return _settings(quality_json)


@functools.lru_cache(maxsize=64)
def _settings(raw: str) -> tuple[GuardConfig, GatesConfig, int]:
    try:
        data = json.loads(raw) if raw else {}
        guard = GuardConfig.model_validate(data.get("guard") or {})
        gates = GatesConfig.model_validate(data.get("gates") or {})
        retry = int(data.get("retry_discarded") or 0)
    except (ValueError, TypeError, AttributeError) as exc:
        log.warning("the dataset's quality settings are unreadable (%s): the defaults apply", _one_line(exc))
        return GuardConfig(), GatesConfig(), 0
    return guard, gates, min(1, max(0, retry))


def answer_fields(out: Completion) -> dict[str, Any]:
    """What a validator is given: the answer (content without inline reasoning), its reasoning,
    finish_reason and token counts."""
    content, reasoning = split_thinking(out)
    return {"content": content, "reasoning": reasoning, "finish_reason": out.finish_reason,
            "prompt_tokens": out.prompt_tokens, "completion_tokens": out.completion_tokens}


def check(completion: Completion, gates: GatesConfig | None, guard: GuardConfig | None = None) -> str | None:
    """The reason a finished answer is not kept, or None. ``guard``: also look for a loop at the
    tail (an answer not streamed through the guard). Raises ValidatorError when the validator
    cannot be imported (the job fails with that one line: no answer is judged without it)."""
    judged = judge(completion, gates, guard)
    return None if judged is None else judged[0]


def judge(completion: Completion, gates: GatesConfig | None,
          guard: GuardConfig | None = None) -> tuple[str, dict[str, Any]] | None:
    """``check`` with the details: a loop's period, repeats, onset and cut (the guard's Verdict)."""
    if completion.discard is not None:
        return completion.discard
    text = completion.text or ""
    content, reasoning = split_thinking(completion)
    if gates is not None:
        if gates.empty and not text.strip() and not (completion.reasoning or "").strip():
            return "empty", {}
        if gates.unclosed_reasoning and _unclosed(completion, content, reasoning):
            return "unclosed_reasoning", {}
        if gates.think_tags and ("<think>" in content or "</think>" in content):
            return "think_tags", {}
    if guard is not None and guard.enabled:
        verdict = degeneration.scan(text, completion.completion_tokens, guard, reasoning=completion.reasoning or "")
        if verdict is not None:
            return "loop", verdict.details()
    if gates is not None and gates.validator:
        why = _validate(gates.validator, answer_fields(completion))
        return None if why is None else (why, {})
    return None


def _unclosed(out: Completion, content: str, reasoning: str | None) -> bool:
    if out.reasoning is None:
        # No parser: inline tags. split_thinking took a closed block off; one still opening is unclosed.
        return content.lstrip().startswith("<think>") and "</think>" not in content
    # A parser: reasoning and no answer after it means the reasoning never ended.
    return bool(out.reasoning.strip()) and not content.strip()


def _validate(spec: str, fields: dict[str, Any]) -> str | None:
    func = load_validator(spec)
    try:
        result = func(fields)
    except Exception as exc:
        # The validator itself failed on this answer: discarded with that reason (nothing silently
        # kept or dropped), logged once per distinct message.
        why = f"raised {type(exc).__name__}: {_one_line(exc)}"
        _log_once(spec, why)
        return f"validator:{why}"[:REASON_CHARS + 10]
    if result is None or result == "" or result is False:
        return None
    text = " ".join(str(result).split())[:REASON_CHARS] or "refused"
    return f"validator:{text}"


@functools.lru_cache(maxsize=256)
def _log_once(spec: str, why: str) -> None:
    log.error("gates.validator %s %s (the answer is discarded)", spec, why)
