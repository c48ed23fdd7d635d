"""The RQ job function. A plain ``rq worker`` can run it one job at a time (debug/fallback).

Set BUDGETQ_CONFIG (or the BUDGETQ_* env vars) in the rq worker's environment so it knows
Redis and the server; the payload itself carries no server address or secret.
"""

from __future__ import annotations

import asyncio
import os

import aiohttp
from rq import get_current_job

from budgetq.shared.config_load import load_config
from budgetq.shared.redis_conn import aconnect
from budgetq.shared.schema import JobPayload
from budgetq.worker.process import run_one
from budgetq.worker.sglang_client import SGLangClient


def run_prompt(payload: dict) -> dict:
    job = get_current_job()
    job_id = job.id if job is not None else payload["id"]
    cfg = load_config(os.environ.get("BUDGETQ_CONFIG"))

    async def main() -> dict:
        conn = aconnect(cfg.redis_url, max_connections=4)
        try:
            async with aiohttp.ClientSession() as session:
                client = SGLangClient(session, cfg.server)
                try:
                    return await run_one(JobPayload.model_validate(payload), job_id, conn, client)
                finally:
                    await client.close()
        finally:
            await conn.aclose()

    return asyncio.run(main())
