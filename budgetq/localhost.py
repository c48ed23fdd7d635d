"""Local helpers for the demo, tests and benchmarks: free ports, a private redis-server, HTTP waits."""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

import redis

from shared.errors import BudgetqError
from shared.redis_conn import connect


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cli_command(log_level: str = "INFO", log_format: str = "text") -> list[str]:
    """``python -m budgetq.cli`` with the logging flags, for the children a command starts.

    Each child sets up its own logging from its own flags, so a parent's --log-level and
    --log-format reach it only if they are passed on.
    """
    return [sys.executable, "-m", "budgetq.cli", "--log-level", log_level, "--log-format", log_format]


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
    """A private redis-server on a free port in a temp dir (never the shared one on 6379).

    ``appendonly`` turns on AOF with fsync every second, as docker-compose.yml does, so
    ``kill()`` + ``start()`` behaves like a crashed and restarted production Redis.
    """

    def __init__(self, appendonly: bool = False, password: str | None = None) -> None:
        self.binary = shutil.which("redis-server")
        if self.binary is None:
            raise BudgetqError("redis-server not found on PATH: install it (apt-get install -y redis-server) "
                               "or pass --redis-url")
        self.dir = tempfile.mkdtemp(prefix="budgetq-redis-")
        self.port = free_port()
        self.appendonly = appendonly
        self.password = password
        auth = f":{password}@" if password else ""
        self.url = f"redis://{auth}127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen | None = None
        self.start()

    def start(self) -> None:
        args = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", self.dir, "--save", "",
                "--appendonly", "yes" if self.appendonly else "no", "--appendfsync", "everysec"]
        if self.password:
            args += ["--requirepass", self.password]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = connect(self.url)
        deadline = time.monotonic() + 60  # generous: a loaded machine can take seconds to start a process
        while time.monotonic() < deadline:
            try:
                client.ping()
                return
            except (redis.ConnectionError, redis.BusyLoadingError):
                time.sleep(0.02)
        self.stop()
        raise BudgetqError(f"redis-server on port {self.port} did not start")

    def kill(self) -> None:
        """SIGKILL, like a crash: what AOF has written survives a restart with ``start()``."""
        if self.proc is not None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(5)
            self.proc = None

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
            self.proc = None
        shutil.rmtree(self.dir, ignore_errors=True)
