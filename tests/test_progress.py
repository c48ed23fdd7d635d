"""The producer's progress display: rich bars on a terminal, log lines otherwise, nothing when off."""

from __future__ import annotations

import io
import json
import logging

from budgetq.producer.run.progress import ProgressReporter
from budgetq.shared import budget
from budgetq.shared.budget import register_dataset
from budgetq.shared.config import Config, DatasetConfig
from budgetq.shared.logs import JsonFormatter
from budgetq.shared.scripts import run as run_script


def _cfg(redis_url: str, progress: str, interval: float = 10.0) -> Config:
    ds = [DatasetConfig(name=n, path="x", budget="1k", sampling={"max_tokens": 100}) for n in ("A1", "B2")]
    return Config(redis_url=redis_url, datasets=ds, producer={"progress": progress, "progress_interval_s": interval})


def _seed(conn, cfg: Config) -> None:
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
        rep.close()   # the final numbers, always
    lines = [r for r in caplog.records if r.name == "budgetq.progress"]
    assert [r.dataset for r in lines] == ["A1", "B2", "A1", "B2"]
    a1 = lines[0]
    assert a1.getMessage().startswith("progress A1 25.00% (250 / 1.00k tokens")
    assert (a1.used, a1.budget, a1.committed, a1.in_flight) == (250, 1000, 1, 0)
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
