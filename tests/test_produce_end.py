"""What `budgetq produce` says at its end, on live runs (real producer, worker, simulator, Redis): an
interrupted run exits 3 and the next `produce` completes it (exit 0, every prompt once); every row of
the file has a place in the summary, `status` and /metrics, the rows never read because the budget
came first included; the end-of-run block (docs/cli.md "Exit codes and the summary")."""

from __future__ import annotations

import json
import signal
import subprocess

from budgetq.producer.ops import metrics
from budgetq.shared import keys
from budgetq.shared.status import snapshot
from tests.helpers import (
    CLI,
    PY,
    ROOT,
    Procs,
    check_invariants,
    cli_out,
    dataset_status,
    rows,
    wait_for,
    write_config,
    write_dataset,
)

FAST = {"heartbeat_ttl_s": 3, "maintenance_interval_s": 0.5, "concurrency": 8}
# Where a row of the file can be; they add up to the file's rows.
PLACES = ("rows", "truncated", "running", "skipped", "failed", "queued", "unread", "invalid", "filtered")


def _produce_json(cfg, tmp_path, name: str) -> tuple[subprocess.Popen, object]:
    err = open(tmp_path / f"{name}.err", "w")
    return subprocess.Popen([*PY, "produce", "--json", "-c", str(cfg)], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=err, text=True), err


def test_an_interrupted_produce_exits_3_and_produce_again_completes_every_prompt_once(tmp_path, redis_url, conn,
                                                                                      sim_factory):
    # ~400 tok/s at 8 in flight: 120 answers of ~60 tokens take ~20 s, so the stop lands mid-run
    sim = sim_factory("--speedup", "1", "--length-mean", "60", "--length-sigma", "0.2", "--peak-tok-s", "2000",
                      "--seed", "5")
    ids = write_dataset(tmp_path / "A.jsonl", 120)
    cfg = write_config(tmp_path, redis_url, [sim], [{"name": "A", "path": str(tmp_path / "A.jsonl"),
                                                     "budget": "10M", "id_field": "id", "prior_mean_tokens": 70,
                                                     "sampling": {"max_tokens": 400}}],
                       worker=FAST, producer={"progress": "log", "progress_interval_s": 0.5})
    procs = Procs(cfg, tmp_path)
    procs.worker()
    try:
        first, err = _produce_json(cfg, tmp_path, "produce-1")
        wait_for(lambda: int(conn.hget(keys.stats_key("A"), "committed") or 0) >= 10, 60, "10 rows committed")
        assert dataset_status(cfg, "A")["stop"] == "running"
        first.send_signal(signal.SIGINT)
        out, _ = first.communicate(timeout=60)
        err.close()  # type: ignore[attr-defined]
        log = (tmp_path / "produce-1.err").read_text()
        assert first.returncode == 3, log   # stopped before the end: never 0
        report = json.loads(out)
        (a,) = report["datasets"]
        assert (report["complete"], report["exit_status"], a["stop"], a["complete"]) == (False, 3, "interrupted",
                                                                                          False), report
        assert a["unread"] > 0 and a["source_rows"] == 120 and sum(a[p] for p in PLACES) == 120, a
        assert "stopped on request with the run unfinished (A)" in log
        assert not conn.exists(keys.PRODUCER), "a producer that ended takes its presence key with it"
        d = dataset_status(cfg, "A")  # the worker goes on with what was queued; the dataset stays interrupted
        assert d["stop"] == "interrupted" and d["ledger"]["unread"] > 0, d

        second, err = _produce_json(cfg, tmp_path, "produce-2")
        out, _ = second.communicate(timeout=180)
        err.close()  # type: ignore[attr-defined]
        assert second.returncode == 0, (tmp_path / "produce-2.err").read_text()
    finally:
        procs.stop_all()
    report = json.loads(out)
    (a,) = report["datasets"]
    assert (report["complete"], report["exit_status"], a["stop"]) == (True, 0, "out of prompts"), report
    assert (a["rows"], a["unread"], a["queued"], a["running"], a["source_rows"]) == (120, 0, 0, 0, 120), a
    # every prompt exactly once
    assert sorted(r["id"] for r in rows(tmp_path / "out" / "A.jsonl")) == sorted(ids)
    assert check_invariants(conn, tmp_path / "out", "A", ids)["committed"] == 120
    # the end-of-run block: this run's rows, tokens, rate and latencies; the measured mean by the prior
    lat = report["latency_s"]
    assert report["rows_written"] == a["rows_written"] > 0 and lat["rows"] == report["rows_written"], report
    assert 0 < lat["p50"] <= lat["p95"] <= lat["p99"] < 60, lat
    assert report["elapsed_s"] > 0 and report["tokens"] > 0 and report["tok_s"] > 0, report
    assert a["prior_mean_tokens"] == 70 and 40 <= a["mean_response_tokens"] <= 80, a
    assert dataset_status(cfg, "A")["stop"] == "out of prompts"


def test_a_producer_killed_without_a_word_shows_as_interrupted_once_its_key_expires(tmp_path, redis_url, conn,
                                                                                     sim_factory):
    sim = sim_factory("--speedup", "50", "--length-mean", "40", "--seed", "3")
    ids = write_dataset(tmp_path / "A.jsonl", 30)
    cfg = write_config(tmp_path, redis_url, [sim], [{"name": "A", "path": str(tmp_path / "A.jsonl"),
                                                     "budget": "10M", "id_field": "id"}], worker=FAST)
    procs = Procs(cfg, tmp_path)
    try:
        first = procs.producer()   # no worker yet: its prompts wait in the queue
        wait_for(lambda: conn.exists(keys.PRODUCER), 60, "the producer's presence key")
        assert json.loads(conn.get(keys.PRODUCER))["pid"] == first.pid and 0 < conn.ttl(keys.PRODUCER) <= 15
        assert dataset_status(cfg, "A")["stop"] == "running"
        first.kill()   # SIGKILL: no summary, no interrupted mark; its key runs out (fast-forwarded here)
        first.wait(30)
        assert 0 < conn.ttl(keys.PRODUCER) <= 15
        conn.pexpire(keys.PRODUCER, 1)
        wait_for(lambda: not conn.exists(keys.PRODUCER), 10, "the key to expire")
        d = dataset_status(cfg, "A")
        assert d["stop"] == "interrupted" and d["eta_s"] is None, d  # nothing enqueues its unread rows
        out = cli_out(cfg, "status")
        assert "no producer is running: A stopped before the end; `budgetq produce` continues the run" in out, out
        procs.worker()
        second = procs.producer()
        assert second.wait(120) == 0, Procs.log(second)
    finally:
        procs.stop_all()
    assert sorted(r["id"] for r in rows(tmp_path / "out" / "A.jsonl")) == sorted(ids)


def test_a_run_ended_by_its_budget_puts_every_row_of_the_file_in_summary_status_and_metrics(tmp_path, redis_url,
                                                                                          conn, sim_factory):
    sim = sim_factory("--speedup", "25", "--length-mean", "100", "--length-sigma", "0.2", "--seed", "7")
    write_dataset(tmp_path / "A.jsonl", 400, bad_lines={5: "not json"})   # 401 rows, one invalid
    cfg = write_config(tmp_path, redis_url, [sim], [{"name": "A", "path": str(tmp_path / "A.jsonl"),
                                                     "budget": "3k", "id_field": "id", "prior_mean_tokens": 100,
                                                     "sampling": {"max_tokens": 400}}],
                       worker=FAST, producer={"progress": "off", "high_water": 16})
    procs = Procs(cfg, tmp_path)
    procs.worker()
    try:
        producer = subprocess.run([*PY, "produce", "-c", str(cfg)], cwd=ROOT, capture_output=True, text=True,
                                  timeout=180)
    finally:
        procs.stop_all()
    assert producer.returncode == 0, producer.stdout + producer.stderr
    summary = _table_row(producer.stdout, "A")
    places = {p: int(summary[p].replace(",", "")) for p in PLACES if p in summary}
    assert summary["stop"] == "budget reached" and places["unread"] > 0, summary
    assert sum(places.values()) == 401 == int(summary["file rows"]), summary   # every row has a place
    assert places["invalid"] == 1
    assert "end of run" in producer.stdout and "latency p50" in producer.stdout and "prior_mean_tokens" in \
        producer.stdout
    assert "run complete: every dataset reached its end (budget reached)" in producer.stdout
    d = dataset_status(cfg, "A")
    led = d["ledger"]
    assert d["stop"] == "budget reached" and led["unread"] == places["unread"] and led["source_rows"] == 401
    assert led["entered"] + led["invalid"] + led["filtered"] + led["unread"] == 401 and led["balanced"], led
    text = metrics.render(snapshot(conn, redis_url)).decode()
    assert f'budgetq_ledger_unread_prompts{{dataset="A"}} {float(places["unread"])}' in text
    assert 'budgetq_stop{dataset="A",reason="budget reached"} 1.0' in text
    # and the summary's table is what `status` shows
    status = subprocess.run([*CLI, "status", "-c", str(cfg)], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert "budget reached" in _status_row(status.stdout, "A") and f" {places['unread']} " in _status_row(
        status.stdout, "A")


def _table_row(text: str, ds: str) -> dict[str, str]:
    """Column -> cell of ``ds``'s row in the first table of ``text`` (printed in full off a terminal)."""
    lines = [line for line in text.splitlines() if line.startswith(("┃", "│"))]
    header = [c.strip() for c in lines[0].strip("┃").split("┃")]
    row = next(line for line in lines[1:] if line.split("│")[1].strip() == ds)
    return dict(zip(header, (c.strip() for c in row.strip("│").split("│")), strict=True))


def _status_row(text: str, ds: str) -> str:
    return next(line for line in text.splitlines() if line.startswith(f"│ {ds} "))


def test_a_run_whose_redis_lost_its_end_of_reading_mark_still_completes(tmp_path, redis_url, conn, sim_factory):
    """The producer marks a dataset's reading ended once (source_ended): a Redis failover that loses that write
    left the run `running` with every row written, and `produce` exiting 3 (a full suite, the sentinel test)."""
    from budgetq.shared.stats import Conf

    sim = sim_factory("--speedup", "50", "--length-mean", "40", "--seed", "3")
    ids = write_dataset(tmp_path / "A.jsonl", 12)
    cfg = write_config(tmp_path, redis_url, [sim], [{"name": "A", "path": str(tmp_path / "A.jsonl"),
                                                     "budget": "10M", "id_field": "id"}], worker=FAST)
    procs = Procs(cfg, tmp_path)
    try:
        producer = procs.producer()   # no worker yet: its prompts wait in the queue
        wait_for(lambda: conn.hget(keys.conf_key("A"), Conf.SOURCE_ENDED) == b"1"
                 and conn.llen(keys.rq_queue_key("A")) == 12, 60, "every prompt read and queued")
        conn.hdel(keys.conf_key("A"), Conf.SOURCE_ENDED)   # as a failover to a replica that never got it
        procs.worker()
        assert producer.wait(120) == 0, Procs.log(producer)
        assert "run complete: every dataset reached its end (out of prompts)" in Procs.log(producer)
    finally:
        procs.stop_all()
    assert sorted(r["id"] for r in rows(tmp_path / "out" / "A.jsonl")) == sorted(ids)
