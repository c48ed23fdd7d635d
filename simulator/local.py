"""Local processes for the demo, tests and benchmarks: free ports, a private redis-server, a
``budgetq sim`` subprocess, HTTP waits.

It lives in the library (not in budgetq/, the CLI package) so that tests, bench/ and
``budgetq demo`` share one ``LocalRedis`` and one ``LocalSim`` without any library module
importing the CLI. ``LocalSim`` *runs* the CLI (``python -m budgetq.cli sim``) as a child
process: that is the simulator exactly as an operator starts it, flags and all.
"""

from __future__ import annotations

import fcntl
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from types import TracebackType

import redis

from budgetq.shared.errors import BudgetqError
from budgetq.shared.redis_conn import connect

_PORTS_FILE = os.path.join(tempfile.gettempdir(), "budgetq-free-ports")
_PORT_MEMORY_S = 900.0   # longer than any test waits between choosing a port and binding it
_BIND_ATTEMPTS = 5


def free_port() -> int:
    """A loopback port nothing listens on, that no other caller on this machine was handed lately,
    and that no outgoing connection will take.

    Two races, both seen in full test suites. The kernel's "free" port (bind to 0) is free only until
    its socket closes: two processes (pytest-xdist workers, parallel benches) asking at once can be
    told the same one, and the second server to bind it fails while the first answers for both. So
    the ports handed out in the last 15 minutes are kept in a file shared by every process, under a
    lock. And a port of the ephemeral range, once its server is killed, can become the local end of
    any outgoing connection on the machine, so that restarting the server on it fails (address in
    use). So the port is drawn from below that range, where the kernel never picks one on its own.
    """
    try:
        f = open(_PORTS_FILE, "a+")  # closed by the with below
    except OSError:  # another user's file, a read-only /tmp: the range alone still avoids the second race
        return _unused_port({})
    with f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.seek(0)
        now = time.time()
        recent: dict[int, float] = {}
        for line in f.read().split():
            held, _, when = line.partition(":")
            if held.isdigit() and _is_float(when) and now - float(when) < _PORT_MEMORY_S:
                recent[int(held)] = float(when)
        port = _unused_port(recent)
        recent[port] = now
        f.seek(0)
        f.truncate()
        f.write("".join(f"{p}:{t:.0f}\n" for p, t in recent.items()))
        return port


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768   # Linux's default


def _unused_port(recent: dict[int, float]) -> int:
    """A port below the ephemeral range that binds now (nothing listens, nothing lingers on it) and is
    not in ``recent``; the kernel's own pick if every try there fails."""
    high = _ephemeral_low() - 1
    low = max(1024, high - 12_000)
    rng = random.Random()
    for _ in range(200):
        port = rng.randint(low, high)
        if port in recent:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    for _ in range(1000):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port not in recent:
            return port
    return port


def _is_float(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _someone_listens(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex(("127.0.0.1", port)) == 0


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
        # A port we chose, on a first start, may move if another server took it; one asked for, or a
        # restart's (clients hold its URL), stays.
        self._movable = port is None
        self.cli = list(cli) if cli is not None else cli_command("WARNING")
        self.env = dict(env) if env is not None else None
        self.cwd = cwd
        self.proc: subprocess.Popen | None = None
        self.start(timeout_s)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 30.0) -> None:
        for attempt in range(_BIND_ATTEMPTS):
            self.proc = proc = subprocess.Popen([*self.cli, "sim", "--port", str(self.port), *self.flags],
                                                env=self.env, cwd=self.cwd)
            try:
                wait_http(self.url + "/health", timeout_s, proc)
                if self._answers_for(proc, timeout_s):
                    self._movable = False
                    return
            except BudgetqError:
                if not (self._movable and _someone_listens(self.port)):
                    self.stop()
                    raise
            # Another server took the port between free_port() and our bind: ours exits (address in
            # use) and, until it has, the other one answers /health. Never hand out the other's URL.
            self.stop()
            if not self._movable or attempt == _BIND_ATTEMPTS - 1:
                raise BudgetqError(f"port {self.port} is taken by another server: the simulator could not bind it")
            self.port = free_port()

    def _answers_for(self, proc: subprocess.Popen, timeout_s: float = 30.0) -> bool:
        """Whether the server answering on our port is ``proc`` (its /sim/stats names its pid). A slow
        answer (a loaded machine) is waited for; another pid, or not a simulator at all (404, not
        JSON), is another server's."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                with urllib.request.urlopen(self.url + "/sim/stats", timeout=10) as r:
                    return bool(json.loads(r.read()).get("pid") == proc.pid)
            except (urllib.error.HTTPError, ValueError):
                return False
            except OSError:   # timed out, or reset: ask again while there is time
                if time.monotonic() >= deadline or proc.poll() is not None:
                    return False
                time.sleep(0.1)

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
        self.url = self._url()
        self.proc: subprocess.Popen | None = None
        self._started = False
        self.start()

    def start(self) -> None:
        """Start (or, after ``kill()``, restart) the server. A first start on a port that another
        server took after free_port() moves to a fresh port; a restart keeps its port or fails."""
        first = not self._started
        for attempt in range(_BIND_ATTEMPTS):
            if self._start_once():
                self._started = True
                return
            if not (first and attempt < _BIND_ATTEMPTS - 1 and _someone_listens(self.port)):
                break
            self.port = free_port()
            self.url = self._url()
        self.stop()
        raise BudgetqError(f"redis-server on port {self.port} did not start")

    def _url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def _start_once(self) -> bool:
        """Spawn redis-server; True once it answers as itself (INFO's process_id is ours)."""
        args = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", self.dir, "--save", "",
                "--appendonly", "yes" if self.appendonly else "no", "--appendfsync", "everysec"]
        if self.password:
            args += ["--requirepass", self.password]
        self.proc = proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = connect(self.url)
        deadline = time.monotonic() + 60  # generous: a loaded machine can take seconds to start a process
        try:
            while time.monotonic() < deadline and proc.poll() is None:
                try:
                    # Another test's server on the port would answer too (or refuse our password).
                    if int(client.info("server")["process_id"]) == proc.pid:
                        return True
                except redis.RedisError:   # not up yet (refused, loading), or not ours (refuses our password)
                    pass
                time.sleep(0.02)
        finally:
            client.close()
        stop_process(proc, signal.SIGKILL, 5)
        self.proc = None
        return False

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
