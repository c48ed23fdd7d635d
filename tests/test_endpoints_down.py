"""The worker's line when no server answers names no server kind: it runs against SGLang and any
OpenAI-style server (llama.cpp's among them)."""

from __future__ import annotations

import asyncio
import logging

from budgetq.shared.config import ServerConfig
from budgetq.worker.endpoints import EndpointPool


def test_all_servers_down_is_said_without_naming_sglang(caplog):
    async def wait_while_down() -> None:
        pool = EndpointPool(ServerConfig(urls=["http://127.0.0.1:8080"]), session=None, headers={})  # type: ignore[arg-type]
        pool.endpoints[0].healthy = False
        pool._any_healthy.clear()
        # the line is logged before the wait; the server "comes back" as soon as the wait starts
        asyncio.get_running_loop().call_soon(pool._any_healthy.set)
        await pool.wait_healthy()

    with caplog.at_level(logging.ERROR, logger="budgetq.endpoints"):
        asyncio.run(wait_while_down())
    (line,) = [r.getMessage() for r in caplog.records if r.name == "budgetq.endpoints"]
    assert line.startswith("all servers are down (http://127.0.0.1:8080: failing); waiting for one"), line
    assert "SGLang" not in line
