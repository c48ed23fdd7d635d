"""One prompt's result as an output row, and the simple one-job-at-a-time path (stock rq worker)."""

from __future__ import annotations

import asyncio
import re

from shared import budget
from shared.budget import Admission
from shared.jobs import ResultStatus
from shared.schema import JobPayload, Message, ResultRow
from shared.scripts import arun
from worker.sglang_client import Completion, SGLangClient

# How long the one-at-a-time path waits before asking again when the budget may fit later.
WAIT_POLL_S = 0.05
_THINK = re.compile(r"^\s*<think>(.*?)</think>\s*", re.DOTALL)


def split_thinking(out: Completion) -> tuple[str, str | None]:
    """(answer, thinking): from the server's reasoning parser, or from inline <think> tags."""
    if out.reasoning is not None:
        return out.text, out.reasoning
    m = _THINK.match(out.text)
    if m:
        return out.text[m.end():], m.group(1).strip()
    return out.text, None


def build_row(payload: JobPayload, out: Completion, model: str) -> ResultRow:
    """The result row: the reasoning goes on the assistant message (SpecForge reads it there),
    inline as <think> in its content, or nowhere, never in two places."""
    answer, thinking = split_thinking(out)
    reply = Message(role="assistant", content=answer)
    if thinking and payload.thinking == "inline":
        reply.content = f"<think>\n{thinking}\n</think>\n\n{answer}"
    elif thinking and payload.thinking == "separate":
        # Message allows extra fields (pydantic extra="allow"); SpecForge reads this one.
        reply = Message.model_validate({"role": "assistant", "content": answer, "reasoning_content": thinking})
    return ResultRow(
        id=payload.id, dataset=payload.dataset, conversations=[*payload.messages, reply],
        prompt_tokens=out.prompt_tokens, completion_tokens=out.completion_tokens,
        finish_reason=out.finish_reason, model=model, endpoint=out.endpoint, latency_s=round(out.latency_s, 4),
    )


def estimate_prompt_tokens(payload: JobPayload) -> int:
    """Prompt tokens for count=total reservations: exact when the producer tokenized it."""
    if payload.prompt_tokens is not None:
        return payload.prompt_tokens
    return sum(len(m.content) for m in payload.messages) // 4 + 4 * len(payload.messages)


async def run_one(payload: JobPayload, job_id: str, conn, client: SGLangClient) -> dict:
    """Reserve, send, commit: the whole life of one job, without the concurrent worker's batching."""
    ds = payload.dataset
    while True:
        res = await arun(conn, budget.reserve(ds, job_id, payload.sampling.max_tokens,
                                              estimate_prompt_tokens(payload)))
        if res.status is not Admission.WAIT:
            break
        await asyncio.sleep(WAIT_POLL_S)
    if res.status is Admission.DONE:
        return {"status": ResultStatus.ALREADY_DONE.value}
    if res.status in (Admission.EXHAUSTED, Admission.PAUSED):
        return {"status": "skipped", "reason": res.status.value.lower()}
    try:
        out = await client.complete(payload, job_id)
    except BaseException:
        # Failure, cancellation or shutdown: give the reservation back before re-raising.
        await asyncio.shield(arun(conn, budget.release(ds, job_id)))
        raise
    row = build_row(payload, out, client.model)
    outcome = await arun(conn, budget.commit(ds, job_id, out.prompt_tokens, out.completion_tokens,
                                             out.finish_reason, row.model_dump_json()))
    return {"status": outcome.value.lower(), "kept": outcome.kept, "completion_tokens": out.completion_tokens}
