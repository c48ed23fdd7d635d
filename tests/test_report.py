"""`budgetq report` (issue 40): the run in pictures, one self-contained HTML file.

Each report is opened in a real headless Chromium through its DevTools protocol: it must render
with no console error and load nothing but itself, and the numbers it shows (the tables' data-value
cells, which the plots draw) must equal what the test recounts from the rows on its own.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import shutil
import signal
import subprocess
import tempfile
from html.parser import HTMLParser
from pathlib import Path

import pytest

from budgetq.shared.ledger import read_ledgers
from budgetq.simulator.local import free_port
from tests.helpers import PY, ROOT, Procs, http_get, live_run, rows, wait_for, write_config, write_dataset

# name: (weight, prompts); B2 keeps only complete answers (its cut ones go to B2.truncated.jsonl);
# C1 runs out of prompts before its share of the total.
DATASETS = {"A1": (1.0, 300), "B2": (2.0, 300), "C1": (1.0, 25)}
MAX_TOKENS = 300
TOTAL = 24_000
BINS = 40   # producer/ops/report_data.py HIST_BINS
REPORT_WAIT_S = 120   # a GET of the monitor's /report: drawn when asked (see its use)


def _chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if path := shutil.which(name):
            return path
    pytest.skip("chromium not installed (.ci/run installs Debian's chromium package)")


# ---------------------------------------------------------------- Chromium, through DevTools


async def _cdp_open(browser: str, url: str) -> dict:
    """Open ``url`` in headless Chromium; return its DOM after load, every console message and
    exception, every log entry (a failed load is one), and every URL the page asked for."""
    import aiohttp

    with tempfile.TemporaryDirectory() as profile:
        proc = await asyncio.create_subprocess_exec(
            browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
            "--disable-background-networking", "--disable-component-update", "--disable-sync", "--no-first-run",
            f"--user-data-dir={profile}", "--remote-debugging-port=0", "about:blank",
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)
        try:
            assert proc.stderr is not None
            port = None
            async with asyncio.timeout(60):
                while port is None:
                    line = (await proc.stderr.readline()).decode(errors="replace")
                    assert line, "chromium exited before it said where DevTools listens"
                    if m := re.search(r"DevTools listening on ws://[^:]+:(\d+)/", line):
                        port = int(m.group(1))
            async with aiohttp.ClientSession() as http:
                async with asyncio.timeout(60):
                    while True:   # the first page target appears a moment after the browser's
                        async with http.get(f"http://127.0.0.1:{port}/json/list") as resp:
                            pages = [t for t in await resp.json() if t["type"] == "page"]
                        if pages:
                            break
                        await asyncio.sleep(0.1)
                async with http.ws_connect(pages[0]["webSocketDebuggerUrl"], max_msg_size=0) as ws:
                    return await _cdp_session(ws, url)
        finally:
            proc.kill()
            await proc.wait()


async def _cdp_session(ws, url: str) -> dict:
    seen: dict = {"console": [], "exceptions": [], "log": [], "requests": [], "failed": []}
    replies: dict[int, dict] = {}
    loaded = asyncio.Event()
    next_id = 0

    async def send(method: str, **params) -> dict:
        nonlocal next_id
        next_id += 1
        mine = next_id
        await ws.send_json({"id": mine, "method": method, "params": params})
        while mine not in replies:
            msg = json.loads((await ws.receive()).data)
            if "id" in msg:
                replies[msg["id"]] = msg
                continue
            method_, p = msg.get("method"), msg.get("params", {})
            if method_ == "Runtime.consoleAPICalled":
                seen["console"].append((p["type"], [a.get("value", a.get("description")) for a in p["args"]]))
            elif method_ == "Runtime.exceptionThrown":
                seen["exceptions"].append(p["exceptionDetails"].get("text"))
            elif method_ == "Log.entryAdded":
                seen["log"].append((p["entry"]["level"], p["entry"]["text"]))
            elif method_ == "Network.requestWillBeSent":
                seen["requests"].append(p["request"]["url"])
            elif method_ == "Network.loadingFailed":
                seen["failed"].append(p.get("errorText"))
            elif method_ == "Page.loadEventFired":
                loaded.set()
        reply = replies.pop(mine)
        assert "error" not in reply, reply
        return reply["result"]

    async with asyncio.timeout(90):
        for domain in ("Runtime", "Log", "Network", "Page"):
            await send(f"{domain}.enable")
        await send("Page.navigate", url=url)
        while not loaded.is_set():
            await send("Runtime.evaluate", expression="1")   # reads the events that came meanwhile
            await asyncio.sleep(0.05)
        await send("Runtime.evaluate", expression="new Promise(r => setTimeout(r, 300))", awaitPromise=True)
        dom = await send("Runtime.evaluate", expression="document.documentElement.outerHTML", returnByValue=True)
    seen["dom"] = dom["result"]["value"]
    return seen


def open_in_chromium(path: Path) -> dict:
    """The report as Chromium renders it, checked: no console error, nothing loaded but the file."""
    seen = asyncio.run(_cdp_open(_chromium(), path.resolve().as_uri()))
    assert not seen["exceptions"], seen["exceptions"]
    assert not [c for c in seen["console"] if c[0] in ("error", "warning", "assert")], seen["console"]
    assert not [e for e in seen["log"] if e[0] in ("error", "warning")], seen["log"]
    assert not seen["failed"], seen["failed"]
    # self-contained: the page asked for nothing but itself (no CDN, no font, no image file)
    assert [u for u in seen["requests"] if not u.startswith("data:")] == [path.resolve().as_uri()], seen["requests"]
    page = Page()
    page.feed(seen["dom"])
    return {"page": page, **seen}


class Page(HTMLParser):
    """The rendered report: its tables (each cell's data-key and data-value, each row's data-*),
    the line it opens with, the sections and the plots (inline <svg>) in each."""

    def __init__(self) -> None:
        super().__init__()
        self.tables: dict[str, dict] = {}
        self.first: tuple[str, dict] | None = None    # the body's first element
        self.state: dict = {}
        self.state_text = ""
        self.svgs: dict[str, int] = {}
        self.scripts = 0
        self._table: str | None = None
        self._section: str | None = None
        self._in_state = False
        self._in_body = False
        self._svg_depth = 0

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "body":
            self._in_body = True
        elif self._in_body and self.first is None:
            self.first = (tag, a)
        if tag == "script":
            self.scripts += 1
        if tag == "section":
            self._section = a.get("id")
        if tag == "svg":
            if self._svg_depth == 0 and self._section:
                self.svgs[self._section] = self.svgs.get(self._section, 0) + 1
            self._svg_depth += 1
        if a.get("id") == "run-state":
            self.state, self._in_state = a, True
        if tag == "table":
            self._table = a["id"]
            self.tables[self._table] = {"attrs": a, "rows": []}
        elif tag == "tr" and self._table:
            self.tables[self._table]["rows"].append({"attrs": a, "cells": {}})
        elif tag == "td" and self._table:
            self.tables[self._table]["rows"][-1]["cells"][a["data-key"]] = a["data-value"]

    def handle_endtag(self, tag):
        if tag == "table":
            self._table = None
        if tag == "svg":
            self._svg_depth -= 1
        if tag == "p":
            self._in_state = False

    def handle_data(self, data):
        if self._in_state:
            self.state_text += data

    def rows_of(self, table: str) -> list[dict]:
        return [r for r in self.tables[table]["rows"] if r["cells"]]

    def by_ds(self, table: str) -> dict[str, dict[str, str]]:
        return {r["attrs"]["data-ds"]: r["cells"] for r in self.rows_of(table)}


# ---------------------------------------------------------------- what the test recounts


def _nearest_rank(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, math.ceil(q * len(xs)) - 1))]


def check_numbers(page: Page, out: Path, weights: dict[str, float] | None, budgets: dict[str, int] | None = None):
    """Every number the report shows of the rows equals the rows' own, recounted here."""
    kept = {n: rows(out / f"{n}.jsonl") for n in DATASETS}
    cut_aside = {n: rows(out / f"{n}.truncated.jsonl") for n in DATASETS}
    counted = {n: sum(r["completion_tokens"] for r in kept[n]) for n in DATASETS}
    summary = page.by_ds("datasets")
    assert set(summary) == {*DATASETS, "all"}
    for n in DATASETS:
        answers = kept[n] + cut_aside[n]
        lengths = [r["completion_tokens"] for r in answers]
        cut = sum(r["finish_reason"] == "length" for r in answers)
        s = summary[n]
        assert int(s["rows"]) == len(kept[n]) > 0 and int(s["truncated_rows"]) == len(cut_aside[n]), (n, s)
        assert int(s["counted_tokens"]) == counted[n] and int(s["completion_tokens"]) == sum(lengths), (n, s)
        assert int(s["cut"]) == cut and float(s["cut_share"]) == pytest.approx(cut / len(answers)), (n, s)
        assert float(s["mean"]) == pytest.approx(sum(lengths) / len(answers), abs=0.05), (n, s)
        assert float(s["kept_share"]) == pytest.approx(counted[n] / sum(counted.values())), (n, s)
        target = weights if weights is not None else budgets
        assert target is not None
        assert float(s["target_share"]) == pytest.approx(target[n] / sum(target.values())), (n, s)
        # the histogram: every answer in the bin its length falls in, the bins as the page states them
        hist = page.tables[f"hist-{n}"]
        width = int(hist["attrs"]["data-width"])
        assert width * BINS > max(MAX_TOKENS, *lengths)
        shown = {int(r["attrs"]["data-lo"]): int(r["cells"]["count"]) for r in page.rows_of(f"hist-{n}")}
        for r in page.rows_of(f"hist-{n}"):
            assert int(r["attrs"]["data-hi"]) == int(r["attrs"]["data-lo"]) + width
        recount: dict[int, int] = {}
        for x in lengths:
            recount[x // width * width] = recount.get(x // width * width, 0) + 1
        assert shown == recount, n
        assert int(hist["attrs"]["data-total"]) == len(answers)
        # latency: nearest rank over the rows' latency_s
        lat = page.by_ds("latency")[n]
        xs = [r["latency_s"] for r in answers]
        for q in ("p50", "p95", "p99"):
            assert float(lat[q]) == _nearest_rank(xs, int(q[1:]) / 100), (n, q, lat)
        nxt = page.by_ds("next-run")[n]
        assert int(nxt["mean"]) == round(sum(lengths) / len(answers)) and int(nxt["max_tokens"]) == MAX_TOKENS
    total = summary["all"]
    assert int(total["rows"]) == sum(len(v) for v in kept.values())
    assert int(total["counted_tokens"]) == sum(counted.values())
    assert page.tables["datasets"]["attrs"]["data-target"] == ("weighted share" if weights else "budget share")


def check_plots(page: Page) -> None:
    """Every plot the issue lists is on the page (inline SVG) and there is no script at all."""
    assert page.scripts == 0
    for section, n in (("tokens-over-time", 1), ("fleet", 1), ("lengths", len(DATASETS)), ("latency", 1),
                       ("shares", 1), ("ledger", 1)):
        assert page.svgs.get(section, 0) == n, (section, page.svgs)


# ---------------------------------------------------------------- runs


def _datasets(tmp_path: Path, budget: str | None = None) -> list[dict]:
    out = []
    for name, (w, n) in DATASETS.items():
        write_dataset(tmp_path / f"{name}.jsonl", n)
        d = {"name": name, "path": str(tmp_path / f"{name}.jsonl"), "id_field": "id", "weight": w,
             "sampling": {"max_tokens": MAX_TOKENS}, "prior_mean_tokens": 120}
        if name == "B2":
            d["keep"] = "complete"
        if budget is not None:
            d["budget"] = budget
        out.append(d)
    return out


def test_report_of_a_run_equals_its_rows_in_chromium_with_redis_and_without(tmp_path, redis_url, conn,
                                                                               sim_factory):
    sim = sim_factory("--speedup", "300", "--seed", "5", "--length-mean", "150")
    cfg = write_config(tmp_path, redis_url, sim, _datasets(tmp_path), run={"total_budget": TOTAL},
                       worker={"concurrency": 16}, producer={"progress": "off", "report": True})
    run = live_run(cfg, tmp_path, producer_args=["--log-level", "WARNING"], timeout_s=240)
    assert run.producer.returncode == 0, run.producer.stderr
    out = run.out
    report = out / "report.html"
    # produce wrote the report at its end and named it on its last line
    assert run.producer.stdout.rstrip().splitlines()[-1] == f"report: {report}", run.producer.stdout[-500:]
    assert (out / "run-log.jsonl").exists()
    assert rows(out / "B2.truncated.jsonl"), "the run cut none of B2's answers: nothing set aside to count"

    seen = open_in_chromium(report)
    page: Page = seen["page"]
    assert page.first == ("p", page.state) and page.state["data-state"] == "complete", (page.first, page.state_text)
    weights = {n: w for n, (w, _p) in DATASETS.items()}
    check_numbers(page, out, weights)
    check_plots(page)
    # the ledger, as Redis holds it
    ledgers = read_ledgers(conn, list(DATASETS))
    shown = page.by_ds("ledger")
    for n in DATASETS:
        for state in ("rows", "truncated", "skipped", "queued", "running", "unread"):
            assert int(shown[n][state] or 0) == (ledgers[n][state] or 0), (n, state, shown[n])
    assert int(shown["C1"]["unread"]) == 0 and int(shown["A1"]["unread"]) > 0   # C1 ran out of prompts

    # Redis gone (nothing listens there): the same numbers, the ledger from the run log's last sample
    gone = f"redis://127.0.0.1:{free_port()}/0"
    alone = subprocess.run([*PY, "report", "-c", str(cfg), "--redis-url", gone, "--out", str(tmp_path / "r2.html")],
                           cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert alone.returncode == 0, alone.stderr
    assert alone.stdout.splitlines() == ["run complete: every dataset is at its end", f"report: {tmp_path / 'r2.html'}"]
    page2: Page = open_in_chromium(tmp_path / "r2.html")["page"]
    check_numbers(page2, out, weights)
    check_plots(page2)
    assert page2.by_ds("ledger") == shown
    assert page2.by_ds("datasets") == {n: {**v} for n, v in page.by_ds("datasets").items()}

    # the monitor links to the report and serves it, drawn from this directory and Redis
    from budgetq.producer.ops.monitor import MonitorThread
    from budgetq.shared.config_load import load_config

    mon = MonitorThread(load_config(str(cfg)), port=0)
    port = mon.start()
    try:
        _st, _ct, index = http_get(f"http://127.0.0.1:{port}/")
        assert 'href="report"' in index
        # The monitor draws the report when asked (every row on disk): 1.2 s here on a quiet machine, 4.6 s
        # with every core busy, past 10 s twice in full suites: the wait is not what this test checks.
        status, ctype, body = http_get(f"http://127.0.0.1:{port}/report", timeout_s=REPORT_WAIT_S)
        assert status == 200 and ctype.startswith("text/html") and 'data-state="complete"' in body
    finally:
        mon.stop()


def test_report_mid_run_says_so_first_and_marks_the_events_then_the_stopped_run(tmp_path, redis_url, conn,
                                                                                sim_factory):
    # slow enough that the run is still going when the report is drawn; it ends when stopped
    sim = sim_factory("--speedup", "1", "--peak-tok-s", "3000", "--seed", "6", "--length-mean", "150")
    cfg = write_config(tmp_path, redis_url, sim, _datasets(tmp_path, budget="1M"), worker={"concurrency": 8},
                       producer={"progress": "off", "report": True})
    out = tmp_path / "out"
    procs = Procs(cfg, tmp_path)
    procs.worker()
    try:
        producer = procs.producer()
        wait_for(lambda: len(rows(out / "A1.jsonl")) >= 3, 120, "A1's first rows")
        pause = subprocess.run([*PY, "pause", "C1", "-c", str(cfg)], cwd=ROOT, capture_output=True, text=True,
                               timeout=60)
        assert pause.returncode == 0, pause.stderr
        mid = subprocess.run([*PY, "report", "-c", str(cfg)], cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert mid.returncode == 0, mid.stderr
        assert producer.poll() is None, "the run ended before its mid-run report"
        assert mid.stdout.splitlines()[0].startswith("RUN STILL GOING (producer "), mid.stdout
        page: Page = open_in_chromium(out / "report.html")["page"]
        assert page.first == ("p", page.state) and page.state["data-state"] == "going"
        assert page.state_text.startswith("RUN STILL GOING")
        whats = [r["cells"]["what"] for r in page.rows_of("events")]
        assert "produce started" in whats and any(w.startswith("pause C1") for w in whats), whats
        # the run log has copied the pause too: it outlives Redis
        wait_for(lambda: '"action":"pause"' in (out / "run-log.jsonl").read_text(), 30, "the run log's pause")
        producer.send_signal(signal.SIGINT)   # an orderly stop: the run is not complete
        assert producer.wait(60) == 3, Procs.log(producer)
    finally:
        procs.stop_all()
    log = Procs.log(producer).rstrip().splitlines()
    assert log[-1] == f"report: {out / 'report.html'}", log[-5:]
    gone = f"redis://127.0.0.1:{free_port()}/0"
    after = subprocess.run([*PY, "report", "-c", str(cfg), "--redis-url", gone], cwd=ROOT, capture_output=True,
                           text=True, timeout=120)
    assert after.returncode == 0, after.stderr
    assert after.stdout.splitlines()[0].startswith("run stopped before its end"), after.stdout
    seen = open_in_chromium(out / "report.html")
    page = seen["page"]
    assert page.state["data-state"] == "stopped"
    whats = [r["cells"]["what"] for r in page.rows_of("events")]
    assert any(w.startswith("pause C1") for w in whats), whats
    check_numbers(page, out, None, budgets={n: 1_000_000 for n in DATASETS})
    check_plots(page)


def test_the_demo_ends_naming_its_report_which_has_every_plot(tmp_path):
    """`make demo` (budgetq demo): its last line names the report, and the report draws every plot."""
    demo = subprocess.run([*PY, "demo"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert demo.returncode == 0, demo.stderr[-3000:]
    last = demo.stdout.rstrip().splitlines()[-1]
    m = re.search(r"; the run in pictures: (\S+/report\.html)$", last)
    assert m, last
    report = Path(m.group(1))
    try:
        page: Page = open_in_chromium(report)["page"]
        assert page.state["data-state"] == "complete"
        check_plots(page)
    finally:
        shutil.rmtree(report.parent, ignore_errors=True)


def _report_fails(cfg: Path, *extra: str) -> str:
    """``budgetq report`` on a bad directory: exit 2 and one line naming what is wrong; returns it."""
    gone = f"redis://127.0.0.1:{free_port()}/0"
    res = subprocess.run([*PY, "report", "-c", str(cfg), "--redis-url", gone, *extra], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and res.stdout == "", (res.stdout, res.stderr)
    lines = res.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("budgetq: error: ") and "Traceback" not in res.stderr, res.stderr
    return lines[0]


def test_a_bad_or_partial_output_dir_is_one_line_naming_what_is_missing(tmp_path):
    names = list(DATASETS)
    cfg = write_config(tmp_path, "redis://127.0.0.1:1/0", "http://127.0.0.1:1",
                       [{"name": n, "path": str(tmp_path / f"{n}.jsonl"), "budget": "10k",
                         "sampling": {"max_tokens": MAX_TOKENS}} for n in names])
    out = tmp_path / "out"
    assert f"output_dir {out}: missing" in _report_fails(cfg)
    out.mkdir()
    line = _report_fails(cfg)
    assert "no run-log.jsonl and no rows file (A1.jsonl, B2.jsonl, C1.jsonl)" in line
    # a partial copy: the run log counted A1's rows, its file is not here
    t = 1_700_000_000.0
    sample = {"kind": "sample", "t": t + 1, "workers": 1, "deadline": None, "total": None,
              "ds": {n: {"used": 500, "budget": 10_000, "rows": 4, "ledger": {"rows": 4, "queued": 0}} for n in names}}
    (out / "run-log.jsonl").write_text(json.dumps({"kind": "start", "t": t, "datasets": {}}) + "\n"
                                       + json.dumps(sample) + "\n")
    for n in ("B2", "C1"):
        (out / f"{n}.jsonl").write_text("".join(json.dumps({"id": f"p{i}", "completion_tokens": 125}) + "\n"
                                                for i in range(4)))
    line = _report_fails(cfg)
    assert f"{out / 'A1.jsonl'}: missing or empty, but the run counted 4 rows of A1" in line, line
    # a row that is not one, in the middle of a file: its file and line
    (out / "A1.jsonl").write_text(json.dumps({"id": "p0", "completion_tokens": 1}) + "\n{oops\n"
                                  + json.dumps({"id": "p1", "completion_tokens": 2}) + "\n")
    assert f"{out / 'A1.jsonl'}:2: not a JSON row" in _report_fails(cfg)
    (out / "A1.jsonl").write_text(json.dumps({"id": "p0", "text": "not ours"}) + "\n")
    assert f"{out / 'A1.jsonl'}:1: a row without completion_tokens" in _report_fails(cfg)
    # a run log that is not one
    (out / "A1.jsonl").write_text(json.dumps({"id": "p0", "completion_tokens": 1}) + "\n")
    (out / "run-log.jsonl").write_text('{"kind": "start", "t": 1}\n[1, 2]\n')
    assert f"{out / 'run-log.jsonl'}:2: a line without kind and t" in _report_fails(cfg)
    # the output directory is a file
    assert "missing" in _report_fails(cfg, "--output-dir", str(out / "A1.jsonl"))


def test_rows_read_in_several_passes_equal_one_read_of_the_whole_file(tmp_path):
    """The monitor's /report reads only what was appended since its last report (report_files._TAILS):
    a row written in two parts (the second pass sees its first half only), rows appended between
    passes, and a file replaced by another all read as one read of the final file does."""
    from budgetq.producer.ops.report_files import read_answers

    path = tmp_path / "A1.jsonl"

    def row(i: int) -> bytes:
        return json.dumps({"id": f"p{i}", "completion_tokens": 10 + i, "prompt_tokens": 3,
                           "finish_reason": "length" if i % 3 == 0 else "stop", "latency_s": i / 10}).encode() + b"\n"

    def same(a, b) -> bool:
        return (a.rows, a.lengths, a.counted, a.completion, a.cut, a.latencies) == \
            (b.rows, b.lengths, b.counted, b.completion, b.cut, b.latencies)

    path.write_bytes(b"".join(row(i) for i in range(5)))
    first = read_answers(path, "total", keep=True)
    assert first.rows == 5 and first.counted == sum(13 + i for i in range(5))
    torn = row(5)
    with open(path, "ab") as fh:
        fh.write(torn[:7])   # half a row: not read yet
    assert same(read_answers(path, "total", keep=True), first)
    with open(path, "ab") as fh:
        fh.write(torn[7:] + row(6) + row(7))
    again = read_answers(path, "total", keep=True)
    assert same(again, read_answers(path, "total")) and again.rows == 8
    assert first.rows == 5, "a kept read goes on in its own copy"
    # replaced (another inode, shorter): read whole again
    other = tmp_path / "new.jsonl"
    other.write_bytes(row(1) + row(2))
    other.replace(path)
    assert same(read_answers(path, "total", keep=True), read_answers(path, "total"))
    assert read_answers(path, "total", keep=True).rows == 2


def test_monitor_without_the_output_dir_answers_one_line(tmp_path, redis_url):
    """A monitor on a host without the output directory: /report is a 404 naming it, not a 500."""
    from budgetq.producer.ops.monitor import MonitorThread
    from budgetq.shared.config import Config

    mon = MonitorThread(Config(redis_url=redis_url, output_dir=str(tmp_path / "elsewhere"),
                               datasets=[{"name": "A1", "path": "x", "budget": "1k"}]), port=0)
    port = mon.start()
    try:
        status, _ct, body = http_get(f"http://127.0.0.1:{port}/report", timeout_s=REPORT_WAIT_S)
    finally:
        mon.stop()
    assert status == 404 and body == f"no run report: output_dir {tmp_path / 'elsewhere'}: missing (no run has " \
                                      "written there)\n", body


def test_the_marks_name_deaths_restarts_lost_workers_and_people_not_the_automatic_moves(tmp_path):
    """The run log's story as the plots mark it: a start with no end before the next start is a
    producer that died; one that ended in order and started again only restarted; a fall in live
    workers is marked; people's moves and the abort at the deadline are, the producer's hundreds
    of budget steps are not (they are the budget line)."""
    from budgetq.producer.ops.report_data import RunData

    def sample(t: float, workers: int, used: int) -> dict:
        return {"kind": "sample", "t": t, "workers": workers, "ds": {"A1": {"used": used, "budget": 1000}}}

    samples = [{"kind": "start", "t": 0.0}, sample(1, 2, 0), sample(2, 2, 100), sample(3, 1, 150),
               {"kind": "start", "t": 10.0}, sample(11, 1, 150), sample(12, 1, 250), {"kind": "end", "t": 13.0},
               {"kind": "start", "t": 20.0}, sample(21, 1, 250), sample(23, 1, 450)]
    events = [{"t": 11.5, "source": "operator", "action": "pause", "dataset": "A1", "new": "True"},
              {"t": 11.6, "source": "auto", "action": "budget_deadline", "dataset": "A1", "new": "900"},
              {"t": 11.7, "source": "operator", "action": "budget_set", "dataset": "A1", "new": "2000"},
              {"t": 22.0, "source": "auto", "action": "abort", "dataset": "A1", "new": "3 requests in flight"}]
    run = RunData(tmp_path, [], [], samples, events, None, "complete", "", False, True, False)
    assert run.marks() == [(0.0, "produce started"), (3, "producer died"), (3, "workers 2 -> 1"),
                           (10.0, "produce restarted"), (11.5, "pause A1"), (11.7, "budget_set A1 2000"),
                           (20.0, "produce restarted"), (22.0, "abort A1 3 requests in flight")]
    # the fleet's rate: between samples of one producer, never across the gap between two
    assert [(t, r) for t, r, _w in run.fleet_rate()] == [(2, 100.0), (3, 50.0), (12, 100.0), (23, 100.0)]
    assert run.run_tok_s() == pytest.approx(450 / 5)


def test_discarded_answers_are_shown_only_where_the_ledger_has_them(tmp_path):
    """Issue 37's `discarded` ledger state, by reason, once a ledger holds it; before, the report
    says none is recorded and invents no number."""
    from budgetq.producer.ops.report import render
    from budgetq.producer.ops.report_data import gather
    from budgetq.shared.config_load import load_config

    cfg = write_config(tmp_path, "redis://127.0.0.1:1/0", "http://127.0.0.1:1",
                       [{"name": "A1", "path": str(tmp_path / "A1.jsonl"), "budget": "10k",
                         "sampling": {"max_tokens": MAX_TOKENS}}])
    out = tmp_path / "out"
    out.mkdir()
    (out / "A1.jsonl").write_text("".join(json.dumps({"id": f"p{i}", "completion_tokens": 100 + i}) + "\n"
                                          for i in range(2)))

    def page_with(ledger: dict) -> Page:
        sample = {"kind": "sample", "t": 2.0, "workers": 1, "ds": {"A1": {"used": 201, "budget": 10_000,
                                                                          "ledger": ledger}}}
        (out / "run-log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in (
            {"kind": "start", "t": 1.0}, sample, {"kind": "end", "t": 3.0, "report": {"complete": True}})))
        page = Page()
        page.feed(render(gather(load_config(str(cfg)), None)))
        return page

    ledger = {"rows": 2, "queued": 0, "running": 0, "truncated": 0, "skipped": 0, "failed": 0, "invalid": 0,
              "filtered": 0, "unread": 0}
    before = page_with(ledger)
    assert "discarded" not in before.tables  # nothing discarded: no table by reason (and no invented one)
    after = page_with({**ledger, "discarded": {"loop": 3, "empty answer": 1}})
    assert {r["attrs"]["data-reason"]: int(r["cells"]["answers"]) for r in after.rows_of("discarded")} == {
        "loop": 3, "empty answer": 1}
    assert int(after.by_ds("ledger")["A1"]["discarded"]) == 4
