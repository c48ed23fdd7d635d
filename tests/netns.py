"""Test hosts of our own: network namespaces on one bridge, with faults between them.

``Net`` makes a Redis host, a server host and two worker hosts (``HOSTS``), each a network
namespace with one interface (``eth0``) on a bridge that lives in a namespace of its own (the
hub). Nothing is created in the machine's own namespace: every interface, address, bridge and
filter rule is inside a namespace whose name starts with this test process's unique tag, and
``close()`` deletes them all (after SIGKILLing whatever still runs in them), whatever the test did.

Faults, between two hosts, applied inside the first host's namespace:

- ``cut(a, b)`` / ``heal(a, b)``: a partition, iptables DROP both ways: a black hole (packets
  vanish, TCP retransmits and times out), not a refused connection.
- ``lose(a, b, p)``: each packet between a and b dropped with probability p, each way
  (iptables' ``statistic`` match, in the kernel).
- latency: the kernels this was written on have no ``sch_netem`` (``tc qdisc ... netem`` is
  refused), so latency is a userspace TCP relay (simulator/relay.py) that holds every chunk for
  RTT/2 each way: a link's propagation delay on a TCP stream, not loss or reordering.
  bench/network_rtt.py runs it on loopback (no root needed).

The test process itself reaches the fixture's Redis through a unix socket (a file, not bound
to a namespace) and the servers through ``in_ns`` (a thread that joined the host's namespace).
"""

from __future__ import annotations

import ctypes
import itertools
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import redis

SUBNET = "10.77.0"
HOSTS = {"redis": 2, "server": 3, "w1": 11, "w2": 12}
_CLONE_NEWNET = 0x40000000
_seq = itertools.count()
T = TypeVar("T")


def _run(*cmd: str) -> None:
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {out.stderr.strip() or out.returncode}")


def unavailable() -> str | None:
    """Why this machine cannot make the test hosts (one line), or None when it can."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool, pkg in (("ip", "iproute2"), ("iptables", "iptables"), ("redis-server", "redis-server")):
        if shutil.which(tool) is None:
            return f"{tool} not found (apt-get install {pkg})"
    probe = f"bqprobe{os.getpid()}"
    try:
        _run("ip", "netns", "add", probe)
        _run("ip", "-n", probe, "link", "add", "br0", "type", "bridge")
        _run("ip", "netns", "exec", probe, "iptables", "-A", "OUTPUT", "-m", "statistic", "--mode", "random",
             "--probability", "0.5", "-j", "DROP")
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as exc:
        return f"cannot make network namespaces here: {exc}"
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


class Net:
    """The four hosts on one bridge; ``close()`` removes everything (also a context manager)."""

    def __init__(self) -> None:
        self.tag = f"bq{os.getpid()}x{next(_seq)}"
        self.ns = {h: f"{self.tag}-{h}" for h in HOSTS}
        self.hub = f"{self.tag}-hub"
        self.made: list[str] = []
        self.rules: list[tuple[str, list[str]]] = []
        self.procs: list[subprocess.Popen] = []  # servers started on the hosts, killed and reaped by close()
        self.dir = Path(tempfile.mkdtemp(prefix=f"{self.tag}-"))
        try:
            self._make()
        except BaseException:
            self.close()
            raise

    def _make(self) -> None:
        _run("ip", "netns", "add", self.hub)
        self.made.append(self.hub)
        _run("ip", "-n", self.hub, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", self.hub, "link", "set", "br0", "up")
        for host, n in HOSTS.items():
            ns = self.ns[host]
            _run("ip", "netns", "add", ns)
            self.made.append(ns)
            _run("ip", "-n", self.hub, "link", "add", f"p-{host}", "type", "veth", "peer", "name", "eth0",
                 "netns", ns)
            _run("ip", "-n", self.hub, "link", "set", f"p-{host}", "master", "br0", "up")
            _run("ip", "-n", ns, "addr", "add", f"{SUBNET}.{n}/24", "dev", "eth0")
            _run("ip", "-n", ns, "link", "set", "eth0", "up")
            _run("ip", "-n", ns, "link", "set", "lo", "up")

    def ip(self, host: str) -> str:
        return f"{SUBNET}.{HOSTS[host]}"

    def on(self, host: str) -> list[str]:
        """The command prefix that runs a program on ``host``."""
        return ["ip", "netns", "exec", self.ns[host]]

    # -- faults ------------------------------------------------------------------------
    def _rule(self, host: str, spec: list[str]) -> None:
        _run("ip", "netns", "exec", self.ns[host], "iptables", "-I", *spec)
        self.rules.append((host, spec))

    def _unrule(self, host: str, spec: list[str]) -> None:
        _run("ip", "netns", "exec", self.ns[host], "iptables", "-D", *spec)
        self.rules.remove((host, spec))

    def _both_ways(self, a: str, b: str, match: Sequence[str]) -> list[list[str]]:
        return [["INPUT", "-s", self.ip(b), *match, "-j", "DROP"], ["OUTPUT", "-d", self.ip(b), *match, "-j", "DROP"]]

    def cut(self, a: str, b: str) -> None:
        """Partition ``a`` from ``b``: every packet between them dropped, both ways."""
        for spec in self._both_ways(a, b, ()):
            self._rule(a, spec)

    def heal(self, a: str, b: str) -> None:
        for spec in self._both_ways(a, b, ()):
            self._unrule(a, spec)

    def lose(self, a: str, b: str, p: float) -> None:
        """Drop each packet between ``a`` and ``b`` with probability ``p``, each way."""
        for spec in self._both_ways(a, b, ("-m", "statistic", "--mode", "random", "--probability", f"{p:g}")):
            self._rule(a, spec)

    def dropped(self, host: str) -> int:
        """Packets the DROP rules on ``host`` have dropped so far."""
        out = subprocess.run([*self.on(host), "iptables", "-L", "-v", "-x", "-n"], capture_output=True, text=True,
                             check=True).stdout
        return sum(int(f[0]) for line in out.splitlines() if (f := line.split()) and len(f) > 2 and f[2] == "DROP")

    def link(self, host: str, up: bool) -> None:
        """``host``'s only interface down (a pulled cable: 'network unreachable' at once) or up."""
        _run("ip", "-n", self.ns[host], "link", "set", "eth0", "up" if up else "down")

    # -- processes ---------------------------------------------------------------------
    def in_ns(self, host: str, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` in a thread that joined ``host``'s network namespace (the caller's thread,
        and so the test process, stays where it is)."""
        box: dict[str, Any] = {}

        def run() -> None:
            try:
                libc = ctypes.CDLL(None, use_errno=True)
                with open(f"/run/netns/{self.ns[host]}") as fh:
                    if libc.setns(fh.fileno(), _CLONE_NEWNET) != 0:
                        raise OSError(ctypes.get_errno(), f"setns {self.ns[host]}")
                box["value"] = fn(*args)
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                box["error"] = exc

        t = threading.Thread(target=run, daemon=True)
        t.start()
        t.join()
        if "error" in box:
            raise box["error"]
        return box["value"]

    def close(self) -> None:
        """SIGKILL what still runs in our namespaces (processes this test started there), delete them."""
        for ns in reversed(self.made):
            out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True)
            for pid in out.stdout.split():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except ProcessLookupError:
                    pass
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self.made.clear()
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait(10)
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> Net:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class NsRedis:
    """A redis-server on a host of ``net``, on its address and on a unix socket the test reads through."""

    def __init__(self, net: Net, host: str = "redis", port: int = 6379, extra: Sequence[str] = (),
                 name: str = "redis") -> None:
        self.net, self.host, self.port = net, host, port
        self.dir = net.dir / f"{name}-{port}"
        self.dir.mkdir()
        self.sock = str(self.dir / "redis.sock")
        self.url = f"redis://{net.ip(host)}:{port}/0"
        self.args = [*net.on(host), "redis-server", "--bind", net.ip(host), "--port", str(port), "--unixsocket",
                     self.sock, "--unixsocketperm", "777", "--dir", str(self.dir), "--save", "", "--appendonly",
                     "no", "--protected-mode", "no", *extra]
        self.proc: subprocess.Popen | None = None
        self.local = redis.Redis(unix_socket_path=self.sock)
        self.start()

    def start(self) -> None:
        with open(self.dir / "log", "a") as log:
            self.proc = subprocess.Popen(self.args, stdout=log, stderr=subprocess.STDOUT)
        self.net.procs.append(self.proc)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                self.local.ping()
                return
            except (redis.ConnectionError, redis.BusyLoadingError, FileNotFoundError):
                if self.proc.poll() is not None:
                    break
                time.sleep(0.05)
        raise RuntimeError(f"redis-server on {self.host}:{self.port} did not start: "
                           f"{(self.dir / 'log').read_text()[-2000:]}")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)


class NsSim:
    """``budgetq sim`` on a host of ``net`` (its address, ``port``); ``get(path)`` asks it from that host."""

    def __init__(self, net: Net, *flags: str, host: str = "server", port: int = 30000) -> None:
        from budgetq.simulator.local import cli_command

        self.net, self.host = net, host
        self.url = f"http://{net.ip(host)}:{port}"
        with open(net.dir / f"sim-{port}.log", "w") as log:
            self.proc = subprocess.Popen([*net.on(host), *cli_command("WARNING"), "sim", "--host", net.ip(host),
                                          "--port", str(port), *flags], stdout=log, stderr=subprocess.STDOUT)
        net.procs.append(self.proc)
        deadline = time.monotonic() + 60
        while True:
            try:
                self.get("/health")
                return
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the simulator on {self.url} did not start") from None
                time.sleep(0.1)

    def get(self, path: str) -> Any:
        import json
        import urllib.request

        def fetch() -> Any:
            with urllib.request.urlopen(self.url + path, timeout=10) as resp:
                body = resp.read()
            try:
                return json.loads(body)
            except ValueError:
                return body.decode(errors="replace")

        return self.net.in_ns(self.host, fetch)


def net_fixture() -> Any:
    """The ``net`` fixture's body: a test module does ``net = pytest.fixture(net_fixture)``."""
    why = unavailable()
    if why is not None:
        import pytest

        pytest.skip(why)
    with Net() as n:
        yield n
