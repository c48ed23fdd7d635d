"""One job's result as an output row, and the simple one-job-at-a-time path (stock rq worker)."""

from __future__ import annotations

import asyncio

from budgetq.shared import budget
from budgetq.shared.budget import Admission
from budgetq.shared.identity import id_text
from budgetq.shared.jobs import ResultStatus
from budgetq.shared.schema import JobPayload, Message, ResultRow
from budgetq.shared.scripts import arun
from budgetq.worker import turns
from budgetq.worker.sglang_client import SGLangClient
from budgetq.worker.sglang_wire import Completion, split_thinking

# How long the one-at-a-time path waits before asking again when the budget may fit later.
WAIT_POLL_S = 0.05

__all__ = ["build_row", "estimate_prompt_tokens", "run_one", "split_thinking"]


def _reply(payload: JobPayload, out: Completion) -> Message:
    """The generated assistant message: the reasoning goes on it (SpecForge reads it there),
    inline as <think> in its content, or nowhere, never in two places."""
    answer, thinking = split_thinking(out)
    if thinking and payload.thinking == "inline":
        return Message(role="assistant", content=f"<think>\n{thinking}\n</think>\n\n{answer}")
    if thinking and payload.thinking == "separate":
        return Message.model_validate({"role": "assistant", "content": answer, "reasoning_content": thinking})
    return Message(role="assistant", content=answer)


def build_row(payload: JobPayload, out: turns.Result, model: str) -> ResultRow:
    """The result row (``model``: if the answer does not say which model its request named).
    regenerate: all: [system], user 1, answer 1, user 2, answer 2, ... as far
    as the conversation got (a cut answer ends it), every answer with its own reasoning, the
    layout SpecForge's scripts/regenerate_train_data.py writes for multi-turn rows."""
    if isinstance(out, turns.Conversation):
        conv = list(payload.messages)
        for k, o in enumerate(out.outs):
            if k:
                conv.append((payload.turns or [])[k - 1])
            conv.append(_reply(payload, o))
        per_turn = [{"prompt_tokens": o.prompt_tokens, "completion_tokens": o.completion_tokens,
                     "finish_reason": o.finish_reason} for o in out.outs]
    else:
        conv, per_turn = [*payload.messages, _reply(payload, out)], None
    return ResultRow(
        id=id_text(payload.id), int_id=isinstance(payload.id, int), dataset=payload.dataset, conversations=conv,
        prompt_tokens=out.prompt_tokens, completion_tokens=out.completion_tokens,
        finish_reason=out.finish_reason, model=out.model or model, endpoint=out.endpoint,
        latency_s=round(out.latency_s, 4), turns=per_turn,
        hidden_states_file=out.hidden_states_file if isinstance(out, Completion) else None,
        sample=payload.sample,
    )


def _chars_estimate(msgs: list[Message]) -> int:
    return sum(len(m.content) for m in msgs) // 4 + 4 * len(msgs)


def estimate_prompt_tokens(payload: JobPayload) -> int:
    """Prompt tokens for count=total reservations: exact when the producer tokenized it.

    With turns: summed over the requests, each without the answers before it (reserve.lua
    adds an allowance per earlier answer), the producer's own definition (producer/reading/tokenize.py).
    """
    if payload.prompt_tokens is not None:
        return payload.prompt_tokens
    later = payload.turns or []
    return sum(_chars_estimate([*payload.messages, *later[:k]]) for k in range(len(later) + 1))


async def run_one(payload: JobPayload, job_id: str, conn, client: SGLangClient) -> dict:
    """Reserve, send, commit: the whole life of one job, without the concurrent worker's batching."""
    ds = payload.dataset
    while True:
        res = await arun(conn, budget.reserve(ds, job_id, payload.sampling.max_tokens,
                                              estimate_prompt_tokens(payload), requests=payload.requests))
        if res.status is not Admission.WAIT:
            break
        await asyncio.sleep(WAIT_POLL_S)
    if res.status is Admission.DONE:
        return {"status": ResultStatus.ALREADY_DONE.value}
    if res.status in (Admission.EXHAUSTED, Admission.PAUSED):
        return {"status": "skipped", "reason": res.status.value.lower()}
    try:
        out = await turns.send(client, payload, job_id)
    except BaseException:
        # Failure, cancellation or shutdown: give the reservation back before re-raising.
        await asyncio.shield(arun(conn, budget.release(ds, job_id)))
        raise
    row = build_row(payload, out, client.model)
    outcome = await arun(conn, budget.commit(ds, job_id, out.prompt_tokens, out.completion_tokens,
                                             out.finish_reason, row.model_dump_json(), lengths=turns.lengths(out)))
    return {"status": outcome.value.lower(), "kept": outcome.kept, "completion_tokens": out.completion_tokens}
