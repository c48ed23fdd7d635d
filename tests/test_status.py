"""``budgetq status``: the snapshot from Redis state written per the contract, and against a live run."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import redis
from rq import Queue
from rq.registry import FailedJobRegistry
from rq.serializers import JSONSerializer

from budgetq.shared import budget as bq_budget
from budgetq.shared import keys
from budgetq.shared.budget import register_dataset
from budgetq.shared.config import DatasetConfig
from budgetq.shared.scripts import run as run_script
from budgetq.shared.status import COUNT_FIELDS, snapshot
from budgetq.simulator.local import free_port
from tests.helpers import CLI, LIVE, ROOT, live_run, producer_running, rows, three_datasets, write_config


def _cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def _worker_hash(conn, name: str, endpoints: dict, in_flight: int, started_at: float) -> None:
    """A worker's heartbeat hash exactly as the contract in shared/keys.py describes it."""
    conn.sadd(keys.WORKERS, name)
    conn.hset(keys.worker_key(name), mapping={
        "host": "gpu-node-1", "pid": 4242, "started_at": f"{started_at:.3f}", "concurrency": 64,
        "in_flight": in_flight, "processed": 17, "endpoints": json.dumps(endpoints)})
    conn.expire(keys.worker_key(name), 30)


def _seed(conn) -> float:
    """Two datasets with counters, reservations, queued and failed jobs, rate buckets, workers, control log."""
    producer_running(conn)
    for name, budget, mode in (("A1", "10k", "soft"), ("B2", "2k", "strict")):
        register_dataset(conn, DatasetConfig(name=name, path="x", budget=budget, mode=mode,
                                             sampling={"max_tokens": 500}, prior_mean_tokens=100))
    now = conn.time()[0]
    conn.hset(keys.conf_key("A1"), "registered_at", now - 1000)
    for i, tokens in enumerate((300, 500)):
        run_script(conn, bq_budget.reserve("A1", f"A1-p{i}", 500))
        run_script(conn, bq_budget.commit("A1", f"A1-p{i}", 0, tokens, "stop", "{}"))
    run_script(conn, bq_budget.reserve("A1", "A1-p9", 500))  # one request in flight
    run_script(conn, bq_budget.reserve("B2", "B2-p0", 500))
    # strict: 1900 + 500 > 2000, no room for another
    run_script(conn, bq_budget.commit("B2", "B2-p0", 0, 1900, "stop", "{}"))
    conn.hset(keys.stats_key("A1"), mapping={"skipped": 4, "invalid": 2, "generated_tokens": 900, "wasted_tokens": 100})
    q = Queue(keys.queue_name("A1"), connection=conn, serializer=JSONSerializer)
    for i in range(3):
        q.enqueue("budgetq.worker.job.run_prompt", {"id": f"q{i}"}, job_id=f"A1-q{i}")
    conn.zadd(FailedJobRegistry(keys.queue_name("A1"), connection=conn).key, {"A1-bad": now + 86400})
    bucket = now // keys.RATE_BUCKET_S * keys.RATE_BUCKET_S
    # commit.lua wrote the current bucket; replace the rate history with a known one
    conn.delete(keys.rate_key("A1"), keys.rate_key("B2"))
    conn.hset(keys.rate_key("A1"), mapping={str(bucket - 30): 600, str(bucket - 120): 200})
    ep_a, ep_b = "http://gpu-a:30000", "http://gpu-b:30000"
    _worker_hash(conn, "w1", {ep_a: {"healthy": True, "in_flight": 5, "failures": 0, "ejected_since": None,
                                     "prompt_tokens": 1000, "cached_tokens": 600},
                              ep_b: {"healthy": False, "in_flight": 0, "failures": 3, "ejected_since": now - 20}},
                 in_flight=5, started_at=now - 100)
    _worker_hash(conn, "w2", {ep_a: {"healthy": False, "in_flight": 2, "failures": 1, "ejected_since": None},
                              ep_b: {"healthy": False, "in_flight": 0, "failures": 4, "ejected_since": now - 50}},
                 in_flight=2, started_at=now - 10)
    conn.sadd(keys.WORKERS, "w-dead")  # its hash expired: a dead worker
    for i, action in enumerate(("budget_set", "pause", "resume")):
        conn.xadd(keys.CONTROL_LOG, {"ts": now - 10 + i, "who": "ops@host", "action": action, "dataset": "A1",
                                     "old": str(i), "new": str(i + 1)})
    return float(now)


def test_snapshot_reads_every_counter_of_the_contract(conn, redis_url):
    now = _seed(conn)
    snap = snapshot(conn, redis_url, ["http://gpu-a:30000", "http://gpu-c:30000"], history_s=600)
    assert snap["schema"] == 5 and snap["history_s"] == 600
    assert abs(snap["generated_at"] - now) < 60
    a1, b2 = snap["datasets"]
    assert (a1["dataset"], a1["budget"], a1["used"], a1["in_flight"]) == ("A1", 10_000, 800, 1)
    assert a1["reserved"] == int(conn.get(keys.reserved_key("A1"))) > 0
    assert a1["state"] == "running" and a1["mode"] == "soft" and not a1["paused"] and not a1["exhausted"]
    assert a1["used_pct"] == 8.0 and a1["remaining"] == 9200 and a1["mean_tokens"] == 400.0
    assert a1["queued"] == 3 and a1["ledger"]["failed"] == 1 and a1["hold"] is None and "failed_registry" not in a1
    assert a1["counts"] == {**{f: 0 for f in COUNT_FIELDS}, "committed": 2, "skipped": 4, "invalid": 2}
    assert a1["tokens"] == {"counted": 800, "generated": 900, "wasted": 100, "kept": 800, "truncated": 0,
                            "discarded": 0, "spent": 900}
    assert a1["budget_counts"] == "kept" and a1["discarded_by_reason"] == {}
    # 600 tokens in the last minute (the bucket 120 s ago is outside the window)
    assert 600 / 66 <= a1["tok_s"] <= 600 / 60
    assert a1["eta_s"] == pytest.approx(9200 / a1["tok_s"], rel=0.01)
    assert len(a1["history"]) == 120 and sum(v for _t, v in a1["history"]) == 800
    assert all(t % keys.RATE_BUCKET_S == 0 for t, _v in a1["history"])
    assert b2["mode"] == "strict" and b2["exhausted"] and b2["state"] == "done"
    assert b2["tok_s"] is None and b2["eta_s"] is None and b2["in_flight"] == 0  # done: no rate, no ETA

    assert [w["name"] for w in snap["workers"]] == ["w1", "w2"]  # w-dead has no hash: gone
    w1 = snap["workers"][0]
    assert (w1["host"], w1["pid"], w1["concurrency"]) == ("gpu-node-1", 4242, 64)
    assert (w1["in_flight"], w1["processed"]) == (5, 17)
    assert 99 <= w1["uptime_s"] <= 160
    eps = {e["url"]: e for e in snap["endpoints"]}
    assert eps["http://gpu-a:30000"] | {} == {"url": "http://gpu-a:30000", "healthy": True, "in_flight": 7,
                                              "failures": 1, "workers": 2, "healthy_workers": 1,
                                              "ejected_since": None, "prompt_tokens": 1000, "cached_tokens": 600,
                                              # what the server is and its load: none published by these workers
                                              "kind": None, "model": None, "load": None}
    b = eps["http://gpu-b:30000"]
    assert b["healthy"] is False and b["failures"] == 7 and b["ejected_since"] == now - 50
    assert eps["http://gpu-c:30000"]["healthy"] is None and eps["http://gpu-c:30000"]["workers"] == 0
    assert [c["action"] for c in snap["control"]] == ["resume", "pause", "budget_set"]  # newest first
    assert snap["control"][0] | {"id": None} == {"id": None, "ts": now - 8, "who": "ops@host", "action": "resume",
                                                 "dataset": "A1", "old": "2", "new": "3"}
    assert snap["totals"]["workers"] == 2 and snap["totals"]["used"] == 800 + 1900
    assert snap["stall"] is None and snap["diagnosis"] is None  # live workers, no server fault
    json.dumps(snap)  # JSON-able as is


def test_status_cli_json_text_and_watch(conn, redis_url):
    _seed(conn)
    out = _cli("status", "--redis-url", redis_url, "--json")
    assert out.returncode == 0, out.stderr
    snap = json.loads(out.stdout)
    assert [d["dataset"] for d in snap["datasets"]] == ["A1", "B2"] and len(snap["datasets"][0]["history"]) == 12
    assert set(snap) == {"schema", "generated_at", "redis", "redis_tls", "history_s", "totals", "datasets",
                         "workers", "endpoints", "server_faults", "diagnosis", "stall", "control", "control_auto",
                         "plan", "features", "producer", "producer_absent"}
    assert snap["plan"] is None  # neither a deadline nor a total
    assert snap["producer"]["pid"] == os.getpid() and snap["producer_absent"] is None
    assert snap["features"] == {}  # no dataset has captured hidden states

    text = _cli("status", "--redis-url", redis_url)
    assert text.returncode == 0, text.stderr
    for needle in ("A1", "B2", "8.00%", "w1", "gpu-node-1", "http://gpu-a:30000", "healthy", "down", "budget_set"):
        assert needle in text.stdout, needle

    with subprocess.Popen([*CLI, "status", "--redis-url", redis_url, "--watch", "--json", "--interval", "0.2"],
                          cwd=ROOT, stdout=subprocess.PIPE, text=True) as watch:
        try:
            first, second = json.loads(watch.stdout.readline()), json.loads(watch.stdout.readline())
        finally:
            watch.terminate()
            watch.wait(10)
    assert second["generated_at"] > first["generated_at"] and second["datasets"][0]["used"] == 800

    bad = _cli("status", "--redis-url", f"redis://:hunter2pw@127.0.0.1:{free_port()}/0")
    assert bad.returncode == 2 and "cannot reach Redis at 127.0.0.1:" in bad.stderr
    assert "hunter2pw" not in bad.stderr


def test_automatic_budget_moves_are_the_producers_apart_from_people_and_formatted(conn, redis_url):
    """A deadline's pace steps are the producer's (not a person's user@host), in their own list, so
    they never push a person's action off `status` or the monitor; token values read as budgets do."""
    from budgetq.shared.control import log_action

    log_action(conn, "budget_set", "A1", 282204, 300_000)  # a person's
    # an earlier version logged pace steps with people's actions, as the producer's user
    conn.xadd(keys.CONTROL_LOG, {"ts": time.time(), "who": "old@producer", "action": "budget_deadline",
                                 "dataset": "A1", "old": "1", "new": "2"})
    for i in range(40):
        log_action(conn, "budget_deadline", "A1", 282_204 + 1000 * i, 283_204 + 1000 * i,
                   actor="producer (deadline pacing)")
    assert conn.xlen(keys.CONTROL_AUTO_LOG) == 40
    snap = snapshot(conn, redis_url)
    (person,) = snap["control"]
    assert (person["action"], person["old"], person["new"]) == ("budget_set", "282204", "300000")
    assert "@" in person["who"]
    assert [c["new"] for c in snap["control_auto"]] == [str(283_204 + 1000 * i) for i in range(39, 34, -1)]
    assert {c["who"] for c in snap["control_auto"]} == {"producer (deadline pacing)"}
    out = _cli("status", "--redis-url", redis_url)
    assert out.returncode == 0, out.stderr
    people = out.stdout.index("recent operator actions")
    auto = out.stdout.index("automatic budget moves")
    assert people < auto, out.stdout
    assert "282.20k" in out.stdout[people:auto] and "300.00k" in out.stdout[people:auto], out.stdout
    assert "producer (deadline pacing)" in out.stdout[auto:] and "321.20k" in out.stdout[auto:], out.stdout
    assert "282204" not in out.stdout and "old@producer" not in out.stdout


def test_status_json_against_a_live_run(tmp_path, redis_url, conn, sim_factory):
    sim = sim_factory("--speedup", "100", "--seed", "5", "--length-mean", "150")
    cfg = write_config(tmp_path, redis_url, sim, three_datasets(tmp_path), **LIVE)

    def during(_proc):
        out = _cli("status", "-c", str(cfg), "--json")
        return json.loads(out.stdout) if out.returncode == 0 else None

    live = live_run(cfg, tmp_path, during=during)
    assert live.producer.returncode == 0, live.producer.stderr
    final = json.loads(_cli("status", "-c", str(cfg), "--json").stdout)
    seen = [s for s in live.during if s is not None and s["datasets"]]
    assert seen, "no status snapshot was taken while the producer ran"
    by_name = {d["dataset"]: d for d in final["datasets"]}
    assert set(by_name) == {"A1", "B2", "C1"}
    for name, d in by_name.items():
        out_rows = rows(live.out / f"{name}.jsonl")
        stats = {k.decode(): int(float(v)) for k, v in conn.hgetall(keys.stats_key(name)).items()}
        assert d["used"] == sum(r["completion_tokens"] for r in out_rows) == int(conn.get(keys.used_key(name)))
        assert d["counts"]["committed"] == len(out_rows) == stats["committed"]
        assert d["counts"]["skipped"] == stats.get("skipped", 0)
        assert (d["in_flight"], d["reserved"], d["queued"], d["ledger"]["failed"]) == (0, 0, 0, 0)
        assert d["used_pct"] == round(100 * d["used"] / d["budget"], 3)
        # used never goes down between snapshots of one run
        used_seen = [s_d["used"] for s in seen for s_d in s["datasets"] if s_d["dataset"] == name]
        assert used_seen == sorted(used_seen) and (not used_seen or used_seen[-1] <= d["used"])
    assert by_name["A1"]["budget"] == 6000 and by_name["A1"]["used"] >= 6000 and by_name["A1"]["state"] == "done"
    assert by_name["B2"]["mode"] == "strict" and by_name["B2"]["used"] <= 5000 and by_name["B2"]["exhausted"]
    # every row read and every prompt ended: done, with no rate and no ETA
    assert by_name["C1"]["counts"]["committed"] == 25 and by_name["C1"]["state"] == "done"
    for d in by_name.values():
        assert d["state"] == "done" and d["tok_s"] is None and d["eta_s"] is None, d
        led = d["ledger"]
        assert led["balanced"] and led["unaccounted"] == 0 and led["queued"] == led["running"] == 0, led
        assert led["rows"] == d["counts"]["committed"] and led["entered"] == led["enqueued"] > 0
    assert by_name["A1"]["counts"]["skipped"] > 0
    assert final["redis"] == redis_url.removeprefix("redis://") and final["redis_tls"] is False
    assert [e["url"] for e in final["endpoints"]] == [sim]


def _tls_redis(tmp_path: Path):
    openssl, server = shutil.which("openssl"), shutil.which("redis-server")
    if openssl is None:
        pytest.skip("openssl not installed (needed to make a test certificate)")
    ca_subj, srv_subj = "/CN=budgetq-test-ca", "/CN=localhost"
    d = tmp_path
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]  # EC: fast to generate
    steps = [
        [openssl, "req", "-x509", *ec, "-keyout", d / "ca.key", "-out", d / "ca.crt", "-days", "2", "-subj", ca_subj],
        [openssl, "req", *ec, "-keyout", d / "srv.key", "-out", d / "srv.csr", "-subj", srv_subj],
        [openssl, "x509", "-req", "-in", d / "srv.csr", "-CA", d / "ca.crt", "-CAkey", d / "ca.key",
         "-CAcreateserial", "-out", d / "srv.crt", "-days", "2", "-extfile", d / "ext"],
    ]
    (d / "ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    for step in steps:
        subprocess.run([str(a) for a in step], check=True, capture_output=True)
    port = free_port()
    log = d / "redis.log"
    with log.open("wb") as out:  # a file, not a pipe: nothing left open for the garbage collector
        proc = subprocess.Popen([server, "--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1",
                                 "--tls-cert-file", str(d / "srv.crt"), "--tls-key-file", str(d / "srv.key"),
                                 "--tls-ca-cert-file", str(d / "ca.crt"), "--tls-auth-clients", "no",
                                 "--requirepass", "tls-test-pw-91", "--save", "", "--dir", str(d)],
                                stdout=out, stderr=subprocess.STDOUT)
    url = f"rediss://:tls-test-pw-91@127.0.0.1:{port}/0?ssl_ca_certs={d / 'ca.crt'}"
    client = redis.Redis.from_url(url)
    for _ in range(200):
        try:
            client.ping()
            return proc, url, client
        except redis.ConnectionError:
            if proc.poll() is not None:
                pytest.skip(f"redis-server without TLS support: {log.read_text()[-300:]}")
            time.sleep(0.02)
    proc.kill()
    raise AssertionError("TLS redis-server did not start")


def test_status_over_tls_with_a_password(tmp_path):
    proc, url, client = _tls_redis(tmp_path)
    try:
        register_dataset(client, DatasetConfig(name="T1", path="x", budget="1k", sampling={"max_tokens": 10}))
        out = _cli("status", "--redis-url", url, "--json")
        assert out.returncode == 0, out.stderr
        snap = json.loads(out.stdout)
        assert snap["redis_tls"] is True and snap["redis"].startswith("127.0.0.1:") and snap["redis"].endswith("/0")
        assert [d["dataset"] for d in snap["datasets"]] == ["T1"]
        assert "tls-test-pw-91" not in out.stdout + out.stderr
    finally:
        client.close()
        proc.terminate()
        proc.wait(10)


# -- held, paused and stalled datasets: a state that says why, and no ETA ---------------------------
DISK_FULL = "writing /data/out/A.jsonl failed: No space left on device"


def _moving(conn, name: str, queued: int) -> None:
    """A dataset with ``queued`` jobs waiting and 600 tokens committed in the last minute (a rate, an ETA)."""
    producer_running(conn)
    register_dataset(conn, DatasetConfig(name=name, path="x", budget="10k", sampling={"max_tokens": 500}))
    q = Queue(keys.queue_name(name), connection=conn, serializer=JSONSerializer)
    for i in range(queued):
        q.enqueue("budgetq.worker.job.run_prompt", {"id": f"q{i}"}, job_id=f"{name}-q{i}")
    now = conn.time()[0]
    conn.hset(keys.conf_key(name), "registered_at", now - 1000)
    conn.hset(keys.rate_key(name), str(now // keys.RATE_BUCKET_S * keys.RATE_BUCKET_S - 10), 600)


def _live_worker(conn, name: str = "w1") -> None:
    _worker_hash(conn, name, {"http://gpu-a:30000": {"healthy": True, "in_flight": 0, "failures": 0,
                                                     "ejected_since": None}}, in_flight=0,
                 started_at=float(conn.time()[0]))


def test_a_held_dataset_says_held_with_its_reason_and_has_no_eta(conn, redis_url):
    for name in ("A", "P", "R"):
        _moving(conn, name, queued=2)
    _live_worker(conn)
    conn.hset(keys.conf_key("A"), "hold", DISK_FULL)  # as the producer's disk guard (or a killed producer) left it
    conn.hset(keys.conf_key("P"), "paused", "1")      # an operator's pause
    snap = snapshot(conn, redis_url)
    a, p, r = snap["datasets"]
    assert (a["state"], a["hold"], a["paused"]) == ("held", DISK_FULL, False)
    assert (p["state"], p["hold"], p["paused"]) == ("paused", None, True)
    assert (r["state"], r["hold"], r["paused"]) == ("running", None, False)
    for d in (a, p):  # nothing is admitted: the last minute's rate is what it was, but no ETA
        assert d["tok_s"] and d["tok_s"] > 0 and d["eta_s"] is None, d
    assert r["tok_s"] and r["eta_s"] == pytest.approx((10_000 - 0) / r["tok_s"], rel=0.01)
    assert snap["stall"] is None  # a worker is live: held is not a stall, it has its own reason

    out = _cli("status", "--redis-url", redis_url)
    assert out.returncode == 0, out.stderr
    hold_line = (f"held by the producer: A: output_dir: {DISK_FULL}; workers take no new prompts until it has room "
                 "(a stopped producer's hold ends at the next `budgetq produce`)")
    assert hold_line in out.stdout.splitlines(), out.stdout
    assert " held " in next(line for line in out.stdout.splitlines() if "│ A " in line)
    assert json.loads(_cli("status", "--redis-url", redis_url, "--json").stdout)["datasets"][0]["hold"] == DISK_FULL


def test_queued_prompts_and_no_worker_is_a_stall_said_in_one_line(conn, redis_url):
    _moving(conn, "A", queued=3)
    conn.sadd(keys.WORKERS, "w-dead")  # registered once, its heartbeat hash expired: not a live worker
    snap = snapshot(conn, redis_url)
    line = "no worker is running: 3 prompts queued (start `budgetq worker -c CONFIG`)"
    assert snap["stall"] == line and snap["diagnosis"] is None
    (a,) = snap["datasets"]
    assert a["state"] == "running" and a["tok_s"] > 0 and a["eta_s"] is None, a  # nothing moves: no ETA
    out = _cli("status", "--redis-url", redis_url)
    assert out.returncode == 0 and line in out.stdout.splitlines(), out.stdout + out.stderr

    _live_worker(conn)  # a worker comes: no stall, an ETA again
    snap = snapshot(conn, redis_url)
    assert snap["stall"] is None and snap["datasets"][0]["eta_s"] is not None


def test_every_server_failing_is_a_stall_some_failing_is_not(conn, redis_url):
    from budgetq.shared import server_faults

    _moving(conn, "A", queued=3)
    _live_worker(conn)

    def publish(failing: list[str], ok: list[str]) -> None:
        views = {}
        for url in failing:
            f = server_faults.EndpointFaults()
            for _ in range(server_faults.FAILING_STREAK):
                f.fault("HTTP 502 text/html", "<title>502 Bad Gateway</title>")
            views[url] = f.to_json(healthy=False)
        for url in ok:
            f = server_faults.EndpointFaults()
            f.ok()
            views[url] = f.to_json(healthy=True)
        pipe = conn.pipeline()
        server_faults.publish(pipe, "w1", views, ttl_s=30)
        pipe.execute()

    publish(["http://gpu-a:30000", "http://gpu-b:30000"], [])
    snap = snapshot(conn, redis_url)
    assert snap["stall"] == snap["diagnosis"] == "2/2 servers failing: HTTP 502 text/html (502 Bad Gateway)"
    assert snap["datasets"][0]["eta_s"] is None
    publish(["http://gpu-a:30000"], ["http://gpu-b:30000"])  # one still answers: slower, not stalled
    snap = snapshot(conn, redis_url)
    assert snap["diagnosis"] == "1/2 servers failing: HTTP 502 text/html (502 Bad Gateway)"
    assert snap["stall"] is None and snap["datasets"][0]["eta_s"] is not None


def test_a_worker_that_stopped_publishing_is_gone_before_its_hash_expires(conn, redis_url):
    from budgetq.shared.status import SILENT_S, is_live

    _moving(conn, "A", queued=3)
    fields = {"host": "h", "pid": "1", "started_at": "1", "expire_s": "60", "publish_s": "1"}
    conn.hset(keys.worker_key("w-killed"), mapping=fields)
    conn.sadd(keys.WORKERS, "w-killed")
    conn.expire(keys.worker_key("w-killed"), 60)  # just published
    assert snapshot(conn, redis_url)["stall"] is None
    conn.expire(keys.worker_key("w-killed"), int(60 - SILENT_S - 2))  # silent for 12 s: SIGKILLed
    snap = snapshot(conn, redis_url)
    assert snap["workers"] == [] and snap["stall"].startswith("no worker is running: 3 prompts queued"), snap
    # the age is read from the TTL on Redis's clock; a worker of an older version (no expire_s)
    # is live while its hash exists
    assert is_live({"expire_s": "60", "publish_s": "5"}, 60_000 - 14_000)  # 3 publish intervals: not yet
    assert not is_live({"expire_s": "60", "publish_s": "1"}, 60_000 - 11_000)
    assert is_live({"host": "h"}, 5_000) and not is_live({}, -2)
