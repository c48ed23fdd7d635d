"""simulator/local.py: the one LocalSim (and LocalRedis) that tests, bench/ and the demo start."""

from __future__ import annotations

import json
import os
import socket
import urllib.request

import pytest
import redis

from budgetq.shared.errors import BudgetqError
from budgetq.simulator.local import LocalRedis, LocalSim, wait_http


def _requests(url: str) -> list:
    with urllib.request.urlopen(url + "/sim/requests", timeout=10) as resp:
        return json.loads(resp.read())


def test_a_sim_passes_its_flags_restarts_on_its_port_and_stops():
    with LocalSim("--instant", "--served-model-name", "tiny/model") as sim:
        with urllib.request.urlopen(sim.url + "/v1/models", timeout=10) as resp:
            assert json.loads(resp.read())["data"][0]["id"] == "tiny/model"
        body = json.dumps({"text": "hi", "sampling_params": {"max_new_tokens": 4}}).encode()
        urllib.request.urlopen(urllib.request.Request(sim.url + "/generate", data=body), timeout=10).close()
        assert len(_requests(sim.url)) == 1
        port, first = sim.port, sim.pid
        sim.kill()
        with pytest.raises(OSError):
            _requests(sim.url)
        sim.start()
        assert (sim.port, _requests(sim.url)) == (port, [])  # same port, a new process with no records
        assert sim.pid != first
    assert sim.proc is None
    with pytest.raises(OSError):
        _requests(sim.url)


def test_a_sim_that_cannot_start_fails_at_once_naming_its_url():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(BudgetqError, match=f"127.0.0.1:{port}.* exited with"):
            LocalSim(port=port, timeout_s=60)  # exits at once (address in use): no 60 s wait


def test_wait_http_names_the_url_it_gave_up_on():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, not listening: refused
        with pytest.raises(BudgetqError, match=f"http://127.0.0.1:{port}/health did not come up"):
            wait_http(f"http://127.0.0.1:{port}/health", timeout_s=0.3)


def test_local_redis_stops_and_removes_its_dir():
    server = LocalRedis()
    client = redis.Redis.from_url(server.url)
    assert client.ping()
    client.close()
    server.stop()
    assert server.proc is None
    assert not os.path.exists(server.dir)


def _free_ports_in_a_child(n: int) -> list[int]:
    import subprocess
    import sys

    code = f"from budgetq.simulator.local import free_port; print([free_port() for _ in range({n})])"
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)


def test_free_port_never_hands_one_port_to_two_processes():
    """pytest-xdist workers ask at once: the kernel's free port is free only until its socket closes,
    and two workers were once told the same one (CI: one sim answered for two tests)."""
    children = [_free_ports_in_a_child(300) for _ in range(3)]
    ports = []
    for child in children:
        out, _ = child.communicate(timeout=120)
        assert child.returncode == 0
        ports += json.loads(out)
    assert len(ports) == 900 and len(set(ports)) == 900
    # and none of the ephemeral range, where a killed server's port can become an outgoing connection's
    # local end, so that restarting the server on it fails (address in use)
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        low = int(f.read().split()[0])
    assert max(ports) < low, max(ports)


def test_a_sim_whose_port_another_server_took_moves_to_a_port_of_its_own(monkeypatch):
    """The other server answers /health on the port first; LocalSim must not hand out its URL."""
    from budgetq.simulator import local

    with LocalSim("--instant") as other:
        real = local.free_port
        handed = iter([other.port])
        monkeypatch.setattr(local, "free_port", lambda: next(handed, None) or real())
        with LocalSim("--instant") as sim:
            assert sim.port != other.port
            with urllib.request.urlopen(sim.url + "/sim/stats", timeout=10) as resp:
                assert json.loads(resp.read())["pid"] == sim.pid
        assert other.proc is not None and other.proc.poll() is None   # the other one is left alone


def test_local_redis_whose_port_another_server_took_moves_to_a_port_of_its_own(monkeypatch):
    from budgetq.simulator import local

    other = LocalRedis()
    try:
        real = local.free_port
        handed = iter([other.port])
        monkeypatch.setattr(local, "free_port", lambda: next(handed, None) or real())
        server = LocalRedis(password="pw")
        try:
            assert server.port != other.port and str(server.port) in server.url
            client = redis.Redis.from_url(server.url)
            assert int(client.info("server")["process_id"]) == server.proc.pid
            client.close()
            server.kill()
            server.start()   # a restart keeps its port
            assert str(server.port) in server.url and server.proc is not None
        finally:
            server.stop()
    finally:
        other.stop()
