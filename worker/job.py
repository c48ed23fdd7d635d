"""The RQ job function. A plain ``rq worker`` can run it one job at a time (debug/fallback).

Set BUDGETQ_CONFIG (or the BUDGETQ_* env vars) in the rq worker's environment so it knows
Redis and the server; the payload itself carries no server address or secret.
"""

from __future__ import annotations

import asyncio
import os

import aiohttp
import redis.asyncio as aredis
from rq import get_current_job

from shared.budget import AsyncBudget
from shared.config import load_config
from shared.schema import JobPayload
from worker.process import process_prompt
from worker.sglang_client import SGLangClient


def run_prompt(payload: dict) -> dict:
    job = get_current_job()
    job_id = job.id if job is not None else payload["id"]
    cfg = load_config(os.environ.get("BUDGETQ_CONFIG"))

    async def main() -> dict:
        conn = aredis.Redis.from_url(cfg.redis_url)
        try:
            async with aiohttp.ClientSession() as session:
                client = SGLangClient(session, cfg.server)
                return await process_prompt(JobPayload.model_validate(payload), job_id,
                                            AsyncBudget(conn), client)
        finally:
            await conn.aclose()

    return asyncio.run(main())
