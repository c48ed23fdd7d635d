"""A Redis that accepts connections but never answers, or is down at start: bounded waits, clean exits."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import threading
import time
import urllib.request

import pytest
import redis
import yaml

from budgetq.shared import keys
from budgetq.simulator.local import LocalRedis, free_port
from tests.helpers import PY, ROOT, Procs, wait_for

FAST = {"heartbeat_ttl_s": 2, "maintenance_interval_s": 0.5, "control_interval_s": 0.2}


class BlackHole:
    """A TCP server that accepts every connection and never sends a byte (a hung Redis, a firewall)."""

    def __init__(self, listening: bool = True) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))  # bound, not listening: connections to it are refused
        self.port = self.sock.getsockname()[1]
        self.held: list[socket.socket] = []
        if listening:
            self.listen()

    def listen(self) -> None:
        self.sock.listen(128)
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.held.append(conn)

    def close(self) -> None:
        self.sock.close()
        for c in self.held:
            c.close()


@pytest.fixture
def black_hole():
    bh = BlackHole()
    yield bh
    bh.close()


def _config(tmp_path, redis_url: str, **extra) -> str:
    path = tmp_path / "cfg.yaml"
    (tmp_path / "D.jsonl").write_text('{"id": "p1", "prompt": "hi"}\n')
    path.write_text(yaml.safe_dump({
        "redis_url": redis_url, "output_dir": str(tmp_path / "out"), "server": {"urls": ["http://127.0.0.1:9"]},
        "datasets": [{"name": "D", "path": str(tmp_path / "D.jsonl"), "budget": "1k", "id_field": "id"}],
        **extra}))
    return str(path)


def _cli(*args: str, timeout: float = 120) -> tuple[subprocess.CompletedProcess, float]:
    started = time.monotonic()
    out = subprocess.run([*PY, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    return out, time.monotonic() - started


def _exit_time(p: subprocess.Popen, timeout_s: float) -> float:
    started = time.monotonic()
    p.wait(timeout_s)
    return time.monotonic() - started


def test_status_against_a_redis_that_never_answers_fails_in_bounded_time_naming_the_host(black_hole):
    url = f"redis://:hunter2secret@127.0.0.1:{black_hole.port}/0"  # default timeouts: 10 s per reply
    out, took = _cli("status", "--redis-url", url)
    assert out.returncode == 2, out.stderr
    assert f"127.0.0.1:{black_hole.port}/0 did not answer" in out.stderr
    assert "hunter2secret" not in out.stderr and "Traceback" not in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1
    print(f"status against a silent Redis: exit 2 after {took:.1f} s (socket timeout 10 s)")
    assert took < 60


def test_produce_against_a_silent_redis_fails_fast_with_redis_wait_s_zero(tmp_path, black_hole):
    cfg = _config(tmp_path, f"redis://127.0.0.1:{black_hole.port}/0?socket_timeout=1", redis_wait_s=0)
    out, took = _cli("produce", "-c", cfg)
    assert out.returncode == 2, out.stderr
    assert "did not answer" in out.stderr and f"127.0.0.1:{black_hole.port}" in out.stderr
    assert "Traceback" not in out.stderr
    print(f"produce against a silent Redis, redis_wait_s 0: exit 2 after {took:.1f} s")


def test_a_worker_waiting_on_a_silent_redis_stops_on_sigterm_mid_ping(tmp_path):
    """The worker's ping in flight is abandoned at once: with a 600 s socket timeout, a worker that
    waited for its reply would outlive the test's bound many times over, however loaded the machine."""
    hole = BlackHole(listening=False)  # refused at first: the worker says it waits, then retries
    try:
        _config(tmp_path, f"redis://127.0.0.1:{hole.port}/0?socket_timeout=600", worker={"grace_s": 1})
        procs = Procs(tmp_path / "cfg.yaml", tmp_path)
        p = procs.start("worker")
        try:
            wait_for(lambda: "waiting for Redis" in procs.log(p), 60, "the worker to wait for Redis")
            hole.listen()
            wait_for(lambda: hole.held, 60, "the worker's next ping to connect (and hang)")
            time.sleep(0.5)  # the PING written, its reply awaited (a wait of the kind under test, not a sync)
            p.send_signal(signal.SIGTERM)
            took = _exit_time(p, 300)
        finally:
            procs.stop_all()
    finally:
        hole.close()
    print(f"worker waiting on a silent Redis: SIGTERM to exit {took:.1f} s (socket timeout 600 s)")
    assert p.returncode == 0, procs.log(p)  # a worker's stop is its normal end
    assert "stopped before" in procs.log(p) and "Traceback" not in procs.log(p)
    assert took < 120, procs.log(p)


def test_a_producer_waiting_on_a_silent_redis_stops_on_sigterm(tmp_path, black_hole):
    """The producer's ping is a blocking call: it ends within its socket timeout (10 s), then the
    producer stops instead of trying again."""
    _config(tmp_path, f"redis://127.0.0.1:{black_hole.port}/0")
    procs = Procs(tmp_path / "cfg.yaml", tmp_path)
    p = procs.start("produce")
    try:
        wait_for(lambda: "waiting for Redis" in procs.log(p), 60, "the producer to wait for Redis")
        p.send_signal(signal.SIGTERM)
        took = _exit_time(p, 120)
    finally:
        procs.stop_all()
    print(f"producer waiting on a silent Redis: SIGTERM to exit {took:.1f} s")
    # a produce stopped before its run started exits 3, as any run stopped before its end
    # (docs/cli.md): `produce && export` must not go on
    assert p.returncode == 3, procs.log(p)
    assert "stopped before" in procs.log(p) and "Traceback" not in procs.log(p)
    assert took < 60, procs.log(p)  # one ping's timeout, not redis_wait_s (300 s)


def test_worker_started_while_redis_is_down_waits_and_then_runs(tmp_path):
    server = LocalRedis()
    server.kill()
    try:
        _config(tmp_path, server.url, worker=FAST)
        procs = Procs(tmp_path / "cfg.yaml", tmp_path)
        w = procs.worker()
        try:
            wait_for(lambda: "waiting for Redis" in procs.log(w), 60, "the worker to say it waits")
            assert w.poll() is None
            server.start()
            conn = redis.Redis.from_url(server.url)
            wait_for(lambda: conn.scard(keys.WORKERS) == 1, 60, "the worker to start")
            assert w.poll() is None
        finally:
            procs.stop_all()
        assert w.returncode == 0, procs.log(w)
        assert "answers after" in procs.log(w)
    finally:
        server.stop()


def test_worker_with_redis_wait_s_zero_fails_at_once_with_one_line(tmp_path):
    port = free_port()
    cfg = _config(tmp_path, f"redis://:pw-secret-1@127.0.0.1:{port}/0", redis_wait_s=0)
    out, took = _cli("worker", "-c", cfg)
    assert out.returncode == 2, out.stderr
    assert f"budgetq: error: cannot reach Redis at 127.0.0.1:{port}/0" in out.stderr
    assert "pw-secret-1" not in out.stderr and "Traceback" not in out.stderr
    print(f"worker, Redis down, redis_wait_s 0: exit 2 after {took:.1f} s")


@pytest.mark.parametrize("second_signal", [False, True])
def test_worker_stops_in_bounded_time_when_redis_hangs_mid_run(tmp_path, second_signal):
    server = LocalRedis()
    try:
        _config(tmp_path, server.url + "?socket_timeout=2", worker={"grace_s": 1, **FAST})
        procs = Procs(tmp_path / "cfg.yaml", tmp_path)
        w = procs.worker()
        conn = redis.Redis.from_url(server.url)
        try:
            wait_for(lambda: conn.scard(keys.WORKERS) == 1, 60, "the worker to start")
            server.proc.send_signal(signal.SIGSTOP)  # hung: accepts (kernel backlog), never answers
            try:
                w.send_signal(signal.SIGTERM)
                if second_signal:
                    wait_for(lambda: "SIGTERM: finishing" in procs.log(w), 30, "the first signal to be seen")
                    w.send_signal(signal.SIGTERM)
                took = _exit_time(w, 60)
            finally:
                server.proc.send_signal(signal.SIGCONT)
        finally:
            procs.stop_all()
    finally:
        server.stop()
    # grace 1 s + CLOSE_S 10 s after a first signal; FORCED_EXIT_S 5 s after a second
    bound = 5 if second_signal else 11
    print(f"worker, Redis SIGSTOPped, {'two signals' if second_signal else 'SIGTERM'}: exit after {took:.1f} s "
          f"(bound {bound} s + process start-up and exit)")
    assert took < bound + 15


def test_producer_stops_in_bounded_time_when_redis_hangs_mid_run(tmp_path):
    server = LocalRedis()
    try:
        cfg = _config(tmp_path, server.url + "?socket_timeout=2")
        p = subprocess.Popen([*PY, "produce", "-c", cfg], cwd=ROOT, env=dict(os.environ),
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            # no worker: the producer enqueues its one prompt and waits for it
            conn = redis.Redis.from_url(server.url)
            wait_for(lambda: conn.llen(keys.rq_queue_key("D")) == 1, 60, "the prompt to be enqueued")
            server.proc.send_signal(signal.SIGSTOP)
            try:
                p.send_signal(signal.SIGTERM)
                took = _exit_time(p, 60)
            finally:
                server.proc.send_signal(signal.SIGCONT)
        finally:
            if p.poll() is None:
                p.kill()
            output = p.communicate()[0]
    finally:
        server.stop()
    print(f"producer, Redis SIGSTOPped, SIGTERM: exit {p.returncode} after {took:.1f} s (PRODUCER_STOP_S 15 s)")
    assert "Traceback" not in output, output
    # stopped while Redis could not be reached: a failure, named in one line (docs/cli.md: exit 2)
    assert p.returncode == 2 and "Redis" in output.strip().splitlines()[-1], output
    assert took < 15 + 15


def test_status_watch_json_keeps_retrying_when_redis_is_away(tmp_path):
    port = free_port()
    p = subprocess.Popen([*PY, "status", "--redis-url", f"redis://127.0.0.1:{port}/0", "--watch", "--json",
                          "--interval", "0.2"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        lines = [p.stderr.readline() for _ in range(2)]
        assert all("cannot reach Redis at 127.0.0.1" in line and "(retrying)" in line for line in lines), lines
        assert p.poll() is None
    finally:
        p.terminate()
        p.communicate(timeout=30)  # reads what is left and closes the pipes


def test_monitor_waits_for_redis_at_start(tmp_path):
    server = LocalRedis()
    server.kill()
    port = free_port()
    try:
        cfg = _config(tmp_path, server.url)
        p = subprocess.Popen([*PY, "monitor", "-c", cfg, "--port", str(port)], cwd=ROOT,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            assert "waiting for Redis" in p.stdout.readline()
            server.start()

            def up() -> bool:
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/status", timeout=5) as r:
                        return r.status == 200
                except OSError:
                    return False
            wait_for(up, 60, "the monitor to serve")
        finally:
            p.terminate()
            p.communicate(timeout=30)  # reads what is left and closes the pipe
    finally:
        server.stop()
