"""The ledger on a live run (real producer, worker, simulator, CLI): what an operator aborts or
the budget skips is requeued, the numbers the commands print are the ones status shows, and
after resume / raise nothing is missing."""

from __future__ import annotations

import re

from budgetq.shared import keys
from tests.helpers import Procs, cli_out, dataset_status, rows, wait_for, write_config, write_dataset

N = 150
FAST = {"heartbeat_ttl_s": 3, "maintenance_interval_s": 0.5, "control_interval_s": 0.2, "concurrency": 8}


def _settled(conn, ds: str) -> bool:
    """No reservation held and no request being aborted: every withdrawn admission has ended."""
    return conn.hlen(keys.resv_key(ds)) == 0 and conn.zcard(keys.rq_wip_key(ds)) == 0


def _summary_row(log: str, ds: str) -> dict[str, str]:
    """Column -> cell of ``ds``'s row in the produce summary table (printed in full off a terminal)."""
    lines = [line for line in log.splitlines() if line.startswith(("┃", "│"))]
    header = [c.strip() for c in lines[0].strip("┃").split("┃")]
    row = next(line for line in lines[1:] if line.split("│")[1].strip() == ds)
    return dict(zip(header, (c.strip() for c in row.strip("│").split("│")), strict=True))


def test_aborted_and_skipped_prompts_are_requeued_and_nothing_is_missing(tmp_path, redis_url, conn, sim_factory):
    sim = sim_factory("--speedup", "1", "--length-mean", "200", "--length-sigma", "0.2", "--seed", "3")
    ids = write_dataset(tmp_path / "A.jsonl", N)
    cfg = write_config(tmp_path, redis_url, [sim], [{"name": "A", "path": str(tmp_path / "A.jsonl"),
                                                     "budget": "10M", "id_field": "id",
                                                     "sampling": {"max_tokens": 2000}, "prior_mean_tokens": 200}],
                       worker=FAST, producer={"progress": "off"})
    procs = Procs(cfg, tmp_path)
    producer = procs.producer()
    procs.worker()
    try:
        # 1. pause --abort-in-flight: the aborted requests go back to the (paused) queue
        wait_for(lambda: conn.hlen(keys.resv_key("A")) >= 6, 30, "6 requests in flight")
        out = cli_out(cfg, "pause", "A", "--abort-in-flight")
        aborted = int(re.search(r"aborted (\d+) requests in flight", out).group(1))
        assert aborted >= 6, out
        wait_for(lambda: _settled(conn, "A"), 30, "the aborted requests to settle")
        d = dataset_status(cfg, "A")
        # what the command printed is what status shows: every withdrawn admission is one abort
        assert d["counts"]["aborted"] == aborted, (out, d["counts"])
        led = d["ledger"]
        assert led["balanced"] and led["queued"] >= aborted and led["skipped"] == 0 and led["running"] == 0, led
        assert led["aborted"] == aborted and d["state"] == "paused" and d["stop"] == "paused"
        # 2. resume: they run again
        cli_out(cfg, "resume", "A")
        wait_for(lambda: conn.hlen(keys.resv_key("A")) >= 6, 30, "requests in flight after the resume")
        # 3. budget lowered to what is used, with abort: what was in flight and queued is skipped ...
        used = int(conn.get(keys.used_key("A")) or 0)
        out = cli_out(cfg, "budget", "set", "A", str(used), "--abort-in-flight")
        assert re.search(r"aborted \d+ requests in flight", out), out
        wait_for(lambda: _settled(conn, "A") and conn.llen(keys.rq_queue_key("A")) == 0, 30,
                 "the queued jobs to be skipped")
        d = dataset_status(cfg, "A")
        assert d["state"] == "done" and d["tok_s"] is None and d["eta_s"] is None, d
        led = d["ledger"]
        assert led["balanced"] and led["skipped"] > 0 and led["queued"] == led["running"] == 0, led
        skipped = led["skipped"]
        # the run ends at the budget; its summary shows the ledger's numbers
        assert producer.wait(60) == 0, Procs.log(producer)
        summary = _summary_row(Procs.log(producer), "A")
        assert (summary["skipped"], summary["queued"], summary["failed"]) == (str(skipped), "0", "0"), summary
        # 4. raised after the dataset ended: the skipped jobs are requeued and stop counting as skipped
        out = cli_out(cfg, "budget", "set", "A", "10M")
        assert f"requeued {skipped} skipped jobs" in out, out
        led = dataset_status(cfg, "A")["ledger"]
        assert led["skipped"] == 0 and led["balanced"], led
        states = ("queued", "running", "rows", "truncated", "discarded", "skipped", "failed")
        assert sum(led[s] for s in states) == led["entered"]
        producer = procs.producer()  # collects what the requeued jobs make, and reads the rest
        assert producer.wait(90) == 0, Procs.log(producer)
    finally:
        procs.stop_all()
    # nothing is missing: every prompt has exactly one row
    got = sorted(r["id"] for r in rows(tmp_path / "out" / "A.jsonl"))
    assert got == sorted(ids)
    d = dataset_status(cfg, "A")
    led = d["ledger"]
    assert (led["rows"], led["queued"], led["running"], led["skipped"], led["failed"], led["unaccounted"]) == \
        (N, 0, 0, 0, 0, 0), led
    assert led["entered"] == led["enqueued"] == N and d["state"] == "done"
    # the final summary counts from the ledger, queued and failed included
    summary = _summary_row(Procs.log(producer), "A")
    assert (summary["rows"], summary["queued"], summary["failed"], summary["skipped"]) == (str(N), "0", "0", "0")
    assert "of them duplicate ids" in summary and "duplicate" not in summary  # a subset of invalid
    assert "duplicate_result" in d["counts"] and "duplicate" not in d["counts"]
