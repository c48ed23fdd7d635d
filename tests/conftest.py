"""Fixtures: one private redis-server per test session, flushed per test (never a shared one)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import redis

from budgetq.local_redis import LocalRedis, free_port

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


def _wait_http(url: str, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(url, timeout=1).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"{url} did not come up")


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
        _wait_http(url + "/health")
        return url

    yield start
    for p in procs:
        p.terminate()
        p.wait(10)
