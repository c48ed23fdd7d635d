"""The producer's progress display: rich bars on a terminal, log lines otherwise, nothing when off."""

from __future__ import annotations

import io
import json
import logging
import re

from rq import Queue
from rq.serializers import JSONSerializer

from budgetq.producer.run.progress import ProgressReporter
from budgetq.shared import budget, keys
from budgetq.shared.budget import register_dataset
from budgetq.shared.config import Config, DatasetConfig
from budgetq.shared.logs import JsonFormatter
from budgetq.shared.scripts import run as run_script
from tests.helpers import producer_running


def _cfg(redis_url: str, progress: str, interval: float = 10.0) -> Config:
    ds = [DatasetConfig(name=n, path="x", budget="1k", sampling={"max_tokens": 100}) for n in ("A1", "B2")]
    return Config(redis_url=redis_url, datasets=ds, producer={"progress": progress, "progress_interval_s": interval})


def _seed(conn, cfg: Config) -> None:
    producer_running(conn)  # the reporter runs in the producer
    for ds in cfg.datasets:
        register_dataset(conn, ds)
    run_script(conn, budget.reserve("A1", "A1-x", 100))
    run_script(conn, budget.commit("A1", "A1-x", 0, 250, "stop", "{}"))


class _TTY(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_log_lines_when_not_a_terminal_throttled_to_the_interval(redis_url, conn, caplog):
    cfg = _cfg(redis_url, "auto")
    _seed(conn, cfg)
    rep = ProgressReporter(cfg, conn, stream=io.StringIO())
    assert rep.mode == "log"
    with caplog.at_level(logging.INFO, logger="budgetq.progress"):
        rep.update()
        rep.update()  # within progress_interval_s: nothing new
        run_script(conn, budget.reserve("A1", "A1-y", 100))
        run_script(conn, budget.commit("A1", "A1-y", 0, 50, "stop", "{}"))
        rep.close()   # the final numbers, once: B2's did not move since its last line
    lines = [r for r in caplog.records if r.name == "budgetq.progress"]
    assert [r.dataset for r in lines] == ["A1", "B2", "A1"]
    assert lines[2].getMessage().startswith("progress A1 30.00% (300 / 1.00k tokens")
    a1 = lines[0]
    assert a1.getMessage().startswith("progress A1 25.00% (250 / 1.00k tokens")
    assert (a1.used, a1.budget, a1.committed, a1.in_flight) == (250, 1000, 1, 0)
    # the ETA names the end it comes to (shared/ends.py): here the budget, the file's size unknown
    assert a1.eta_by == "budget" and a1.getMessage().endswith(" (budget))"), a1.getMessage()
    as_json = json.loads(JsonFormatter().format(a1))  # one JSON object, the numbers as fields
    assert as_json["dataset"] == "A1" and as_json["used"] == 250 and as_json["logger"] == "budgetq.progress"


def test_bars_on_a_terminal(redis_url, conn, caplog):
    cfg = _cfg(redis_url, "auto")
    _seed(conn, cfg)
    tty = _TTY()
    rep = ProgressReporter(cfg, conn, stream=tty)
    assert rep.mode == "bars"
    with caplog.at_level(logging.INFO, logger="budgetq.progress"):
        rep.update()
        rep.close()
    out = tty.getvalue()
    assert "A1" in out and "B2" in out and "25.00%" in out and "250" in out
    assert re.search(r"ETA +\S+ budget", out), out  # the end the ETA comes to
    assert not [r for r in caplog.records if r.name == "budgetq.progress"]  # bars, not log lines


def test_forced_bars_and_off(redis_url, conn, caplog):
    cfg = _cfg(redis_url, "bars")
    _seed(conn, cfg)
    plain = io.StringIO()
    rep = ProgressReporter(cfg, conn, stream=plain)
    rep.update()
    rep.close()
    assert rep.mode == "bars" and "25.00%" in plain.getvalue()

    off = io.StringIO()
    rep = ProgressReporter(_cfg(redis_url, "off"), conn, stream=off)
    with caplog.at_level(logging.DEBUG):
        rep.update()
        rep.close()
    assert off.getvalue() == "" and not [r for r in caplog.records if r.name == "budgetq.progress"]


def _queued_with_a_rate(conn, cfg: Config, queued: int) -> None:
    """A1 with ``queued`` jobs waiting and tokens committed in the last minute: a rate, so an ETA could be made."""
    _seed(conn, cfg)
    q = Queue(keys.queue_name("A1"), connection=conn, serializer=JSONSerializer)
    for i in range(queued):
        q.enqueue("budgetq.worker.job.run_prompt", {"id": f"q{i}"}, job_id=f"A1-q{i}")
    now = conn.time()[0]
    conn.hset(keys.conf_key("A1"), "registered_at", now - 1000)


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "budgetq.progress" and r.levelno == logging.WARNING]


def test_queued_prompts_and_no_worker_are_said_in_one_line_and_there_is_no_eta(redis_url, conn, caplog):
    cfg = _cfg(redis_url, "log")
    _queued_with_a_rate(conn, cfg, queued=3)
    line = "no worker is running: 3 prompts queued (start `budgetq worker -c CONFIG`)"
    rep = ProgressReporter(cfg, conn, stream=io.StringIO())
    with caplog.at_level(logging.INFO, logger="budgetq.progress"):
        rep.update(force=True)  # the first look: workers started beside the producer get a grace period
        assert line not in _warnings(caplog)
        rep.no_worker_grace_s = 0.0   # (the grace is over)
        rep.update(force=True)
        rep.update(force=True)        # unchanged, and not yet FAULTS_REPEAT_S later: said once
        assert _warnings(caplog) == [line]
        a1 = [r for r in caplog.records if getattr(r, "dataset", None) == "A1"][-1]
        assert a1.getMessage().endswith("tok/s, ETA -)") and a1.tok_s > 0 and a1.eta_s is None, a1.getMessage()

        conn.sadd(keys.WORKERS, "w1")  # a worker registers: the stall is over, and said to be
        conn.hset(keys.worker_key("w1"), mapping={"host": "h", "pid": 1, "concurrency": 4, "endpoints": "{}"})
        rep.update(force=True)
    assert _warnings(caplog) == [line, "1 worker running now"]
    a1 = [r for r in caplog.records if getattr(r, "dataset", None) == "A1"][-1]
    assert a1.eta_s is not None and "ETA -" not in a1.getMessage()


def test_a_held_dataset_says_held_and_has_no_eta(redis_url, conn, caplog):
    cfg = _cfg(redis_url, "log")
    _queued_with_a_rate(conn, cfg, queued=1)
    conn.hset(keys.conf_key("A1"), "hold", "writing out/A1.jsonl failed: No space left on device")
    rep = ProgressReporter(cfg, conn, stream=io.StringIO())
    rep.no_worker_grace_s = float("inf")  # (no worker here either: not what this test is about)
    with caplog.at_level(logging.INFO, logger="budgetq.progress"):
        rep.close()
    a1, b2 = [r for r in caplog.records if r.name == "budgetq.progress" and hasattr(r, "dataset")]
    assert a1.state == "held" and a1.eta_s is None and a1.tok_s > 0
    assert a1.getMessage() == f"progress A1 25.00% (250 / 1.00k tokens, held, {a1.tok_s:.0f} tok/s, ETA -)"
    assert b2.state == "idle" and ", held," not in b2.getMessage()
