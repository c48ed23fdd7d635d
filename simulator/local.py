"""Local processes for the demo, tests and benchmarks: free ports, a private redis-server, a
``budgetq sim`` subprocess, HTTP waits.

It lives in the library (not in budgetq/, the CLI package) so that tests, bench/ and
``budgetq demo`` share one ``LocalRedis`` and one ``LocalSim`` without any library module
importing the CLI. ``LocalSim`` *runs* the CLI (``python -m budgetq.cli sim``) as a child
process: that is the simulator exactly as an operator starts it, flags and all.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Mapping, Sequence
from types import TracebackType

import redis

from budgetq.shared.errors import BudgetqError
from budgetq.shared.redis_conn import connect


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cli_command(log_level: str = "INFO", log_format: str = "text") -> list[str]:
    """``python -m budgetq.cli`` with the logging flags, for the children a command starts.

    Each child sets up its own logging from its own flags, so a parent's --log-level and
    --log-format reach it only if they are passed on.
    """
    return [sys.executable, "-m", "budgetq.cli", "--log-level", log_level, "--log-format", log_format]


def wait_http(url: str, timeout_s: float = 15.0, proc: subprocess.Popen | None = None) -> None:
    """Poll ``url`` until it answers (a server we just started); fail at once if ``proc`` exits."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise BudgetqError(f"the process serving {url} exited with {proc.returncode} before answering")
        try:
            urllib.request.urlopen(url, timeout=1).close()
            return
        except OSError:
            time.sleep(0.05)
    raise BudgetqError(f"{url} did not come up within {timeout_s:.0f} s")


def stop_process(proc: subprocess.Popen, sig: int = signal.SIGTERM, timeout_s: float = 30.0) -> None:
    """Send ``sig`` to ``proc`` if it still runs; SIGKILL it if it has not exited ``timeout_s`` later."""
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class LocalSim:
    """A ``budgetq sim`` subprocess on a free port (or on ``port``, to bring one back where it was).

    ``LocalSim("--speedup", "100")`` returns once the server answers /health; ``url`` is its base
    URL; ``stop()`` ends it (SIGTERM), ``kill()`` crashes it (SIGKILL), ``start()`` starts it again
    on the same port. Also a context manager.
    """

    def __init__(self, *flags: str, port: int | None = None, cli: Sequence[str] | None = None,
                 env: Mapping[str, str] | None = None, cwd: str | os.PathLike[str] | None = None,
                 timeout_s: float = 30.0) -> None:
        self.flags = flags
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cli = list(cli) if cli is not None else cli_command("WARNING")
        self.env = dict(env) if env is not None else None
        self.cwd = cwd
        self.proc: subprocess.Popen | None = None
        self.start(timeout_s)

    def start(self, timeout_s: float = 30.0) -> None:
        self.proc = subprocess.Popen([*self.cli, "sim", "--port", str(self.port), *self.flags],
                                     env=self.env, cwd=self.cwd)
        try:
            wait_http(self.url + "/health", timeout_s, self.proc)
        except BudgetqError:
            self.stop()
            raise

    @property
    def pid(self) -> int:
        if self.proc is None:
            raise BudgetqError(f"the simulator on port {self.port} is not running")
        return self.proc.pid

    def kill(self) -> None:
        """SIGKILL, like a crashed server: its connections drop without an answer."""
        if self.proc is not None:
            stop_process(self.proc, signal.SIGKILL, 10)
            self.proc = None

    def stop(self, timeout_s: float = 10.0) -> None:
        if self.proc is not None:
            stop_process(self.proc, signal.SIGTERM, timeout_s)
            self.proc = None

    def __enter__(self) -> LocalSim:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()


class LocalRedis:
    """A private redis-server on a free port in a temp dir (never the shared one on 6379).

    ``appendonly`` turns on AOF with fsync every second, as docker-compose.yml does, so
    ``kill()`` + ``start()`` behaves like a crashed and restarted production Redis.
    """

    def __init__(self, appendonly: bool = False, password: str | None = None) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise BudgetqError("redis-server not found on PATH: install it (apt-get install -y redis-server) "
                               "or pass --redis-url")
        self.binary = binary
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
        try:
            while time.monotonic() < deadline:
                try:
                    client.ping()
                    return
                except (redis.ConnectionError, redis.BusyLoadingError):
                    time.sleep(0.02)
        finally:
            client.close()
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
            stop_process(self.proc, signal.SIGTERM, 5)
            self.proc = None
        shutil.rmtree(self.dir, ignore_errors=True)
