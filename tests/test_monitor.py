"""The web monitor: JSON API, Prometheus /metrics, basic auth, and the page in a real headless Chromium."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import tempfile
from html.parser import HTMLParser

import pytest

from budgetq.producer.ops import metrics
from budgetq.producer.ops.monitor import MonitorThread, check_bind
from budgetq.shared import budget, keys, server_faults
from budgetq.shared.budget import register_dataset
from budgetq.shared.config import Config, DatasetConfig, MonitorConfig
from budgetq.shared.errors import ConfigError
from budgetq.shared.scripts import run as run_script
from budgetq.shared.status import COUNT_FIELDS
from budgetq.simulator.local import free_port, wait_http
from tests.helpers import (
    CLI,
    LIVE,
    ROOT,
    http_get,
    live_run,
    prometheus_samples,
    rows,
    three_datasets,
    write_config,
)


def _seed(conn) -> None:
    register_dataset(conn, DatasetConfig(name="B2", path="x", budget="10k", sampling={"max_tokens": 100},
                                         prior_mean_tokens=50))
    for i, tokens in enumerate((70, 30)):
        run_script(conn, budget.reserve("B2", f"B2-{i}", 100))
        run_script(conn, budget.commit("B2", f"B2-{i}", 0, tokens, "stop", "{}"))
    conn.hset(keys.stats_key("B2"), "skipped", 3)
    conn.sadd(keys.WORKERS, "w1")
    conn.hset(keys.worker_key("w1"), mapping={
        "host": "h1", "pid": 7, "started_at": "1700000000.5", "concurrency": 8, "in_flight": 2, "processed": 5,
        "endpoints": json.dumps({"http://sg:30000": {"healthy": True, "in_flight": 2, "failures": 0,
                                                     "ejected_since": None}})})


def test_api_and_metrics_serve_the_snapshot(redis_url, conn):
    _seed(conn)
    mon = MonitorThread(Config(redis_url=redis_url), port=0)
    port = mon.start()
    try:
        base = f"http://127.0.0.1:{port}"
        status, ctype, body = http_get(base + "/api/status")
        assert status == 200 and ctype.startswith("application/json")
        snap = json.loads(body)
        (b2,) = snap["datasets"]
        assert (b2["dataset"], b2["used"], b2["budget"], b2["counts"]["committed"]) == ("B2", 100, 10_000, 2)
        assert len(b2["history"]) == 120  # the page's chart: 10 minutes of 5 s buckets

        status, ctype, text = http_get(base + "/metrics")
        assert status == 200 and ctype.startswith("text/plain")
        m = prometheus_samples(text)
        ds = (("dataset", "B2"),)
        assert m[("budgetq_budget_tokens", ds)] == 10_000 and m[("budgetq_used_tokens", ds)] == 100
        assert m[("budgetq_reserved_tokens", ds)] == 0 and m[("budgetq_in_flight", ds)] == 0
        assert m[("budgetq_tokens_per_second", ds)] == b2["tok_s"]
        for state in COUNT_FIELDS:
            want = {"committed": 2, "skipped": 3}.get(state, 0)
            assert m[("budgetq_jobs_total", (("dataset", "B2"), ("state", state)))] == want
        assert m[("budgetq_workers", ())] == 1
        assert m[("budgetq_worker_in_flight", (("worker", "w1"),))] == 2
        assert m[("budgetq_endpoint_healthy", (("endpoint", "http://sg:30000"),))] == 1
        assert m[("budgetq_endpoint_in_flight", (("endpoint", "http://sg:30000"),))] == 2

        status, ctype, page = http_get(base + "/")
        assert status == 200 and ctype.startswith("text/html")
        assert "api/status" in page and not re.search(r"""(src|href)=["']?(https?:)?//""", page)  # no external asset
    finally:
        mon.stop()


def test_basic_auth_guards_everything_but_healthz(redis_url, conn):
    _seed(conn)
    cfg = Config(redis_url=redis_url, monitor={"username": "ops", "password": "s3cret-monitor-pw"})
    mon = MonitorThread(cfg, port=0)
    port = mon.start()
    try:
        base = f"http://127.0.0.1:{port}"
        for path in ("/", "/api/status", "/metrics"):
            assert http_get(base + path)[0] == 401
            assert http_get(base + path, ("ops", "wrong"))[0] == 401
            assert http_get(base + path, ("ops", "s3cret-monitor-pw"))[0] == 200
        assert http_get(base + "/healthz")[:1] == (200,)
    finally:
        mon.stop()


def test_refuses_a_public_bind_without_auth(redis_url):
    with pytest.raises(ConfigError, match="refusing to serve on '0.0.0.0'.*basic auth"):
        check_bind(MonitorConfig(), "0.0.0.0")
    check_bind(MonitorConfig(username="u", password="p"), "0.0.0.0")   # auth on: fine
    check_bind(MonitorConfig(), "::1")
    check_bind(MonitorConfig(), "0.0.0.0", allow_unauthenticated=True)
    with pytest.raises(ConfigError, match="both monitor.username and monitor.password"):
        check_bind(MonitorConfig(username="u"), "127.0.0.1")
    out = subprocess.run([*CLI, "monitor", "--redis-url", redis_url, "--host", "0.0.0.0"], cwd=ROOT,
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 2 and "not a loopback address" in out.stderr and "BUDGETQ_MONITOR_PASSWORD" in out.stderr


DISK_FULL = "writing /data/out/H.jsonl failed: No space left on device"
HTML_500 = "2/2 servers failing: HTTP 500 text/html (500 Internal Server Error)"


def _seed_trouble(conn) -> None:
    """B2 as in _seed, H held by the producer, and both servers of the worker failing with HTML 500s
    (the second one also with a dozen more reasons than /metrics names)."""
    _seed(conn)
    register_dataset(conn, DatasetConfig(name="H", path="x", budget="10k", sampling={"max_tokens": 100}))
    conn.hset(keys.conf_key("H"), "hold", DISK_FULL)
    views = {}
    for url, extra in (("http://sg:30000", 0), ("http://sg2:30000", metrics.MAX_REASONS + 3)):
        f = server_faults.EndpointFaults()
        for i in range(extra):
            f.fault(f"HTTP {400 + i} JSON")
        for _ in range(4):
            f.fault("HTTP 500 text/html", "<title>500 Internal Server Error</title>")
        views[url] = f.to_json(healthy=False)
    pipe = conn.pipeline()
    server_faults.publish(pipe, "w1", views, ttl_s=60)
    pipe.execute()


def test_holds_stalls_and_server_faults_reach_the_api_and_metrics(redis_url, conn):
    _seed_trouble(conn)
    mon = MonitorThread(Config(redis_url=redis_url), port=0)
    port = mon.start()
    try:
        base = f"http://127.0.0.1:{port}"
        snap = json.loads(http_get(base + "/api/status")[2])
        b2, h = snap["datasets"]
        assert (h["state"], h["hold"], h["paused"], h["eta_s"]) == ("held", DISK_FULL, False, None)
        assert b2["hold"] is None and b2["state"] != "held"
        assert snap["diagnosis"] == snap["stall"] == HTML_500
        m = prometheus_samples(http_get(base + "/metrics")[2])
    finally:
        mon.stop()
    assert m[("budgetq_held", (("dataset", "H"),))] == 1 and m[("budgetq_held", (("dataset", "B2"),))] == 0
    assert m[("budgetq_paused", (("dataset", "H"),))] == 0   # held is not an operator's pause
    assert m[("budgetq_stalled", ())] == 1
    assert m[("budgetq_producer_running", ())] == 0   # seeded without one
    assert m[("budgetq_endpoint_failing", (("endpoint", "http://sg:30000"),))] == 1

    def faults(url: str) -> dict[str, float]:
        return {dict(labels)["reason"]: v for (name, labels), v in m.items()
                if name == "budgetq_endpoint_faults" and dict(labels)["endpoint"] == url}

    assert faults("http://sg:30000") == {"HTTP 500 text/html": 4}
    capped = faults("http://sg2:30000")  # 16 reasons: the 12 most frequent by name, the rest summed
    assert len(capped) == metrics.MAX_REASONS + 1 and capped["HTTP 500 text/html"] == 4
    assert capped["(other)"] == 4 and sum(capped.values()) == 4 + metrics.MAX_REASONS + 3


class _Rows(HTMLParser):
    """Collects the dataset rows and chart lines of the rendered DOM."""

    def __init__(self) -> None:
        super().__init__()
        self.datasets: dict[str, dict[str, str]] = {}
        self.lines: set[str] = set()
        self.rendered = False
        self.alerts: list[str] = []        # the lines of <div id="alerts">
        self.states: dict[str, str] = {}   # dataset -> its state cell's text
        self.faults: dict[str, str] = {}   # endpoint -> its faults cell's text
        self.cells: dict[tuple[str, str], str] = {}  # (dataset, "stop" | "unread") -> the cell's text
        self._in: tuple[str, str] | None = None
        self._row: tuple[str, str] | None = None
        self._depth = 0                    # open <div>s inside #alerts
        self.budgets: dict[str, dict[str, str]] = {}   # dataset -> its dashed budget line's attributes
        self.chart: dict[str, str] = {}                # the chart <svg>'s attributes
        # table id -> the alignment of its header cells ("l"/"r"), and of each row's cells
        self.heads: dict[str, list[str]] = {}
        self.aligns: dict[str, list[list[str]]] = {}
        self.cells: dict[str, list[list[str]]] = {}    # table id -> each row's cell texts (the header's: [])
        self._table: str | None = None
        self._cell: str | None = None

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "table":
            self._table = a.get("id")
        if tag in ("th", "td") and self._table:
            heads = self.heads.setdefault(self._table, [])
            first = (not heads) if tag == "th" else not self.aligns[self._table][-1]
            align = "l" if first or "l" in (a.get("class") or "").split() else "r"
            if tag == "th":
                heads.append(align)
            else:
                self.aligns[self._table][-1].append(align)
                self.cells[self._table][-1].append("")
                self._cell = self._table
        if tag == "tr" and self._table:
            self.aligns.setdefault(self._table, []).append([])
            self.cells.setdefault(self._table, []).append([])
        if tag == "line" and a.get("data-budget"):
            self.budgets[a["data-budget"]] = a
        if tag == "svg" and a.get("id") == "chart":
            self.chart = a
        if tag == "div" and a.get("id") == "alerts":
            self._in = ("alerts", "")
            self._depth = 0
        elif tag == "div" and self._in and self._in[0] == "alerts":
            self.alerts.append("")
            self._depth += 1
        if tag == "tr":
            self._row = (("ds", a["data-dataset"]) if "data-dataset" in a
                         else ("ep", a["data-endpoint"]) if "data-endpoint" in a else None)
        if tag == "td" and self._row:
            classes = (a.get("class") or "").split()
            if self._row[0] == "ds" and any(c.startswith("state-") for c in classes):
                self.states[self._row[1]] = ""
                self._in = ("state", self._row[1])
            elif self._row[0] == "ep" and "faults" in classes:
                self.faults[self._row[1]] = ""
                self._in = ("faults", self._row[1])
            elif self._row[0] == "ds" and ("stop" in classes or "unread" in classes):
                column = "stop" if "stop" in classes else "unread"
                self.cells[(self._row[1], column)] = ""
                self._in = (column, self._row[1])
        if tag == "tr" and "data-dataset" in a:
            self.datasets[a["data-dataset"]] = a
        if tag == "polyline" and a.get("data-dataset"):
            self.lines.add(a["data-dataset"])
        if tag == "body" and a.get("data-rendered"):
            self.rendered = True

    def handle_endtag(self, tag):
        if tag == "table":
            self._table = None
        if tag == "td":
            self._cell = None
        if tag == "td" and self._in and self._in[0] in ("state", "faults", "stop", "unread"):
            self._in = None
        if tag == "div" and self._in and self._in[0] == "alerts":
            if self._depth == 0:   # the end of #alerts itself
                self._in = None
            self._depth -= 1

    def handle_data(self, data):
        if self._cell:
            self.cells[self._cell][-1][-1] += data
        if not self._in:
            return
        kind, key = self._in
        if kind == "alerts" and self.alerts:
            self.alerts[-1] += data
        elif kind == "state":
            self.states[key] += data
        elif kind == "faults":
            self.faults[key] += data
        elif kind in ("stop", "unread"):
            self.cells[(key, kind)] += data


def _chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if path := shutil.which(name):
            return path
    pytest.skip("chromium not installed (.ci/run installs Debian's chromium package)")


def _dump_dom(browser: str, url: str) -> str:
    with tempfile.TemporaryDirectory() as profile:
        out = subprocess.run(
            [browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             "--no-first-run", f"--user-data-dir={profile}", "--virtual-time-budget=8000", "--dump-dom", url],
            capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


def _render_page(browser: str, redis_url: str) -> _Rows:
    """The monitor page of what ``redis_url`` holds, as headless Chromium renders it."""
    mon = MonitorThread(Config(redis_url=redis_url), port=0)
    port = mon.start()
    try:
        dom = _Rows()
        dom.feed(_dump_dom(browser, f"http://127.0.0.1:{port}/"))
    finally:
        mon.stop()
    assert dom.rendered, "the page's script did not render a snapshot"
    return dom


def test_page_shows_the_hold_the_diagnosis_and_the_faults_in_headless_chromium(redis_url, conn):
    browser = _chromium()
    _seed_trouble(conn)
    dom = _render_page(browser, redis_url)
    assert dom.states == {"B2": "idle", "H": "held"}
    # (seeded with no producer: B2, unfinished, stopped before its end, as after a killed producer)
    assert dom.alerts == [HTML_500, "no producer is running: B2 stopped before the end; `budgetq produce` continues "
                                    "the run",
                          f"held by the producer: H: output_dir: {DISK_FULL}; workers take no new prompts "
                          "until it has room (a stopped producer's hold ends at the next budgetq produce)"]
    assert dom.faults["http://sg:30000"] == "HTTP 500 text/html x4"


def _aligned(dom: _Rows) -> None:
    """Every rendered cell sits as its column's header does (left or right)."""
    for table, head in dom.heads.items():
        for row in dom.aligns.get(table, []):
            if len(row) > 1:  # the header row has no <td>; a one-cell row is the "none" placeholder
                assert row == head, (table, head, row)


def test_page_keeps_people_apart_formats_values_and_keeps_the_budget_in_view_in_headless_chromium(redis_url, conn):
    from budgetq.shared.control import log_action

    browser = _chromium()
    _seed(conn)   # B2: 100 tokens used of 10k, just registered
    log_action(conn, "budget_set", "B2", 282204, 300_000)
    for i in range(20):
        log_action(conn, "budget_deadline", "B2", 9_000 + i, 9_500 + i, actor="producer (deadline pacing)")
    # hidden states on disk against B2's disk budget (shared/features_bytes.py)
    conn.hset(keys.features_bytes_key("B2"), mapping={"written": 1_840_000_000, "tokens": 32_000,
                                                      "share": 4_500_000_000, "stop": ""})
    dom = _render_page(browser, redis_url)
    assert [r for r in dom.cells["features"] if r] == [["B2", "1.84 GB", "4.50 GB", "40.9%", "32,000", "capturing"]]
    (person,) = [r for r in dom.cells["control"] if r]
    assert person[2:] == ["budget_set", "B2", "282.20k", "300.00k"] and "@" in person[1], person
    auto = [r for r in dom.cells["control-auto"] if r]
    assert len(auto) == 5 and {r[1] for r in auto} == {"producer (deadline pacing)"}, auto
    assert auto[0][4:] == ["9.02k", "9.52k"], auto
    _aligned(dom)
    # a budget 100x what is used: still in view, as a stub at the top edge (the legend says so)
    assert dom.budgets["B2"]["data-offscale"] == "1" and float(dom.budgets["B2"]["y1"]) <= 8, dom.budgets
    # a run that just started: the chart spans it, not the 10-minute window
    assert 20 <= int(dom.chart["data-span-s"]) <= 60, dom.chart


def test_page_renders_a_live_run_in_headless_chromium(tmp_path, redis_url, conn, sim_factory):
    browser = _chromium()
    sim = sim_factory("--speedup", "200", "--seed", "2", "--length-mean", "150")
    cfg = write_config(tmp_path, redis_url, sim, three_datasets(tmp_path), **LIVE)
    live = live_run(cfg, tmp_path)
    assert live.producer.returncode == 0, live.producer.stderr
    port = free_port()
    mon = subprocess.Popen([*CLI, "--log-level", "WARNING", "monitor", "-c", str(cfg), "--port", str(port)],
                           cwd=ROOT)
    try:
        wait_http(f"http://127.0.0.1:{port}/healthz")
        with tempfile.TemporaryDirectory() as profile:
            out = subprocess.run(
                [browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--no-first-run", f"--user-data-dir={profile}", "--virtual-time-budget=8000", "--dump-dom",
                 f"http://127.0.0.1:{port}/"], capture_output=True, text=True, timeout=120)
    finally:
        mon.terminate()
        mon.wait(10)
    assert out.returncode == 0, out.stderr[-2000:]
    dom = _Rows()
    dom.feed(out.stdout)
    assert dom.rendered, "the page's script did not render a snapshot"
    assert set(dom.datasets) == {"A1", "B2", "C1"}
    for name, row in dom.datasets.items():
        used = int(conn.get(keys.used_key(name)))
        assert used > 0 and int(row["data-used"]) == used
        assert int(row["data-committed"]) == len(rows(live.out / f"{name}.jsonl"))
    assert int(dom.datasets["A1"]["data-budget"]) == 6000
    assert dom.lines == {"A1", "B2", "C1"}  # one chart line per dataset
    # why each stopped (shared/ends.py): A1 and B2 at their budgets, C1's 25 prompts ran out first
    assert {n: dom.cells[(n, "stop")] for n in ("A1", "B2", "C1")} == {
        "A1": "budget reached", "B2": "budget reached", "C1": "out of prompts"}
    assert dom.cells[("C1", "unread")] == "0" and int(dom.cells[("A1", "unread")]) > 0
    # the chart spans the run (seconds), not the 10-minute window; every budget is in view
    assert int(dom.chart["data-span-s"]) < 300, dom.chart
    assert set(dom.budgets) == {"A1", "B2", "C1"}
    assert all(0 <= float(b["y1"]) <= 240 for b in dom.budgets.values()), dom.budgets
    assert dom.budgets["A1"]["data-offscale"] == "0"  # used reached it: on the scale
    _aligned(dom)
