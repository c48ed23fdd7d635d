"""Local helpers for the demo and tests: free ports, a private redis-server, waiting on HTTP."""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
import urllib.request

import redis

from shared.errors import BudgetqError


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, timeout_s: float = 15.0) -> None:
    """Poll ``url`` until it answers (a server we just started)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(url, timeout=1).close()
            return
        except OSError:
            time.sleep(0.05)
    raise BudgetqError(f"{url} did not come up within {timeout_s:.0f} s")


class LocalRedis:
    def __init__(self, appendonly: bool = False) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise BudgetqError("redis-server not found on PATH: install it (apt-get install -y redis-server) "
                               "or pass --redis-url")
        self.dir = tempfile.mkdtemp(prefix="budgetq-redis-")
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc = subprocess.Popen(
            [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", self.dir, "--save", "",
             "--appendonly", "yes" if appendonly else "no"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis.from_url(self.url)
        for _ in range(200):
            try:
                client.ping()
                return
            except redis.ConnectionError:
                time.sleep(0.02)
        self.stop()
        raise BudgetqError(f"redis-server on port {self.port} did not start")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        shutil.rmtree(self.dir, ignore_errors=True)
