"""Faults between hosts (tests/netns.py): a worker cut off from Redis or from its server, a lossy
link to the server. Each run ends with every prompt exactly once, no token counted twice and the
ledger balanced (tests/helpers.py check_invariants). The frozen worker (SIGSTOP past its lease)
is one box's fault: tests/test_resilience.py.

Time is scaled down by config, in proportion: the issue's 60 s partition against the default
30 s lease (two leases) is here a 12 s partition against a 4 s lease (three leases, so that the
worker's status entry, kept 2 leases, has expired before the link heals)."""

from __future__ import annotations

import json
import subprocess
import time

import pytest

from budgetq.shared import keys
from tests.helpers import PY, ROOT, Procs, check_invariants, holders, wait_for, write_config, write_dataset
from tests.netns import Net, NsRedis, NsSim, net_fixture

LEASE_S = 4
PARTITION_S = 3 * LEASE_S
FAST = {"heartbeat_ttl_s": LEASE_S, "maintenance_interval_s": 0.5, "control_interval_s": 0.2, "concurrency": 8}
net = pytest.fixture(net_fixture)


def _run_setup(net: Net, tmp_path, n: int, *sim_flags: str, server: dict | None = None):
    rds = NsRedis(net)
    sim = NsSim(net, "--speedup", "2", "--length-mean", "300", "--seed", "1", *sim_flags)
    ids = write_dataset(tmp_path / "D.jsonl", n)
    specs = [{"name": "D", "path": str(tmp_path / "D.jsonl"), "budget": "10M", "id_field": "id",
              "sampling": {"max_tokens": 2000}, "prior_mean_tokens": 300}]
    cfg = write_config(tmp_path, rds.url, [sim.url], specs, worker=FAST, server=server or {})
    return rds, sim, ids, cfg, Procs(cfg, tmp_path)


def _status(net: Net, cfg) -> dict:
    """``budgetq status --json`` as the operator runs it on the Redis host."""
    out = subprocess.run([*net.on("redis"), *PY, "status", "--json", "-c", str(cfg)], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def _listed(net: Net, cfg, pid: int) -> bool:
    return any(w.get("pid") == pid for w in _status(net, cfg)["workers"])


def _taken_over(conn, job_ids: set[str], pid: int) -> bool:
    """True once no job of ``job_ids`` is still held by worker ``pid`` or waiting in the queue."""
    for job_id in job_ids:
        status, name = (v.decode() if v else "" for v in conn.hmget(keys.rq_job_key(job_id), "status", "worker_name"))
        if status == "queued" or (status == "started" and f"-{pid}-" in name):
            return False
    return True


def _fenced(conn) -> int:
    """Results refused by the commit script: a prompt already committed, or an admission lost."""
    stats = conn.hgetall(keys.stats_key("D"))
    return sum(int(stats.get(k, 0)) for k in (b"duplicate_result", b"rejected"))


def test_worker_cut_off_from_redis_mid_run(net, tmp_path):
    rds, sim, ids, cfg, procs = _run_setup(net, tmp_path, 160)
    conn = rds.local
    w1 = procs.worker(on=net.on("w1"))
    producer = procs.producer(on=net.on("redis"))
    try:
        wait_for(lambda: _listed(net, cfg, w1.pid), 60, "w1 in status")
        wait_for(lambda: holders(conn, "D", w1.pid), 60, "w1 to hold jobs")
        net.cut("w1", "redis")
        cut_at = time.monotonic()
        held = holders(conn, "D", w1.pid)  # what w1 holds as it is cut off (it can change nothing now)
        assert held, "w1's jobs ended between the check and the cut"
        # w2 joins only now: on a loaded machine a w2 started beside w1 ran the whole dataset before w1
        # claimed a job, and one started before the cut gave w1 the time to run it all (both seen)
        procs.worker(on=net.on("w2"))
        wait_for(lambda: _taken_over(conn, held, w1.pid), 3 * LEASE_S + 10, "w1's jobs to be taken over")
        taken_s = time.monotonic() - cut_at
        wait_for(lambda: not _listed(net, cfg, w1.pid), 20, "status to show w1 gone")
        gone_s = time.monotonic() - cut_at
        time.sleep(max(0.0, cut_at + PARTITION_S - time.monotonic()))  # the partition's length, not a wait
        net.heal("w1", "redis")
        healed_at = time.monotonic()
        wait_for(lambda: _listed(net, cfg, w1.pid), 40, "status to show w1 back")
        back_s = time.monotonic() - healed_at
        assert producer.wait(120) == 0, procs.log(producer)
        assert w1.poll() is None, "w1 died of the partition"
        wait_for(lambda: _fenced(conn) > 0 or "lease ran out" in procs.log(w1), 30, "w1's late answers")
    finally:
        procs.stop_all()
    print(f"{len(held)} jobs of w1 taken over {taken_s:.1f} s after the cut (lease {LEASE_S} s); w1 gone from "
          f"status after {gone_s:.1f} s, back {back_s:.1f} s after the heal; {_fenced(conn)} late answers fenced")
    states = check_invariants(conn, tmp_path / "out", "D", ids)
    assert states["committed"] == 160 and states["failed"] == 0
    # w1 came back with answers for jobs another worker had taken over: refused by the commit script,
    # or (a request that failed meanwhile) dropped as no longer its own
    assert _fenced(conn) > 0 or "lease ran out" in procs.log(w1)


def test_worker_cut_off_from_its_server(net, tmp_path):
    # a black hole keeps a sent request waiting for the whole request timeout (3600 s by default):
    # 5 s here, so that the endpoint is seen failing within the test
    rds, sim, ids, cfg, procs = _run_setup(net, tmp_path, 160, server={
        "timeout_s": 5, "connect_timeout_s": 2, "eject_after_failures": 2, "health_interval_s": 0.5,
        "backoff_base_s": 0.05, "backoff_max_s": 0.5})
    conn = rds.local
    w1 = procs.worker(on=net.on("w1"))
    w2 = procs.worker(on=net.on("w2"))
    producer = procs.producer(on=net.on("redis"))
    try:
        wait_for(lambda: holders(conn, "D", w1.pid) and holders(conn, "D", w2.pid), 60, "both workers to hold jobs")
        net.cut("w1", "server")
        wait_for(lambda: "handing" in procs.log(w1), 60, "w1 to hand its jobs back")
        committed = int(conn.hget(keys.stats_key("D"), "committed") or 0)
        wait_for(lambda: int(conn.hget(keys.stats_key("D"), "committed") or 0) > committed + 10, 60,
                 "w2 to go on committing")
        assert not holders(conn, "D", w1.pid)
        assert producer.wait(120) == 0, procs.log(producer)
    finally:
        procs.stop_all()
    log = procs.log(w1)
    taken_out = [line for line in log.splitlines() if "taken out" in line]
    print(taken_out[0] if taken_out else log[-2000:])
    assert len(taken_out) == 1 and sim.url in taken_out[0]
    assert "all servers are down" in log and "Traceback" not in log
    states = check_invariants(conn, tmp_path / "out", "D", ids)
    assert states["committed"] == 160 and states["failed"] == 0


def test_lossy_link_to_the_server(net, tmp_path):
    rds, sim, ids, cfg, procs = _run_setup(net, tmp_path, 150)
    conn = rds.local
    for w in ("w1", "w2"):
        net.lose(w, "server", 0.02)
        procs.worker(on=net.on(w))
    producer = procs.producer(on=net.on("redis"))
    longest_gap, last, last_at = 0.0, -1, time.monotonic()
    try:
        while producer.poll() is None:  # progress, sampled: a stall would show as a long gap
            now, done = time.monotonic(), int(conn.hget(keys.stats_key("D"), "committed") or 0)
            if done != last:
                last, last_at = done, now
            longest_gap = max(longest_gap, now - last_at)
            assert longest_gap < 60, f"no result committed for {longest_gap:.0f} s at {last}/150"
            time.sleep(0.2)
        assert producer.wait(10) == 0, procs.log(producer)
    finally:
        procs.stop_all()
    dropped = net.dropped("w1") + net.dropped("w2")
    print(f"2% loss each way: {dropped} packets dropped; longest time without a commit {longest_gap:.1f} s")
    assert dropped > 0
    states = check_invariants(conn, tmp_path / "out", "D", ids)
    assert states["committed"] == 150 and states["failed"] == 0
