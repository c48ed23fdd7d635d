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

The user's validator is imported once per process (the producer only looks for its module at start, so a
wrong name is said before anything is generated). Its import and its calls run in threads of their own, each
within ``gates.validator_timeout_s``: user code that hangs (a network call, a deadlock, an import that waits
on something) must not freeze the worker's event loop, which runs every other job and the heartbeats. The
threads are daemons, so a hung one cannot keep the process from exiting.
"""

from __future__ import annotations

import asyncio
import functools
import importlib
import json
import logging
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from budgetq.shared.config_quality import GatesConfig, GuardConfig
from budgetq.worker import degeneration
from budgetq.worker.sglang_wire import Completion, split_thinking

log = logging.getLogger("budgetq.worker")

Validator = Callable[[dict[str, Any]], "str | None"]
# A validator's reason is kept to this many characters (it is a reason, not a report).
REASON_CHARS = 200
# Calls of one validator running at once, at most: an answer waits for one to return (within its time
# limit), so a validator that hangs on every answer holds this many threads, not one per answer.
THREADS_MAX = 8


class ValidatorError(Exception):
    """The dataset's validator cannot be used: one line naming it and why."""


@functools.lru_cache(maxsize=32)
def load_validator(spec: str) -> Validator:
    """``module:function`` imported once per process; ValidatorError (one line) when it cannot be. Blocks:
    the worker calls ``load`` (in a thread, within the time limit)."""
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


_imports: dict[str, Future] = {}     # spec -> its one import, shared by every job waiting for it
_hung: dict[str, str] = {}           # spec -> why it cannot be used: its import passed the time limit
_running: dict[str, int] = {}        # spec -> calls running (a hung one for good)
_slots: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[str, asyncio.Semaphore]] = \
    weakref.WeakKeyDictionary()      # per event loop (the worker has one; tests make several)
_lock = threading.Lock()


def _in_thread(fn: Callable[..., Any], *args: Any) -> Future:
    fut: Future = Future()

    def run() -> None:
        try:
            fut.set_result(fn(*args))
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting job, never lost
            fut.set_exception(exc)

    threading.Thread(target=run, name="validator", daemon=True).start()
    return fut


async def _within(fut: Future, timeout_s: float) -> Any:
    # shield: a job that stops waiting must not cancel what other jobs wait for too
    return await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(fut)), timeout_s)


async def load(spec: str, timeout_s: float) -> Validator:
    """The validator, imported once per process within ``timeout_s``; ValidatorError (one line) when it
    cannot be: tried again by the next job, but never once an import hung (it holds the module's import
    lock: no second try could pass)."""
    with _lock:
        if spec in _hung:
            raise ValidatorError(_hung[spec])
        fut = _imports.get(spec)
        if fut is None:
            fut = _imports[spec] = _in_thread(load_validator, spec)
    if fut.done() and fut.exception() is None:
        return fut.result()   # every job asks: no thread hop once it is imported
    try:
        return await _within(fut, timeout_s)
    except TimeoutError:
        why = (f"gates.validator {spec}: importing {spec.partition(':')[0]} did not finish within {timeout_s:g} s "
               "(gates.validator_timeout_s)")
        with _lock:
            _hung.setdefault(spec, why)
        raise ValidatorError(why) from None
    except ValidatorError:
        with _lock:   # the next job tries again: the module may be installed meanwhile (retry-failed)
            if _imports.get(spec) is fut:
                del _imports[spec]
        raise


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
    """The reason the built-in gates do not keep a finished answer, or None. ``guard``: also look for a loop
    at the tail (an answer not streamed through the guard). The dataset's validator is asked after them,
    by ``validate`` (it runs in a thread, within its time limit)."""
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
    return None


def _unclosed(out: Completion, content: str, reasoning: str | None) -> bool:
    if out.reasoning is None:
        # No parser: inline tags. split_thinking took a closed block off; one still opening is unclosed.
        return content.lstrip().startswith("<think>") and "</think>" not in content
    # A parser: reasoning and no answer after it means the reasoning never ended.
    return bool(out.reasoning.strip()) and not content.strip()


async def validate(spec: str, fields: dict[str, Any], timeout_s: float) -> str | None:
    """``validator:<reason>`` when the dataset's validator refuses the answer ``fields``, else None. It raises,
    or gives no verdict within ``timeout_s`` (a free thread and the call, together): the answer is discarded
    with that reason (nothing silently kept or dropped), logged once per distinct message. ValidatorError when
    it cannot be imported."""
    func = await load(spec, timeout_s)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    slots = _slots.setdefault(loop, {}).setdefault(spec, asyncio.Semaphore(THREADS_MAX))
    try:
        await asyncio.wait_for(slots.acquire(), timeout_s)
    except TimeoutError:
        return _refused(spec, f"not called: its {THREADS_MAX} calls running did not return within {timeout_s:g} s")
    with _lock:
        _running[spec] = _running.get(spec, 0) + 1
    fut = _in_thread(func, fields)
    fut.add_done_callback(lambda _f: _returned(loop, slots, spec))
    try:
        result = await _within(fut, max(0.0, deadline - loop.time()))
    except TimeoutError:
        return _refused(spec, f"did not return within {timeout_s:g} s (gates.validator_timeout_s)")
    except Exception as exc:
        return _refused(spec, f"raised {type(exc).__name__}: {_one_line(exc)}")
    if result is None or result == "" or result is False:
        return None
    text = " ".join(str(result).split())[:REASON_CHARS] or "refused"
    return f"validator:{text}"


def _returned(loop: asyncio.AbstractEventLoop, slots: asyncio.Semaphore, spec: str) -> None:
    # in the call's thread: the slot is given back on the loop's own thread
    with _lock:
        _running[spec] -= 1
    try:
        loop.call_soon_threadsafe(slots.release)
    except RuntimeError:  # the loop closed meanwhile (the worker stopped): nothing waits for the slot
        pass


def _refused(spec: str, why: str) -> str:
    _log_once(spec, why)
    return f"validator:{why}"[:REASON_CHARS + 10]


@functools.lru_cache(maxsize=256)
def _log_once(spec: str, why: str) -> None:
    log.error("gates.validator %s %s (the answer is discarded)", spec, why)
