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
