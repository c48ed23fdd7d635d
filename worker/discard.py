"""Whether an answer is kept: the degeneration guard and the quality gates, as the job flow uses them.

A dataset's guard, gates and ``retry_discarded`` reach the worker through its conf hash
(``Conf.QUALITY``, written by the producer: a worker's own config need not list the datasets
it serves), read with the dataset's state every control interval and parsed once per value here.

An answer is discarded when the guard cut its stream (``Completion.discard``, set by the client)
or a gate names a reason (worker/quality.py). The job flow then commits it as discarded
(commit.lua: out/<ds>.discarded.jsonl, the prompt done) or, with ``retry_discarded`` and once per
job run, commits the attempt aside (RETRY) and sends the prompt again with another seed.
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from budgetq.shared.config_quality import GatesConfig, GuardConfig
from budgetq.shared.schema import JobPayload
from budgetq.worker import quality, turns
from budgetq.worker.degeneration import LoopGuard
from budgetq.worker.sglang_wire import Completion


@dataclass(frozen=True)
class Quality:
    """One dataset's settings as a worker applies them."""

    guard: GuardConfig | None = None   # None: the guard is off
    gates: GatesConfig | None = None
    retry_discarded: int = 0           # 0 or 1: send a discarded prompt again once per job run

    def make_guard(self) -> Callable[[], LoopGuard] | None:
        """A factory of fresh guards, one per request (None: no guard)."""
        cfg = self.guard
        if cfg is None:
            return None
        return lambda: LoopGuard(cfg)


@functools.lru_cache(maxsize=64)
def settings(raw: str) -> Quality:
    """The conf's ``quality`` JSON as settings; "" (a dataset registered before it existed): defaults."""
    guard, gates, retry = quality.settings(raw)
    return Quality(guard if guard.enabled else None, gates, retry)


async def reason(out: turns.Result, q: Quality) -> tuple[str, dict[str, Any]] | None:
    """(reason, details) when the answer is not to be kept: the guard's cut, else the first gate's
    (worker/quality.py; a loop at the tail of an answer the guard did not see streamed is one too), else
    the dataset's validator's. Raises quality.ValidatorError when the validator cannot be imported."""
    outs = out.outs if isinstance(out, turns.Conversation) else [out]
    for o in outs:
        if o.discard is not None:
            return o.discard
    for o in outs:
        judged = quality.judge(o, q.gates, q.guard)
        if judged is not None:
            return judged
    if q.gates is not None and q.gates.validator:
        for o in outs:
            why = await quality.validate(q.gates.validator, quality.answer_fields(o), q.gates.validator_timeout_s)
            if why is not None:
                return why, {}
    return None


def another_seed(payload: JobPayload, job_id: str, attempt: int) -> JobPayload:
    """The payload with another sampling seed for ``attempt`` (2, ...): the set seed moved on by the
    attempt, or one drawn from the job id (the same on every worker, so a retry is reproducible)."""
    seed = payload.sampling.seed
    if seed is not None:
        new = (seed + attempt - 1) % 2**31
    else:
        new = int.from_bytes(hashlib.blake2b(f"{job_id}#{attempt}".encode(), digest_size=4).digest(), "big") >> 1
    return payload.model_copy(update={"sampling": payload.sampling.model_copy(update={"seed": new})})


def discard_row(row_json: str, why: str, details: dict, out: turns.Result, attempt: int, retried: bool,
                nonce: str) -> str:
    """The row as out/<ds>.discarded.jsonl keeps it: the answer, its token counts (the row's own
    prompt_tokens and completion_tokens) and why it was discarded. ``key`` tells one attempt of a
    prompt from another (a retried prompt has several discarded rows; the collector keeps each once)."""
    row = json.loads(row_json)
    row["discard"] = {"reason": why, "details": details, "attempt": attempt, "retried": retried,
                      "key": f"{row['id']}#{nonce}", "prompt_tokens": out.prompt_tokens,
                      "completion_tokens": out.completion_tokens}
    return json.dumps(row, ensure_ascii=False)


def guard_details(out: Completion | Any) -> dict[str, Any]:
    return dict(out.discard[1]) if isinstance(out, Completion) and out.discard else {}
