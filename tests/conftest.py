"""Fixtures: one private redis-server per test session, flushed per test (never a shared one)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import redis

from budgetq.localhost import LocalRedis, free_port, wait_http

ROOT = Path(__file__).resolve().parent.parent


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
    procs: list[subprocess.Popen] = []

    def start(*extra: str) -> str:
        port = free_port()
        p = subprocess.Popen([sys.executable, "-m", "budgetq.cli", "--log-level", "WARNING", "sim",
                              "--port", str(port), *extra], cwd=ROOT, env=dict(os.environ))
        procs.append(p)
        url = f"http://127.0.0.1:{port}"
        wait_http(url + "/health")
        return url

    yield start
    for p in procs:
        p.terminate()
        p.wait(10)
