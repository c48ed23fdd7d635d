"""Redis Sentinel: ``redis+sentinel://`` URLs, and a run whose master is SIGKILLed for good mid-run.

Loopback, no namespaces: a master, one replica and three sentinels (quorum 2), each a
``redis-server`` process (``--sentinel`` is Sentinel mode of the same binary). Idle sentinels
cost next to nothing, so the realistic three fit on a 2-core machine.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import redis

from budgetq.shared import keys
from budgetq.shared.errors import ConfigError
from budgetq.shared.redis_conn import (
    CONNECT_TIMEOUT_S,
    SOCKET_TIMEOUT_S,
    aconnect,
    check_url,
    connect,
    connect_once,
    describe,
    explain,
    parse_sentinel,
)
from budgetq.simulator.local import LocalRedis, LocalSim, free_port
from tests.helpers import PY, ROOT, Procs, check_invariants, cli_out, rows, wait_for, write_config, write_dataset

SERVICE = "bq"


@pytest.mark.parametrize(("url", "why"), [
    ("redis+sentinel://u:s3cret@h1:26379,h2/bq/0", "'h2' is not HOST:PORT"),
    ("redis+sentinel://u:s3cret@h1:26379,h2:99999/bq/0", "'h2:99999' is not HOST:PORT"),
    ("redis+sentinel://:s3cret@h1:26379", "no SERVICE"),
    ("redis+sentinel://:s3cret@h1:26379/bq/x", "the database must be a number (got /x)"),
    ("redis+sentinel://:s3cret@/bq/0", "an empty host"),
    ("redis+sentinel://:s3cret@h1:26379/bq/0?socket_timeout=ten", "socket_timeout must be a number of seconds "
                                                                 "above 0 (got 'ten')"),
    ("redis+sentinel://:s3cret@h1:26379/bq/0?socket_connect_timeout=0", "socket_connect_timeout must be a number"),
    ("redis+sentinel://:s3cret@h1:26379/bq/0?socket_timeout=", "(got '')"),
    ("redis+sentinel://:s3cret@h1:26379/bq/0?ssl=true", "'ssl' is not an option of a redis+sentinel:// URL"),
])
def test_a_malformed_sentinel_url_is_one_line_naming_it_without_the_password(url, why):
    with pytest.raises(ConfigError) as err:
        check_url(url)
    msg = str(err.value)
    assert why in msg and "s3cret" not in msg and "***" in msg and "\n" not in msg
    assert msg.startswith("redis_url 'redis+sentinel://")


def test_a_sentinel_url_parses():
    s = parse_sentinel("redis+sentinel://app:p%40ss@10.0.0.1:26379,10.0.0.2:26380,[::1]:26381/my-master/3")
    assert s.sentinels == [("10.0.0.1", 26379), ("10.0.0.2", 26380), ("::1", 26381)]
    assert (s.service, s.db, s.username, s.password) == ("my-master", 3, "app", "p@ss")
    assert parse_sentinel("redis+sentinel://h:1/m").db == 0
    assert describe("redis+sentinel://a:b@h:1,g:2/m/0") == "sentinel h:1,g:2 master m/0"


def test_a_sentinel_urls_timeouts_reach_the_master_and_the_sentinels():
    """redis-py's from_url never sees a redis+sentinel:// URL: its ?socket_timeout= was dropped, leaving the
    master's connections with none (a hung master held a command forever)."""
    url = "redis+sentinel://:pw@127.0.0.1:1,127.0.0.1:2/bq/0?socket_timeout=2.5&socket_connect_timeout=1.5"
    clients = [connect(url), aconnect(url)]
    for client in clients:
        pool = client.connection_pool
        kw = pool.connection_kwargs
        assert (kw["socket_timeout"], kw["socket_connect_timeout"]) == (2.5, 1.5)
        for s in pool.sentinel_manager.sentinels:
            kw = s.connection_pool.connection_kwargs
            assert (kw["socket_timeout"], kw["socket_connect_timeout"]) == (2.5, 1.5)
    plain = connect("redis+sentinel://127.0.0.1:1/bq/0").connection_pool.connection_kwargs
    assert (plain["socket_timeout"], plain["socket_connect_timeout"]) == (SOCKET_TIMEOUT_S, CONNECT_TIMEOUT_S)


def test_a_hung_master_fails_a_command_within_the_sentinel_urls_socket_timeout(tmp_path):
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server not found (apt-get install redis-server)")
    master = LocalRedis()
    port = free_port()
    conf = tmp_path / "sentinel.conf"  # one sentinel, slow to call the master down: no failover meanwhile
    conf.write_text(f"port {port}\nbind 127.0.0.1\ndir {tmp_path}\n"
                    f"sentinel monitor {SERVICE} 127.0.0.1 {master.port} 1\n"
                    f"sentinel down-after-milliseconds {SERVICE} 60000\n")
    with open(tmp_path / "sentinel.log", "w") as log:
        sentinel = subprocess.Popen(["redis-server", str(conf), "--sentinel"], stdout=log, stderr=subprocess.STDOUT)
    assert master.proc is not None
    try:
        wait_for(lambda: _master_known(port), 60, "the sentinel to name the master")
        conn = connect(f"redis+sentinel://127.0.0.1:{port}/{SERVICE}/0?socket_timeout=1")
        assert conn.ping()
        master.proc.send_signal(signal.SIGSTOP)  # hung: the kernel still accepts, nothing answers
        got: dict[str, object] = {}

        def ping() -> None:
            started = time.monotonic()
            try:
                got["reply"] = conn.ping()
            except redis.RedisError as exc:
                got["error"] = exc
            got["s"] = time.monotonic() - started

        thread = threading.Thread(target=ping, daemon=True)
        thread.start()
        thread.join(SOCKET_TIMEOUT_S + 20)
        assert not thread.is_alive(), "a command to the hung master did not return: its connection has no timeout"
        # 1 s asked, and 4 s of slack for a loaded machine: under both our default (10 s) and redis-py's own
        # (5 s, what a master connection got when the URL's value was dropped), so the URL's timeout ended it
        assert isinstance(got.get("error"), redis.TimeoutError) and float(got["s"]) < 4, got
    finally:
        master.proc.send_signal(signal.SIGCONT)
        sentinel.kill()
        sentinel.wait(10)
        master.stop()


def _master_known(port: int) -> bool:
    try:
        return bool(redis.Redis(port=port, socket_timeout=1).sentinel_get_master_addr_by_name(SERVICE))
    except redis.RedisError:
        return False


def test_no_sentinel_answering_is_one_short_line():
    url = f"redis+sentinel://:s3cret@127.0.0.1:{free_port()}/bq/0"
    with pytest.raises(redis.ConnectionError) as err:
        connect_once(url).ping()
    msg = explain(err.value, url)
    assert msg.startswith("cannot reach Redis at sentinel 127.0.0.1:") and "no sentinel named the master" in msg
    assert "Connection refused" in msg and "s3cret" not in msg and "\n" not in msg and len(msg) < 300, msg


class Replicated:
    """Master, replica and three sentinels on loopback; ``url`` is the redis+sentinel:// URL."""

    def __init__(self, down_after_ms: int = 1000) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="budgetq-sentinel-"))
        self.procs: dict[str, subprocess.Popen] = {}
        self.master_port, self.replica_port = free_port(), free_port()
        self.sentinel_ports = [free_port() for _ in range(3)]
        try:
            self._server("master", self.master_port)
            self._server("replica", self.replica_port, "--replicaof", "127.0.0.1", str(self.master_port))
            for i, port in enumerate(self.sentinel_ports):
                conf = self.dir / f"sentinel{i}.conf"  # a sentinel rewrites its config: one file each
                conf.write_text(f"port {port}\nbind 127.0.0.1\ndir {self.dir}\n"
                                f"sentinel monitor {SERVICE} 127.0.0.1 {self.master_port} 2\n"
                                f"sentinel down-after-milliseconds {SERVICE} {down_after_ms}\n"
                                f"sentinel failover-timeout {SERVICE} 5000\n")
                self._spawn(f"sentinel{i}", str(conf), "--sentinel")
            sentinel = redis.Redis(port=self.sentinel_ports[0])
            # ready for a failover: the replica in sync, and each sentinel knows the other two
            wait_for(lambda: redis.Redis(port=self.replica_port).info("replication").get("master_link_status") == "up",
                     60, "the replica to sync")
            wait_for(lambda: all(len(redis.Redis(port=p).sentinel_sentinels(SERVICE)) == 2 and
                                 len(redis.Redis(port=p).sentinel_slaves(SERVICE)) == 1 for p in self.sentinel_ports),
                     60, "the sentinels to know each other and the replica")
            assert sentinel.sentinel_get_master_addr_by_name(SERVICE)[1] == self.master_port
        except BaseException:
            self.stop()
            raise
        hosts = ",".join(f"127.0.0.1:{p}" for p in self.sentinel_ports)
        self.url = f"redis+sentinel://{hosts}/{SERVICE}/0"

    def _spawn(self, name: str, *args: str) -> None:
        with open(self.dir / f"{name}.log", "w") as log:
            self.procs[name] = subprocess.Popen(["redis-server", *args], stdout=log, stderr=subprocess.STDOUT)

    def _server(self, name: str, port: int, *extra: str) -> None:
        self._spawn(name, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(self.dir), "--save", "",
                    "--dbfilename", f"{name}.rdb", "--appendonly", "no", *extra)
        wait_for(lambda: _pings(port), 60, f"redis {name} to start")

    def master_addr(self) -> int:
        return int(redis.Redis(port=self.sentinel_ports[0]).sentinel_get_master_addr_by_name(SERVICE)[1])

    def kill_master(self) -> None:
        self.procs["master"].send_signal(signal.SIGKILL)
        self.procs["master"].wait(10)

    def stop(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()
            p.wait(10)
        shutil.rmtree(self.dir, ignore_errors=True)


def cut_replication(replica: redis.Redis) -> None:
    """The replica stops receiving its master's writes, which the master goes on acknowledging: its link
    is dropped and every reconnection refused (it now sends a password, and the master has none). A
    network partition between the two, for Redis; sentinels still see both."""
    replica.config_set("masterauth", "not-the-masters-password")
    replica.client_kill_filter(_type="master")
    wait_for(lambda: replica.info("replication").get("master_link_status") == "down", 30, "the replica cut off")


def _committed_seen_by_monitor(port: int) -> int:
    """Dataset D's committed count in the monitor's /api/status (-1 while it does not answer 200)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/status", timeout=5) as resp:
            snap = json.loads(resp.read())
    except (OSError, ValueError):
        return -1
    return next((int(d["counts"]["committed"]) for d in snap.get("datasets", []) if d.get("dataset") == "D"), -1)


def _pings(port: int) -> bool:
    try:
        return bool(redis.Redis(port=port, socket_timeout=1).ping())
    except redis.ConnectionError:
        return False


@pytest.fixture
def replicated():
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server not found (apt-get install redis-server)")
    r = Replicated()
    yield r
    r.stop()


def test_master_killed_for_good_mid_run_the_run_completes_on_the_promoted_replica(tmp_path, replicated,
                                                                                   sim_factory):
    sim = sim_factory("--speedup", "4", "--length-mean", "300", "--seed", "6")
    ids = write_dataset(tmp_path / "D.jsonl", 240)
    specs = [{"name": "D", "path": str(tmp_path / "D.jsonl"), "budget": "10M", "id_field": "id",
              "sampling": {"max_tokens": 2000}, "prior_mean_tokens": 300}]
    cfg = write_config(tmp_path, replicated.url, [sim], specs,
                       worker={"concurrency": 8, "heartbeat_ttl_s": 4, "maintenance_interval_s": 0.5,
                               "control_interval_s": 0.2})
    master = redis.Redis(port=replicated.master_port)
    procs = Procs(cfg, tmp_path)
    workers = [procs.worker(), procs.worker()]
    producer = procs.producer()
    port = free_port()
    monitor = procs.start("monitor", "--port", str(port))
    try:
        wait_for(lambda: int(master.hget(keys.stats_key("D"), "committed") or 0) >= 40, 60, "the run to get going")
        wait_for(lambda: _committed_seen_by_monitor(port) >= 40, 60, "the monitor to serve the run")
        replicated.kill_master()
        killed_at = time.monotonic()
        wait_for(lambda: replicated.master_addr() == replicated.replica_port, 60, "the replica promoted")
        promoted_s = time.monotonic() - killed_at
        assert producer.wait(180) == 0, procs.log(producer)
        assert all(w.poll() is None for w in workers), "a worker died with the master"
        status = cli_out(cfg, "status")  # status follows the sentinels too
        # and so does the monitor, which was serving before the failover: it reads the promoted replica
        wait_for(lambda: _committed_seen_by_monitor(port) == 240, 60, "the monitor to show the whole run")
        assert monitor.poll() is None, procs.log(monitor)
    finally:
        procs.stop_all()
    assert "D" in status
    logs = "".join(procs.log(p) for p in procs.procs)
    assert "Traceback" not in logs
    conn = connect(replicated.url)
    assert conn.connection_pool.get_master_address()[1] == replicated.replica_port
    assert connect_once(replicated.url).ping()  # budgetq check's fail-fast client follows it too
    out = tmp_path / "out"
    on_disk = sum(r["completion_tokens"] for r in rows(out / "D.jsonl"))
    used_after_run = int(conn.get(keys.used_key("D")) or 0)
    # Replication is asynchronous: increments the master acknowledged but had not yet sent to the
    # replica are gone with it. The rows on disk are the truth; reconcile brings Redis back to them.
    rec = subprocess.run([*PY, "reconcile", "-c", str(cfg)], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert rec.returncode == 0, rec.stderr
    print(f"promoted after {promoted_s:.1f} s; used {used_after_run} after the run, {on_disk} on disk; "
          f"reconcile: {rec.stdout.strip()[-300:]}")
    states = check_invariants(conn, out, "D", ids)  # used == the rows' tokens, each prompt once
    assert states["committed"] == 240 and states["failed"] == 0


def _committed(conn: redis.Redis) -> int:
    return int(conn.hget(keys.stats_key("D"), "committed") or 0)


def _lines(path: Path) -> int:
    return path.read_bytes().count(b"\n") if path.exists() else 0


def test_a_failover_that_loses_acknowledged_commits_is_repaired_by_reconcile(tmp_path):
    """The replica is cut off while the master goes on committing and the collector writing those rows;
    then the master dies and the replica, promoted, lacks them. Their jobs run again (leases lapse) on an
    engine that samples anew (the simulator restarted with another seed: another length per prompt), so
    ``used`` counts the re-runs while the files keep the first rows: ``reconcile`` makes them agree."""
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server not found (apt-get install redis-server)")
    sim = LocalSim("--speedup", "4", "--length-mean", "300", "--seed", "6", cwd=ROOT)
    # down-after 2 s: the sentinels promote a replica whose link has been down up to 10 x that (plus the time
    # since the master went down), and this one's is down from the cut to the failover
    try:
        replicated = Replicated(down_after_ms=2000)
    except BaseException:
        sim.stop()
        raise
    try:   # both stopped whatever happens (a failed wait once left the five redis-servers running)
        n = 160
        ids = write_dataset(tmp_path / "D.jsonl", n)
        specs = [{"name": "D", "path": str(tmp_path / "D.jsonl"), "budget": "10M", "id_field": "id",
                  "sampling": {"max_tokens": 2000}, "prior_mean_tokens": 300}]
        cfg = write_config(tmp_path, replicated.url, [sim.url], specs,
                           worker={"concurrency": 8, "heartbeat_ttl_s": 4, "maintenance_interval_s": 0.5,
                                   "control_interval_s": 0.2})
        master, replica = redis.Redis(port=replicated.master_port), redis.Redis(port=replicated.replica_port)
        out = tmp_path / "out" / "D.jsonl"
        procs = Procs(cfg, tmp_path)
        try:
            procs.worker()
            procs.worker()
            producer = procs.producer()
            # every prompt enqueued and some committed, all of it on the replica, before the cut
            wait_for(lambda: int(replica.hget(keys.stats_key("D"), "enqueued") or 0) == n
                     and _committed(replica) >= 20, 90, "the run to get going on both")
            cut_replication(replica)
            known = _committed(replica)  # all the replica will ever know of the old master's commits
            wait_for(lambda: _lines(out) >= known + 8, 60, "rows of commits the replica never got, on disk")
            acknowledged = _committed(master)
            replicated.kill_master()
            assert _committed(replica) == known < acknowledged  # acknowledged increments, gone with the master
            sim.kill()
            sim.flags = ("--speedup", "4", "--length-mean", "300", "--seed", "7")
            sim.start()
            wait_for(lambda: replicated.master_addr() == replicated.replica_port, 60, "the replica promoted")
            assert producer.wait(180) == 0, procs.log(producer)
        finally:
            procs.stop_all()
            sim.stop()
        logs = "".join(procs.log(p) for p in procs.procs)
        assert "Traceback" not in logs
        conn = connect(replicated.url)
        on_disk = rows(out)
        tokens = sum(r["completion_tokens"] for r in on_disk)
        used_before = int(conn.get(keys.used_key("D")) or 0)
        assert len(on_disk) == n and used_before != tokens, "no acknowledged commit was lost, or none ran again"
        rec = subprocess.run([*PY, "reconcile", "--json", "-c", str(cfg)], cwd=ROOT, capture_output=True,
                             text=True, timeout=60)
        assert rec.returncode == 0, rec.stderr
        report = json.loads(rec.stdout)[0]
        print(f"{known} commits replicated before the cut, {acknowledged} acknowledged, {n} rows in the end; "
              f"used {used_before} after the run, {tokens} in the rows; reconcile: {report}")
        assert (report["used_before"], report["used_after"]) == (used_before, tokens)
        states = check_invariants(conn, tmp_path / "out", "D", ids)  # used == the rows' tokens, each prompt once
        assert states["committed"] == n and states["failed"] == 0
    finally:
        replicated.stop()
        sim.stop()
