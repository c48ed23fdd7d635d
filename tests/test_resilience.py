"""A run that survives: workers killed, shut down, Redis restarted, endpoints lost (real processes)."""

from __future__ import annotations

import random
import signal
import time

import pytest
import redis
from rq.registry import FailedJobRegistry

from budgetq.shared import jobs, keys
from budgetq.simulator.local import LocalRedis, LocalSim, free_port
from tests.helpers import Procs, check_invariants, holders, sim_get, wait_for, write_config, write_dataset

FAST = {"heartbeat_ttl_s": 2, "maintenance_interval_s": 0.5, "control_interval_s": 0.2}


def _datasets(tmp_path, names, n=300, budget="40k", **extra):
    ids, specs = {}, []
    for d in names:
        ids[d] = write_dataset(tmp_path / f"{d}.jsonl", n)
        specs.append({"name": d, "path": str(tmp_path / f"{d}.jsonl"), "budget": budget, "id_field": "id",
                      "sampling": {"max_tokens": 2000}, "prior_mean_tokens": 300, **extra})
    return ids, specs


def _recovered_at(conn, ds, job_ids, victim_pid) -> bool:
    """True once every job the dead worker held is running elsewhere or has ended."""
    for job_id in job_ids:
        h = conn.hmget(keys.rq_job_key(job_id), "status", "worker_name")
        status, name = (v.decode() if v else "" for v in h)
        if status == "started" and f"-{victim_pid}-" in name:
            return False
        if status == "queued":
            return False
    return True


def test_workers_killed_at_random_moments_lose_nothing_and_count_nothing_twice(tmp_path, redis_url, conn,
                                                                                sim_factory):
    # ~0.6 s requests, ~12 s of work: six kills land mid-run
    sim = sim_factory("--speedup", "2", "--length-mean", "300", "--seed", "1")
    ids, specs = _datasets(tmp_path, ["A", "B"], n=600, budget="150k")
    cfg = write_config(tmp_path, redis_url, [sim], specs, worker={"concurrency": 16, **FAST})
    procs = Procs(cfg, tmp_path)
    workers = [procs.worker() for _ in range(3)]
    producer = procs.producer()
    rng = random.Random(7)
    kills, recovery_s = 0, []
    try:
        while producer.poll() is None and kills < 6:
            time.sleep(rng.uniform(0.2, 1.0))
            victim = rng.choice([w for w in workers if w.poll() is None])
            pid = victim.pid
            # kill it while it holds jobs (requests in flight or being committed); on a fast machine
            # the run may end first: then there is nothing left to kill
            held = wait_for(lambda pid=pid: {ds: h for ds in ids if (h := holders(conn, ds, pid))}
                            or producer.poll() is not None, 60, "the victim to hold jobs")
            if held is True:
                break
            victim.send_signal(signal.SIGKILL)
            killed_at = time.monotonic()
            kills += 1
            workers.remove(victim)
            workers.append(procs.worker())
            wait_for(lambda held=held, pid=pid: all(_recovered_at(conn, ds, j, pid) for ds, j in held.items()),
                     60, "the killed worker's jobs to run again")
            recovery_s.append(time.monotonic() - killed_at)
        assert producer.wait(120) == 0, procs.log(producer)
    finally:
        procs.stop_all()
    print(f"{kills} SIGKILLs; time from SIGKILL to the dead worker's jobs running again: "
          f"{', '.join(f'{s:.1f}' for s in recovery_s)} s (lease 2 s, maintenance every 0.5 s)")
    # six on a loaded machine; an unloaded one may finish the ~12 s of work after fewer
    assert kills >= 3 and len(recovery_s) == kills
    recovered = 0
    for ds, valid in ids.items():
        states = check_invariants(conn, tmp_path / "out", ds, valid)
        assert states["committed"] > 0 and states["failed"] == 0
        recovered += int(conn.hget(keys.stats_key(ds), "recovered") or 0)
    assert recovered > 0  # jobs of killed workers were requeued by the maintenance pass


def test_frozen_worker_past_its_lease_then_thawed(tmp_path, redis_url, conn, sim_factory):
    """SIGSTOP (a VM paused, a process swapped out, a debugger) past the lease, then SIGCONT: the
    other worker has taken the jobs over; the thawed one comes back with answers in hand, and the
    commit script fences them (done set, reservation), so nothing is written or counted twice."""
    sim = sim_factory("--speedup", "2", "--length-mean", "300", "--seed", "5")  # ~0.6 s requests
    ids, specs = _datasets(tmp_path, ["D"], n=300, budget="1M")
    cfg = write_config(tmp_path, redis_url, [sim], specs, worker={"concurrency": 8, **FAST})
    procs = Procs(cfg, tmp_path)
    frozen, _other = procs.worker(), procs.worker()
    producer = procs.producer()
    try:
        held = wait_for(lambda: holders(conn, "D", frozen.pid), 60, "the worker to hold jobs")
        frozen.send_signal(signal.SIGSTOP)
        try:
            wait_for(lambda: _recovered_at(conn, "D", held, frozen.pid), 60, "its jobs to run elsewhere")
            time.sleep(2 * FAST["heartbeat_ttl_s"])  # frozen well past its lease, not a wait on a condition
        finally:
            frozen.send_signal(signal.SIGCONT)
        assert producer.wait(120) == 0, procs.log(producer)
        assert frozen.poll() is None, "the thawed worker died"
    finally:
        procs.stop_all()
    states = check_invariants(conn, tmp_path / "out", "D", ids["D"])  # I1: used == the rows' tokens
    assert states["committed"] == 300 and states["failed"] == 0
    stats = conn.hgetall(keys.stats_key("D"))
    print(f"{len(held)} jobs held when frozen; late answers fenced: {int(stats.get(b'duplicate_result', 0))} "
          f"duplicate, {int(stats.get(b'rejected', 0))} rejected")


def test_sigterm_lets_requests_finish_and_exits_zero(tmp_path, redis_url, conn, sim_factory):
    # ~2 s requests; the worker gets SIGTERM while they run and a 20 s grace period.
    sim = sim_factory("--speedup", "1", "--length-mean", "1000", "--length-sigma", "0.05", "--peak-tok-s", "8000")
    ids, specs = _datasets(tmp_path, ["D"], n=40, budget="1M")
    cfg = write_config(tmp_path, redis_url, [sim], specs, worker={"concurrency": 8, "grace_s": 20, **FAST})
    procs = Procs(cfg, tmp_path)
    producer = procs.producer()
    first = procs.worker()
    try:
        wait_for(lambda: sim_get(sim, "/sim/stats")["running"] >= 8, 30, "8 requests in flight")
        first.send_signal(signal.SIGTERM)
        started = time.monotonic()
        assert first.wait(30) == 0
        took = time.monotonic() - started
        log = procs.log(first)
        assert "SIGTERM" in log and "requeueing" in log
        # nothing went to failed; requests in flight finished and were committed
        failed = jobs.registry(FailedJobRegistry, "D", conn)
        assert failed.get_job_count(cleanup=False) == 0
        assert int(conn.hget(keys.stats_key("D"), "committed") or 0) >= 8
        assert conn.zcard(keys.rq_wip_key("D")) == 0 and conn.hlen(keys.resv_key("D")) == 0
        print(f"SIGTERM to exit 0: {took:.1f} s (grace 20 s)")
        procs.worker()  # another worker completes the run
        assert producer.wait(120) == 0, procs.log(producer)
    finally:
        procs.stop_all()
    states = check_invariants(conn, tmp_path / "out", "D", ids["D"])
    assert states["committed"] == 40


def test_second_sigint_aborts_at_once_and_requeues(tmp_path, redis_url, conn, sim_factory):
    sim = sim_factory("--speedup", "1", "--length-mean", "20000", "--length-sigma", "0.05",
                      "--peak-tok-s", "2000")
    _ids, specs = _datasets(tmp_path, ["D"], n=20, budget="10M")
    specs[0]["sampling"]["max_tokens"] = 30000
    cfg = write_config(tmp_path, redis_url, [sim], specs, worker={"concurrency": 4, "grace_s": 120, **FAST})
    procs = Procs(cfg, tmp_path)
    producer = procs.producer()
    w = procs.worker()
    try:
        wait_for(lambda: sim_get(sim, "/sim/stats")["running"] >= 4, 30, "4 requests in flight")
        w.send_signal(signal.SIGINT)
        time.sleep(1.2)
        w.send_signal(signal.SIGINT)
        started = time.monotonic()
        w.wait(30)
        took = time.monotonic() - started
        print(f"second SIGINT to exit: {took:.1f} s (grace 120 s)")
        assert took < 20  # far inside the 120 s grace period
        assert conn.zcard(keys.rq_wip_key("D")) == 0 and conn.hlen(keys.resv_key("D")) == 0
        failed = jobs.registry(FailedJobRegistry, "D", conn)
        assert failed.get_job_count(cleanup=False) == 0
        assert conn.llen(keys.rq_queue_key("D")) == 20  # every job is back on the queue
        wait_for(lambda: sim_get(sim, "/sim/stats")["running"] == 0, 15, "the server to abort the requests")
        assert sim_get(sim, "/sim/stats")["aborted_tokens"] > 0
    finally:
        producer.send_signal(signal.SIGKILL)
        procs.stop_all()


def test_redis_restarted_mid_run(tmp_path, sim_factory):
    server = LocalRedis(appendonly=True)
    conn = redis.Redis.from_url(server.url)
    try:
        sim = sim_factory("--speedup", "10", "--length-mean", "300", "--seed", "2")
        ids, specs = _datasets(tmp_path, ["D"], n=200, budget="30k")
        cfg = write_config(tmp_path, server.url, [sim], specs, worker={"concurrency": 16, **FAST})
        procs = Procs(cfg, tmp_path)
        producer = procs.producer()
        workers = [procs.worker() for _ in range(2)]
        try:
            wait_for(lambda: int(conn.get(keys.used_key("D")) or 0) > 5000, 60, "the run to get going")
            run_id = conn.info("server")["run_id"]
            server.kill()  # crash: AOF (fsync every second) keeps what was written
            # longer than redis-py's own retries (~5 s): budgetq's loops must wait it out, and
            # longer than the 2 s lease: jobs in flight are recovered after the restart
            time.sleep(10.0)
            server.start()
            assert conn.info("server")["run_id"] != run_id
            assert producer.wait(180) == 0, procs.log(producer)
            for w in workers:
                assert w.poll() is None, "a worker died with Redis"
        finally:
            procs.stop_all()
        logs = procs.log(workers[0]) + procs.log(producer)
        assert "redis unreachable" in logs
        states = check_invariants(conn, tmp_path / "out", "D", ids["D"])
        assert states["committed"] > 0
    finally:
        server.stop()


def test_two_endpoints_one_killed_then_readmitted(tmp_path, redis_url, conn):
    ports = [free_port(), free_port()]
    args = ("--speedup", "1", "--length-mean", "200", "--seed", "3")  # ~0.5 s requests, ~15 s run
    sims = [LocalSim(*args, port=p) for p in ports]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    ids, specs = _datasets(tmp_path, ["D"], n=600, budget="100k")
    cfg = write_config(tmp_path, redis_url, urls, specs, worker={"concurrency": 16, **FAST},
                       server={"health_interval_s": 0.3, "eject_after_failures": 2, "backoff_base_s": 0.05})
    procs = Procs(cfg, tmp_path)
    producer = procs.producer()
    procs.worker()
    try:
        wait_for(lambda: len(sim_get(urls[1], "/sim/requests")) > 10, 30, "requests on both endpoints")
        sims[1].kill()
        time.sleep(1.5)
        sims[1].start()  # back on the same port, with empty records
        wait_for(lambda: len(sim_get(urls[1], "/sim/requests")) > 5, 30, "the endpoint to be re-admitted")
        assert producer.wait(120) == 0, procs.log(producer)
    finally:
        procs.stop_all()
        for s in sims:
            s.stop()
    log = "".join(procs.log(p) for p in procs.procs)
    assert "taken out" in log and "back in rotation" in log
    states = check_invariants(conn, tmp_path / "out", "D", ids["D"])
    assert states["failed"] == 0


def test_all_endpoints_down_workers_wait_instead_of_failing_jobs(tmp_path, redis_url, conn):
    port = free_port()
    args = ("--speedup", "10", "--length-mean", "200")
    sim = LocalSim(*args, port=port)
    url = f"http://127.0.0.1:{port}"
    ids, specs = _datasets(tmp_path, ["D"], n=150, budget="1M")
    cfg = write_config(tmp_path, redis_url, [url], specs, worker={"concurrency": 8, **FAST},
                       server={"health_interval_s": 0.3, "eject_after_failures": 2, "max_attempts": 3,
                               "backoff_base_s": 0.05})
    procs = Procs(cfg, tmp_path)
    producer = procs.producer()
    w = procs.worker()
    try:
        wait_for(lambda: int(conn.hget(keys.stats_key("D"), "committed") or 0) > 10, 30, "some results")
        sim.kill()
        wait_for(lambda: "all servers are down" in procs.log(w), 20, "the worker to say so")
        time.sleep(2.0)  # far more than 3 attempts' worth of backoff
        sim.start()
        assert producer.wait(120) == 0, procs.log(producer)
    finally:
        procs.stop_all()
        sim.stop()
    states = check_invariants(conn, tmp_path / "out", "D", ids["D"])
    assert states["failed"] == 0 and states["committed"] == 150


def test_killed_producer_restarts_and_generates_nothing_twice(tmp_path, redis_url, conn, sim_factory):
    sim = sim_factory("--speedup", "10", "--length-mean", "200", "--seed", "4")
    ids, specs = _datasets(tmp_path, ["D"], n=300, budget="1M")
    cfg = write_config(tmp_path, redis_url, [sim], specs, worker={"concurrency": 16, **FAST})
    procs = Procs(cfg, tmp_path)
    procs.worker()
    first = procs.producer()
    try:
        wait_for(lambda: (tmp_path / "out" / "D.jsonl").exists() and
                 len((tmp_path / "out" / "D.jsonl").read_text().splitlines()) > 50, 60, "rows on disk")
        first.send_signal(signal.SIGKILL)
        first.wait()
        assert procs.producer().wait(120) == 0
    finally:
        procs.stop_all()
    states = check_invariants(conn, tmp_path / "out", "D", ids["D"])
    assert states["committed"] == 300
    requests = sim_get(sim, "/sim/requests")
    assert len(requests) == 300  # no prompt generated twice
    assert len({r["rid"] for r in requests}) == 300


@pytest.mark.parametrize("crash_after_fsync", [True])
def test_collector_that_died_before_saving_its_cursor_writes_no_row_twice(tmp_path, conn, crash_after_fsync):
    from budgetq.producer.run.collector import Collector
    from budgetq.shared import budget
    from budgetq.shared.config import DatasetConfig
    from budgetq.shared.scripts import run

    budget.register_dataset(conn, DatasetConfig(name="D", path="x", budget="1M"))
    for i in range(5):
        run(conn, budget.reserve("D", f"j{i}", 100))
        run(conn, budget.commit("D", f"j{i}", 1, 10, "stop", f'{{"id": "p{i}", "completion_tokens": 10}}'))
    out = tmp_path / "out"
    c = Collector(conn, out, ["D"])
    entries = conn.xrange(keys.results_key("D"))
    c._write("D", c.paths["D"], entries)  # rows on disk, cursor not saved: the producer "died" here
    with open(out / "D.jsonl", "a") as fh:
        fh.write('{"id": "p9", "comp')  # and a torn line from a crash mid-write
    again = Collector(conn, out, ["D"])
    assert again.drain() == 0
    lines = (out / "D.jsonl").read_text().splitlines()
    assert sorted(lines) == sorted(f'{{"id": "p{i}", "completion_tokens": 10}}' for i in range(5))

