"""How a dataset ends (shared/ends.py): one stop reason, an ETA that knows the budget, the prompts and the
deadline, every row of the file in a place (the ledger's ``unread``), as status, /metrics and the
progress lines show them; the row counts they start from (producer/reading/row_count.py) and the
latency sample of the end-of-run block (producer/run/run_report.py)."""

from __future__ import annotations

import json
import subprocess
import time

import pytest
from rq import Queue
from rq.serializers import JSONSerializer

from budgetq.producer.ops import metrics
from budgetq.producer.reading import row_count
from budgetq.producer.run.run_report import Reservoir
from budgetq.shared import keys, presence, run_plan
from budgetq.shared.budget import DatasetState, register_dataset
from budgetq.shared.config import DatasetConfig
from budgetq.shared.ends import Stop, eta, is_complete, stop_reason, tokens_to_end
from budgetq.shared.ledger import read_ledger
from budgetq.shared.status import format_eta, snapshot
from tests.helpers import CLI, ROOT, producer_running, write_dataset


def _state(**kw) -> DatasetState:
    base = {"name": "A", "limit": 1000, "mode": "soft", "paused": False, "used": 0, "reserved": 0, "in_flight": 0,
            "max_tokens": 100, "stats": {}, "prior_mean": 50}
    return DatasetState(**{**base, **kw})


def _ledger(queued: int = 0, running: int = 0, skipped: int = 0, unread: int | None = 0) -> dict:
    return {"queued": queued, "running": running, "skipped": skipped, "unread": unread}


@pytest.mark.parametrize(("state", "ledger", "deadline", "want"), [
    # the ends: nothing queued or running, whatever else holds
    ({"source_ended": True}, _ledger(), False, Stop.OUT_OF_PROMPTS),
    ({"source_ended": True, "operator_paused": True}, _ledger(), False, Stop.OUT_OF_PROMPTS),
    ({"used": 1000}, _ledger(skipped=5, unread=27), False, Stop.BUDGET),
    ({"used": 1000, "source_ended": True}, _ledger(skipped=3), False, Stop.BUDGET),  # prompts skipped: budget
    ({"used": 950, "mode": "strict"}, _ledger(unread=4), False, Stop.BUDGET),       # strict: one more could cross
    ({"used": 400}, _ledger(unread=9), True, Stop.DEADLINE),
    ({"used": 400, "own_budget": 1000}, _ledger(unread=9), True, Stop.DEADLINE),
    # a deadline run sets the limit; a dataset that reached its own budget first was ended by it
    ({"used": 1000, "limit": 5000, "own_budget": 1000}, _ledger(unread=9), True, Stop.BUDGET),
    ({"used": 1000, "interrupted": True}, _ledger(unread=9), False, Stop.BUDGET),  # ended before the stop
    # on the way: a hold or a pause says what to do, then the end it drains toward
    ({"hold": "disk full", "operator_paused": True}, _ledger(queued=3), False, Stop.HELD),
    ({"operator_paused": True, "used": 1000}, _ledger(queued=3), False, Stop.PAUSED),
    ({"used": 1000, "in_flight": 2}, _ledger(running=2), False, Stop.BUDGET),  # draining
    ({"source_ended": True}, _ledger(running=2), False, Stop.OUT_OF_PROMPTS),  # the last answers
    ({"interrupted": True}, _ledger(queued=3, unread=50), False, Stop.INTERRUPTED),
    ({}, _ledger(queued=3, unread=50), False, Stop.RUNNING),
    ({"source_ended": True}, _ledger(queued=1), False, Stop.RUNNING),
])
def test_one_stop_reason_names_the_end_or_what_holds_the_dataset(state, ledger, deadline, want):
    assert stop_reason(_state(**state), ledger, deadline) == want
    assert is_complete(want, ledger) == (want in (Stop.BUDGET, Stop.DEADLINE, Stop.OUT_OF_PROMPTS)
                                         and ledger["queued"] == ledger["running"] == 0)


def test_the_eta_is_the_first_of_the_budget_the_prompts_and_the_deadline():
    # 10M budget, 1,000 tok/s: the budget alone says ~2h46m; 30 prompts of 1,500 tokens end in 45 s
    e = eta(10_000_000, 1000.0, 30, 1500.0)
    assert (e.seconds, e.by) == (45.0, "prompts")
    e = eta(10_000, 1000.0, 30, 1500.0)
    assert (e.seconds, e.by) == (10.0, "budget")
    e = eta(10_000_000, 1000.0, None, 1500.0, deadline_in_s=20.0)  # prompts unknown: budget or deadline
    assert (e.seconds, e.by) == (20.0, "deadline")
    e = eta(10_000_000, None, 30, 1500.0, deadline_in_s=600.0)  # no rate yet: only the deadline is known
    assert (e.seconds, e.by) == (600.0, "deadline")
    assert eta(10_000_000, None, 30, 1500.0).seconds is None
    e = eta(0, 1000.0, 30, 1500.0)  # budget reached: the last requests drain
    assert (e.seconds, e.by) == (0.0, "budget")
    assert tokens_to_end(5000, 2, 1000.0) == (2000.0, "prompts") and tokens_to_end(5000, None, 1.0)[1] == "budget"
    assert format_eta(45.0, "prompts") == "45s (out of prompts)" and format_eta(None, None) == "-"


def _running(conn, name: str, queued: int, source_rows: int, budget: str = "10M") -> None:
    """A dataset the producer is reading: ``queued`` jobs enqueued of a file of ``source_rows`` rows,
    600 tokens committed in the last minute (a rate), prior mean 100 tokens."""
    register_dataset(conn, DatasetConfig(name=name, path="x", budget=budget, sampling={"max_tokens": 500},
                                         prior_mean_tokens=100))
    q = Queue(keys.queue_name(name), connection=conn, serializer=JSONSerializer)
    for i in range(queued):
        q.enqueue("budgetq.worker.job.run_prompt", {"id": f"q{i}"}, job_id=f"{name}-q{i}")
    conn.hset(keys.stats_key(name), "enqueued", queued)
    now = conn.time()[0]
    conn.hset(keys.conf_key(name), mapping={"registered_at": now - 1000, "source_rows": source_rows,
                                            "source_estimated": 0, "source_limit": ""})
    conn.hset(keys.rate_key(name), str(now // keys.RATE_BUCKET_S * keys.RATE_BUCKET_S - 10), 600)
    producer_running(conn)
    conn.sadd(keys.WORKERS, "w1")  # a live worker: no stall
    conn.hset(keys.worker_key("w1"), mapping={"concurrency": 8, "endpoints": "{}"})
    conn.expire(keys.worker_key("w1"), 30)


def test_status_eta_comes_to_the_prompts_when_they_run_out_before_the_budget(conn, redis_url):
    _running(conn, "A", queued=3, source_rows=13)
    (a,) = snapshot(conn, redis_url)["datasets"]
    led = a["ledger"]
    assert (led["source_rows"], led["unread"], led["unread_estimated"]) == (13, 10, False)
    assert a["prompts_left"] == 13 and a["stop"] == "running"
    # 13 prompts at the prior mean of 100 tokens: 1,300 tokens, not the 10M budget's
    assert a["eta_by"] == "prompts" and a["eta_s"] == pytest.approx(1300 / a["tok_s"], rel=0.02), a
    out = subprocess.run([*CLI, "status", "--redis-url", redis_url], cwd=ROOT, capture_output=True, text=True,
                         timeout=60)
    row = next(line for line in out.stdout.splitlines() if line.startswith("│ A "))
    assert "(out of prompts)" in row and " 10 " in row and "running" in row, out.stdout
    assert "running: prompts claimed by a worker" in out.stdout and "in flight: requests admitted" in out.stdout

    # a deadline a minute away comes first; once admissions stopped for it, it is the stop reason
    now = float(conn.time()[0])
    run_plan.set_deadline(conn, now + 60)
    (a,) = snapshot(conn, redis_url)["datasets"]
    assert a["eta_by"] == "deadline" and 55 <= a["eta_s"] <= 61 and a["stop"] == "running"
    run_plan.set_deadline(conn, now - 1)
    (a,) = snapshot(conn, redis_url)["datasets"]
    assert a["stop"] == "deadline" and a["eta_s"] == 0.0, a


def test_after_a_deadline_a_dataset_that_reached_its_own_budget_says_budget_and_the_others_deadline(
        conn, redis_url):
    _running(conn, "A", queued=0, source_rows=40)
    _running(conn, "B", queued=0, source_rows=40, budget="1k")
    for n in ("A", "B"):  # the deadline's pacing set both limits to what was used
        conn.hset(keys.conf_key(n), "limit", 400 if n == "A" else 1000)
        conn.set(keys.used_key(n), 400 if n == "A" else 1000)
    run_plan.set_deadline(conn, float(conn.time()[0]) - 1)
    stops = {d["dataset"]: d["stop"] for d in snapshot(conn, redis_url)["datasets"]}
    assert stops == {"A": "deadline", "B": "budget reached"}, stops
    # a budget set live is the dataset's own too
    subprocess.run([*CLI, "budget", "set", "A", "400", "--redis-url", redis_url], cwd=ROOT, check=True,
                   capture_output=True, timeout=60)
    assert snapshot(conn, redis_url)["datasets"][0]["stop"] == "budget reached"


def test_metrics_and_the_monitor_page_carry_the_stop_reason_and_the_unread_rows(conn, redis_url):
    _running(conn, "A", queued=3, source_rows=13)
    _running(conn, "B", queued=0, source_rows=40, budget="1k")
    conn.set(keys.used_key("B"), 1000)  # its budget reached: the rest of its file is never read
    conn.hset(keys.stats_key("B"), mapping={"enqueued": 12, "committed": 12, "invalid": 1})
    text = metrics.render(snapshot(conn, redis_url)).decode()
    assert 'budgetq_ledger_unread_prompts{dataset="A"} 10.0' in text
    assert 'budgetq_ledger_unread_prompts{dataset="B"} 27.0' in text   # 40 - 12 entered - 1 invalid
    assert 'budgetq_stop{dataset="A",reason="running"} 1.0' in text
    assert "budgetq_producer_running 1.0" in text
    assert 'budgetq_stop{dataset="B",reason="budget reached"} 1.0' in text
    assert 'budgetq_stop{dataset="B",reason="out of prompts"} 0.0' in text
    page = (ROOT / "producer" / "ops" / "static" / "monitor.html").read_text()
    assert "d.stop" in page and "led.unread" in page and "d.eta_by" in page and 'id="running-note"' in page


def test_unread_is_zero_once_every_row_is_read_and_bounded_by_the_limit(conn):
    _running(conn, "A", queued=2, source_rows=100)
    conn.hset(keys.conf_key("A"), "source_limit", 10)  # at most 10 valid prompts are ever sent
    led = read_ledger(conn, "A")
    assert (led["unread"], led["unread_estimated"]) == (8, True)
    conn.hset(keys.conf_key("A"), "source_ended", "1")
    assert read_ledger(conn, "A")["unread"] == 0
    conn.hdel(keys.conf_key("A"), "source_rows", "source_ended")
    assert read_ledger(conn, "A")["unread"] is None  # the file's size unknown: no claim


def test_rows_are_counted_as_the_reader_yields_them(tmp_path, monkeypatch):
    write_dataset(tmp_path / "a.jsonl", 50, bad_lines={3: "not json", 10: ""})   # a blank line is no row
    (tmp_path / "a.jsonl").write_bytes(b"\xef\xbb\xbf" + (tmp_path / "a.jsonl").read_bytes() + b"\n  \n")
    got = row_count.count_rows(DatasetConfig(name="a", path=str(tmp_path / "a.jsonl"), budget="1k"))
    assert got == row_count.RowCount(51, True)
    (tmp_path / "b.json").write_text(json.dumps([{"prompt": f"q{i}"} for i in range(7)]))
    assert row_count.count_rows(DatasetConfig(name="b", path=str(tmp_path / "b.json"), budget="1k")) == \
        row_count.RowCount(7, True)
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"prompt": [f"q{i}" for i in range(9)]}), tmp_path / "c.parquet")
    assert row_count.count_rows(DatasetConfig(name="c", path=str(tmp_path / "c.parquet"), budget="1k")) == \
        row_count.RowCount(9, True)
    # a file over EXACT_BYTES is estimated from its first SAMPLE_BYTES
    write_dataset(tmp_path / "big.jsonl", 2000)
    monkeypatch.setattr(row_count, "EXACT_BYTES", 1000)
    monkeypatch.setattr(row_count, "SAMPLE_BYTES", 4000)
    est = row_count.count_rows(DatasetConfig(name="big", path=str(tmp_path / "big.jsonl"), budget="1k"))
    assert est is not None and not est.exact and 1800 <= est.rows <= 2200, est
    assert row_count.count_rows(DatasetConfig(name="x", path=str(tmp_path / "missing.jsonl"), budget="1k")) is None


def test_the_latency_sample_is_uniform_bounded_and_gives_nearest_rank_quantiles():
    r = Reservoir()
    for x in range(1, 101):
        r.add(float(x))
    r.add(float("nan"))
    assert r.quantiles() == {"p50": 50.0, "p95": 95.0, "p99": 99.0, "rows": 100}
    small = Reservoir(keep=1000, seed=3)
    started = time.monotonic()
    for x in range(100_000):
        small.add(x / 1000)
    assert len(small.values) == 1000 and small.seen == 100_000 and time.monotonic() - started < 30
    q = small.quantiles()
    assert q is not None and 45 <= q["p50"] <= 55 and 93 <= q["p95"] <= 97   # a uniform sample of 0..100 s
    assert Reservoir().quantiles() is None


def test_presence_names_another_live_producer_not_one_killed_on_this_host(conn):
    me = presence.Presence(conn)
    assert me.others() is None
    me.beat()
    assert me.others() is None and presence.read(conn) == me.me and 0 < conn.ttl(keys.PRODUCER) <= presence.TTL_S
    dead = subprocess.Popen(["true"])
    dead.wait()
    conn.set(keys.PRODUCER, json.dumps({**me.me, "pid": dead.pid, "started_at": 1.0}))
    assert me.others() is None   # killed moments ago on this host, restarted: no warning
    other = {"host": "gpu-node-7", "pid": 4242, "started_at": 1.0}
    conn.set(keys.PRODUCER, json.dumps(other))
    assert me.others() == other
    me.leave()
    assert presence.read(conn) == other, "leave removes its own key only"
    conn.set(keys.PRODUCER, "{not json")
    assert presence.read(conn) is None
