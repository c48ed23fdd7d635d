"""Budgets and pauses changed live through the CLI; keep=complete; reconcile; fair sharing."""

from __future__ import annotations

import statistics
import subprocess
import time

from budgetq.shared import keys
from budgetq.shared.budget import dataset_state
from tests.helpers import (
    PY,
    ROOT,
    Procs,
    check_invariants,
    rows,
    run_to_completion,
    sim_get,
    wait_for,
    write_config,
    write_dataset,
)

FAST = {"heartbeat_ttl_s": 3, "maintenance_interval_s": 0.5, "control_interval_s": 0.2}


def _cli(cfg, *args: str) -> subprocess.CompletedProcess:
    out = subprocess.run([*PY, *args, "-c", str(cfg)], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out


def _used(conn, ds: str) -> int:
    return int(conn.get(keys.used_key(ds)) or 0)


def test_run_follows_pause_resume_raise_and_lower_with_abort(tmp_path, redis_url, conn, sim_factory):
    # ~0.4 s requests of ~200 tokens (A) and ~400 tokens (B)
    sim = sim_factory("--speedup", "2", "--length-mean", "200", "--length-mean-for", "B-=400", "--seed", "8")
    ids = {"A": write_dataset(tmp_path / "A.jsonl", 600), "B": write_dataset(tmp_path / "B.jsonl", 600)}
    specs = [{"name": "A", "path": str(tmp_path / "A.jsonl"), "budget": "10k", "id_field": "id",
              "sampling": {"max_tokens": 2000}, "prior_mean_tokens": 200},
             {"name": "B", "path": str(tmp_path / "B.jsonl"), "budget": "10M", "id_field": "id",
              "sampling": {"max_tokens": 2000}, "prior_mean_tokens": 400}]
    cfg = write_config(tmp_path, redis_url, [sim], specs, worker={"concurrency": 8, **FAST})
    procs = Procs(cfg, tmp_path)
    producer = procs.producer()
    procs.worker()
    try:
        # 1. A reaches its budget: the producer halts it and skips what is queued
        wait_for(lambda: _used(conn, "A") >= 10_000 and conn.llen(keys.rq_queue_key("A")) == 0, 60,
                 "A to reach 10k")
        assert 10_000 <= _used(conn, "A") < 12_000
        # 2. raised: skipped jobs are requeued and reading resumes
        _cli(cfg, "budget", "set", "A", "16k")
        wait_for(lambda: _used(conn, "A") > 12_000, 60, "A to continue after the raise")
        # 3. paused: no request for A reaches the server after the pause has taken effect
        _cli(cfg, "pause", "A")
        paused_at = float(conn.xrevrange(keys.CONTROL_LOG, count=1)[0][1][b"ts"])
        time.sleep(1.5)
        late = [r for r in sim_get(sim, "/sim/requests") if r["rid"].startswith("A-")
                and r["arrived"] > paused_at + 0.2]
        assert late == []
        assert dataset_state(conn, "A").paused and conn.llen(keys.rq_queue_key("A")) > 0  # held, not skipped
        assert dataset_state(conn, "A").in_flight == 0
        # 4. resumed: A finishes its raised budget
        _cli(cfg, "resume", "A")
        wait_for(lambda: _used(conn, "A") >= 16_000, 60, "A to reach 16k")
        # 5. B lowered below what it has with --abort-in-flight: its requests are cancelled
        wait_for(lambda: dataset_state(conn, "B").in_flight >= 4, 30, "B requests in flight")
        aborted_before = sim_get(sim, "/sim/stats")["aborted_tokens"]
        out = _cli(cfg, "budget", "set", "B", str(_used(conn, "B") + 1), "--abort-in-flight")
        assert "aborted" in out.stdout
        assert producer.wait(60) == 0, procs.log(producer)
    finally:
        procs.stop_all()
    assert 16_000 <= _used(conn, "A") < 16_000 + 2000
    assert sim_get(sim, "/sim/stats")["aborted_tokens"] > aborted_before  # the server stopped generating
    st = dataset_state(conn, "B")
    assert st.reserved == 0 and st.stats.get("aborted", 0) > 0
    for ds in ids:
        check_invariants(conn, tmp_path / "out", ds, ids[ds])
    actions = [(e[1][b"action"].decode(), e[1][b"dataset"].decode()) for e in conn.xrange(keys.CONTROL_LOG)]
    assert actions == [("budget_set", "A"), ("pause", "A"), ("resume", "A"), ("budget_set", "B"), ("abort", "B")]
    assert all(b"@" in e[1][b"who"] for e in conn.xrange(keys.CONTROL_LOG))
    status = _cli(cfg, "status").stdout
    assert "budget_set" in status or "pause" in status


def test_workers_move_to_other_datasets_when_one_is_paused(tmp_path, redis_url, conn, sim_factory):
    sim = sim_factory("--speedup", "2", "--length-mean", "300", "--length-sigma", "0.2", "--max-running-requests",
                      "256")
    ids = {d: write_dataset(tmp_path / f"{d}.jsonl", 400) for d in ("A", "B")}
    specs = [{"name": d, "path": str(tmp_path / f"{d}.jsonl"), "budget": "10M", "id_field": "id",
              "sampling": {"max_tokens": 2000}} for d in ids]
    cfg = write_config(tmp_path, redis_url, [sim], specs, worker={"concurrency": 16, **FAST})
    procs = Procs(cfg, tmp_path)
    procs.producer()
    procs.worker()
    try:
        wait_for(lambda: sim_get(sim, "/sim/stats")["running"] >= 16, 30, "16 in flight")
        _cli(cfg, "pause", "A")
        time.sleep(1.0)
        samples = []
        for _ in range(30):
            samples.append(sim_get(sim, "/sim/stats")["running"])
            time.sleep(0.05)
        recent_a = [r for r in sim_get(sim, "/sim/requests")[-20:] if r["rid"].startswith("A-")]
    finally:
        procs.stop_all()
    print("in flight after pausing A:", samples)
    assert statistics.median(samples) >= 14  # B's jobs took A's slots
    assert recent_a == []


def test_keep_complete_sets_truncated_rows_aside(tmp_path, redis_url, conn, sim_factory):
    sim = sim_factory("--speedup", "200", "--length-mean", "100", "--length-sigma", "1.0", "--seed", "9")
    ids = write_dataset(tmp_path / "D.jsonl", 80)
    cfg = write_config(tmp_path, redis_url, [sim], [{"name": "D", "path": str(tmp_path / "D.jsonl"),
                                                     "budget": "1M", "id_field": "id", "keep": "complete",
                                                     "sampling": {"max_tokens": 120}}], worker=FAST)
    run_to_completion(cfg, tmp_path, timeout_s=60)
    kept = rows(tmp_path / "out" / "D.jsonl")
    cut = rows(tmp_path / "out" / "D.truncated.jsonl")
    assert cut and all(r["finish_reason"] == "length" for r in cut)
    assert all(r["finish_reason"] != "length" for r in kept)
    st = dataset_state(conn, "D")
    assert st.used == sum(r["completion_tokens"] for r in kept)  # truncated ones do not count
    assert st.stats["truncated"] == len(cut) and st.stats["truncated_tokens"] == 120 * len(cut)
    check_invariants(conn, tmp_path / "out", "D", ids)


def test_reconcile_after_flushing_redis_reproduces_the_counters(tmp_path, redis_url, conn, sim_factory):
    sim = sim_factory("--speedup", "200", "--length-mean", "100", "--seed", "10")
    specs, ids = [], {}
    for d, count in (("A", "completion"), ("B", "total")):
        ids[d] = write_dataset(tmp_path / f"{d}.jsonl", 100)
        specs.append({"name": d, "path": str(tmp_path / f"{d}.jsonl"), "budget": "6k", "id_field": "id",
                      "count": count, "keep": "complete", "sampling": {"max_tokens": 150}})
    cfg = write_config(tmp_path, redis_url, [sim], specs, worker=FAST)
    run_to_completion(cfg, tmp_path, timeout_s=60)
    before = {d: (_used(conn, d), conn.smembers(keys.done_key(d))) for d in ids}
    conn.flushall()  # our private server: Redis "lost" everything
    out = _cli(cfg, "reconcile", "--json")
    import json

    reports = {r["dataset"]: r for r in json.loads(out.stdout)}
    for d in ids:
        assert (_used(conn, d), conn.smembers(keys.done_key(d))) == before[d]
        assert reports[d]["adopted"] == len(before[d][1]) and reports[d]["used_after"] == before[d][0]
    # a second reconcile finds nothing to change
    again = {r["dataset"]: r for r in json.loads(_cli(cfg, "reconcile", "--json").stdout)}
    assert all(r["adopted"] == 0 and r["used_after"] == r["used_before"] for r in again.values())


def test_a_restart_with_the_same_config_keeps_a_budget_set_live_and_a_new_config_value_applies(tmp_path, redis_url,
                                                                                               conn, caplog):
    from budgetq.producer.run.producer import Producer
    from budgetq.shared import control
    from budgetq.shared.config_load import load_config

    write_dataset(tmp_path / "A.jsonl", 5)
    ds = {"name": "A", "path": str(tmp_path / "A.jsonl"), "id_field": "id", "budget": 40_000}
    cfg = load_config(write_config(tmp_path, redis_url, "http://127.0.0.1:9", [ds]), env={})
    Producer(cfg).conn.close()
    assert dataset_state(conn, "A").limit == 40_000
    control.set_budget(conn, "A", 70_000)  # raised live (after the dataset ended, say)
    with caplog.at_level("INFO", logger="budgetq.producer"):
        Producer(cfg).conn.close()  # `budgetq produce` again, same config: the raise stands
    assert dataset_state(conn, "A").limit == 70_000
    assert any("budget 70.00k (set live) kept" in r.getMessage() for r in caplog.records), caplog.text
    ds["budget"] = 50_000  # the config edited: its new value applies
    cfg = load_config(write_config(tmp_path, redis_url, "http://127.0.0.1:9", [ds]), env={})
    Producer(cfg).conn.close()
    assert dataset_state(conn, "A").limit == 50_000
    control.set_budget(conn, "A", 50_000)  # set live to what the config says: nothing to keep
    Producer(cfg).conn.close()
    assert dataset_state(conn, "A").limit == 50_000
