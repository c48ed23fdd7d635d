"""One prompt's life in a worker: reserve budget, call SGLang, commit the result exactly once."""

from __future__ import annotations

import asyncio

from shared.budget import Admission, AsyncBudget
from shared.schema import JobPayload, Message, ResultRow
from worker.sglang_client import SGLangClient

# How long to wait before asking again when the budget may fit once requests finish.
WAIT_POLL_S = 0.05


async def process_prompt(payload: JobPayload, job_id: str, budget: AsyncBudget,
                         client: SGLangClient, slots: asyncio.Semaphore | None = None) -> dict:
    """Run one job; returns a small JSON-able outcome (it becomes the RQ job's result).

    ``slots`` bounds requests at the server; it is held from reservation to response only,
    so RQ bookkeeping before and after never leaves a server slot idle.
    """
    if slots is None:
        return await _reserve_and_send(payload, job_id, budget, client)
    async with slots:
        return await _reserve_and_send(payload, job_id, budget, client)


async def _reserve_and_send(payload: JobPayload, job_id: str, budget: AsyncBudget,
                            client: SGLangClient) -> dict:
    ds = payload.dataset
    while True:
        res = await budget.reserve(ds, job_id, payload.sampling.max_tokens)
        if res.status is not Admission.WAIT:
            break
        await asyncio.sleep(WAIT_POLL_S)
    if res.status is Admission.DONE:
        return {"status": "already_done"}
    if res.status in (Admission.EXHAUSTED, Admission.PAUSED):
        return {"status": "skipped", "reason": res.status.value.lower()}
    try:
        out = await client.complete(payload, rid=job_id)
    except BaseException:
        # Failure, cancellation or shutdown: give the reservation back before re-raising.
        await asyncio.shield(budget.release(ds, job_id))
        raise
    row = ResultRow(
        id=payload.id, dataset=ds,
        conversations=[*payload.messages, Message(role="assistant", content=out.text)],
        prompt_tokens=out.prompt_tokens, completion_tokens=out.completion_tokens,
        finish_reason=out.finish_reason, model=client.model, endpoint=out.endpoint,
        latency_s=round(out.latency_s, 4),
    )
    counted = await budget.commit(ds, job_id, out.completion_tokens, row.model_dump_json())
    return {"status": "committed" if counted else "duplicate", "completion_tokens": out.completion_tokens}

