"""Fixtures: one private redis-server per test session, flushed per test (never a shared one)."""

from __future__ import annotations

from pathlib import Path

import pytest
import redis

from budgetq.shared.logs import forget_secrets
from budgetq.simulator.local import LocalRedis, LocalSim

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def _forget_secrets():
    """shared.logs keeps registered secrets in a process-wide set: empty it after every test."""
    yield
    forget_secrets()


@pytest.fixture(scope="session")
def redis_server():
    server = LocalRedis()
    yield server
    server.stop()


@pytest.fixture
def redis_url(redis_server) -> str:
    conn = redis.Redis.from_url(redis_server.url)
    conn.flushall()  # our private server only
    return redis_server.url


@pytest.fixture
def conn(redis_url) -> redis.Redis:
    return redis.Redis.from_url(redis_url)



@pytest.fixture
def sim_factory():
    """Start `budgetq sim` subprocesses; returns their base URLs; stops them after the test."""
    sims: list[LocalSim] = []

    def start(*extra: str) -> str:
        sims.append(LocalSim(*extra, cwd=ROOT))
        return sims[-1].url

    yield start
    for s in sims:
        s.stop()


@pytest.fixture(scope="session")
def vllm():
    """One real vLLM server (its CPU build, SmolLM2-135M) per test session (tests/vllm_server.py).

    Tests that use it carry ``pytest.mark.xdist_group("vllm")`` and the suite runs with
    ``--dist loadgroup``, so they share one pytest-xdist process and this one server."""
    from tests.vllm_server import VllmServer, smollm2_hf_dir

    server = VllmServer(smollm2_hf_dir(), "--max-model-len", "2048", "--enable-log-requests")
    yield server
    server.stop()
