"""`budgetq report`: the run in pictures, one self-contained HTML file (docs/operations.md, "The run report").

Data from producer/ops/report_data.py (the output directory, Redis when it is there), plots from
producer/ops/report_plots.py (matplotlib, inline SVG), the page from producer/ops/report_html.py.
`produce` writes it at its end; `budgetq report` writes it any time, a run still going included.
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path
from typing import Any

import redis

from budgetq.producer.ops import report_html as h
from budgetq.producer.ops.report_data import DsReport, RunData, gather
from budgetq.shared.config import Config
from budgetq.shared.ledger import STATES

REPORT_FILE = "report.html"
NEVER_ENQUEUED = ("invalid", "filtered", "unread")
QUANTILES = (("p50", 0.50), ("p95", 0.95), ("p99", 0.99))


def default_path(cfg: Config) -> Path:
    return Path(cfg.output_dir) / REPORT_FILE


def quantiles(values: list[float]) -> dict[str, float] | None:
    """Nearest rank, as produce's end-of-run block computes them (producer/run/run_report.py)."""
    if not values:
        return None
    xs = sorted(values)
    return {name: xs[min(len(xs) - 1, max(0, math.ceil(q * len(xs)) - 1))] for name, q in QUANTILES}


def _shares(run: RunData) -> tuple[list[float], list[float], str]:
    """(kept share, target share, what the target is) per dataset: the kept share is of the tokens
    counted in the rows; the target is the weights when a total or deadline splits by weight,
    else the budgets."""
    kept = [d.kept.counted for d in run.datasets]
    total = sum(kept)
    if run.managed:
        target, label = [d.weight for d in run.datasets], "weighted share"
    else:   # no total or deadline: the budgets say what each dataset was meant to get
        target, label = [float(d.budget or 0) for d in run.datasets], "budget share"
    tsum = sum(target)
    return ([k / total if total else 0.0 for k in kept], [t / tsum if tsum else 0.0 for t in target], label)


def _summary(run: RunData, kept: list[float], target: list[float], label: str) -> str:
    rows: list[tuple[dict[str, Any], list[h.Cell]]] = []
    for d, ks, ts in zip(run.datasets, kept, target, strict=True):
        rows.append(({"ds": d.name}, [
            ("dataset", d.name), ("budget", d.budget), ("used", d.used), ("rows", d.kept.rows),
            ("truncated_rows", d.truncated.rows), ("counted_tokens", d.kept.counted),
            ("completion_tokens", d.kept.completion + d.truncated.completion),
            ("mean", None if d.mean is None else round(d.mean, 1)), ("prior_mean", d.prior_mean),
            ("cut", d.cut), h.share("cut_share", d.cut_share), h.share("kept_share", ks),
            h.share("target_share", ts)]))
    ds = run.datasets
    rows.append(({"ds": "all"}, [
        ("dataset", "all"), ("budget", None), ("used", sum(d.used or 0 for d in ds)),
        ("rows", sum(d.kept.rows for d in ds)), ("truncated_rows", sum(d.truncated.rows for d in ds)),
        ("counted_tokens", sum(d.kept.counted for d in ds)),
        ("completion_tokens", sum(d.kept.completion + d.truncated.completion for d in ds)),
        ("mean", None), ("prior_mean", None), ("cut", sum(d.cut for d in ds)), ("cut_share", None),
        ("kept_share", None), ("target_share", None)]))
    return '<div class="wide">' + h.table(
        "datasets", ["dataset", "budget", "used", "rows", "truncated file", "tokens kept (counted)",
                     "completion tokens", "mean length", "prior_mean_tokens", "cut by max_tokens", "cut share",
                     "kept share", label], rows, {"target": label}) + "</div>" + (
        '<p class="muted">rows: the rows of &lt;dataset&gt;.jsonl; truncated file: of &lt;dataset&gt;.truncated.jsonl '
        "(keep: complete). Mean length, the histograms and the cut share are over both (every answer "
        "generated and kept); the shares are of the tokens counted in the rows.</p>")


def _histograms(run: RunData, plots: Any) -> str:
    out = ['<div class="grid">']
    for d in run.datasets:
        edges, counts = d.histogram()
        rows: list[tuple[dict[str, Any], list[h.Cell]]] = [
            ({"lo": edges[i], "hi": edges[i + 1]}, [("bin", f"{edges[i]:,} - {edges[i + 1] - 1:,}"), ("count", c)])
            for i, c in enumerate(counts) if c]
        out.append(f'<div>{plots.histogram(d)}<details><summary>{h.esc(d.name)}: the counts</summary>'
                   + h.table(f"hist-{d.name}", ["completion tokens", "answers"], rows,
                             {"ds": d.name, "total": sum(counts), "width": edges[1] - edges[0]})
                   + "</details></div>")
    return "".join(out) + "</div>"


def _latency(run: RunData, plots: Any) -> str:
    q = {d.name: quantiles(d.kept.latencies + d.truncated.latencies) for d in run.datasets}
    rows: list[tuple[dict[str, Any], list[h.Cell]]] = [
        ({"ds": d.name}, [("dataset", d.name), *[(k, (q[d.name] or {}).get(k)) for k, _q in QUANTILES],
                          ("answers", len(d.kept.latencies) + len(d.truncated.latencies))]) for d in run.datasets]
    return plots.latency(run, q) + h.table("latency", ["dataset", "p50 (s)", "p95 (s)", "p99 (s)", "answers"],
                                           rows) + (
        '<p class="muted">each row\'s latency_s: from its request\'s send to its answer, over every kept answer '
        "(nearest rank)</p>")


def ledger_states(run: RunData) -> list[str]:
    """The ledger's states (shared/ledger.py STATES, so a state added there shows here), then the
    rows never enqueued; ``discarded`` only where the ledger has it (a run log from before that state has none)."""
    extra = ["discarded"] if "discarded" not in STATES and any(d.discarded for d in run.datasets) else []
    return [*STATES, *extra, *NEVER_ENQUEUED]


def _ledger(run: RunData, plots: Any) -> str:
    have = [d for d in run.datasets if d.ledger]
    if not have:
        return "<p>no ledger: Redis is not reachable and the run log has no sample</p>"
    states = ledger_states(run)

    def value(d: DsReport, s: str) -> int | None:
        v = (d.ledger or {}).get(s)
        if s == "discarded" and isinstance(v, dict):  # a ledger that kept them by reason: its prompts
            return sum(int(n) for n in v.values())
        return int(v) if isinstance(v, int | float) and not isinstance(v, bool) else None

    values = {s: [value(d, s) or 0 for d in have] for s in states}
    rows: list[tuple[dict[str, Any], list[h.Cell]]] = [
        ({"ds": d.name}, [("dataset", d.name), *[(s, value(d, s)) for s in states],
                              ("aborted", value(d, "aborted"))]) for d in have]
    src = "Redis" if run.redis else "the run log's last sample (Redis is not reachable)"
    return (plots.ledger([d.name for d in have], states, values)
            + h.table("ledger", ["dataset", *states, "aborted (requeued)"], rows)
            + f'<p class="muted">from {h.esc(src)}. rows, truncated, skipped, failed: where each prompt that '
            "was enqueued ended; queued, running: not ended yet; invalid, filtered: never enqueued; unread: "
            "rows of the file never read (the budget was reached first). aborted: requests cut in flight, "
            "each back in the queue (so also in one of the states).</p>")


def _waste(run: RunData, plots: Any) -> str:
    rows: list[tuple[dict[str, Any], list[h.Cell]]] = [
        ({"ds": d.name}, [("dataset", d.name), ("wasted_tokens", d.wasted),
                          h.share("wasted_share", d.wasted / d.used if d.wasted is not None and d.used else None),
                          ("invalid", sum(d.invalid.values()))]) for d in run.datasets]
    out = h.table("waste", ["dataset", "wasted tokens (generated, kept by no row)", "of used", "invalid prompts"],
                  rows)
    disc = [(d.name, reason, n) for d in run.datasets for reason, n in (d.discarded or {}).items()]
    if disc:
        out += plots.discarded(disc) + h.table(
            "discarded", ["dataset", "reason", "answers"],
            [({"ds": ds, "reason": r}, [("dataset", ds), ("reason", r), ("answers", n)])
             for ds, r, n in disc])
    else:
        out += ('<p id="discarded-none" class="muted">discarded answers: none (the loop guard and the quality '
                "gates refused no answer; docs/datasets.md \"Guard and gates\")</p>")
    inv: list[tuple[dict[str, Any], list[h.Cell]]] = [
        ({"ds": d.name}, [("dataset", d.name), ("reason", r), ("rows", n)])
        for d in run.datasets for r, n in d.invalid.most_common()]
    if inv:
        out += "<details><summary>invalid prompts by reason</summary>" + h.table(
            "invalid", ["dataset", "reason", "prompts"], inv) + "</details>"
    return out


def _events(run: RunData) -> str:
    marks = run.marks()
    auto = [e for e in run.events if e.get("source") == "auto"]
    rows: list[tuple[dict[str, Any], list[h.Cell]]] = [({}, [("n", i), ("when", t, h.when(t)), ("what", what)])
                                                       for i, (t, what) in enumerate(marks, 1)]
    out = h.table("events", ["#", "when", "what"], rows) if rows else "<p>no events</p>"
    if auto:
        out += (f"<details><summary>{len(auto):,} automatic budget moves (deadline pacing, total split; the "
                "last 200)</summary>" + h.table("auto-moves", ["when", "who", "action", "dataset", "old", "new"], [
                    ({}, [("when", e["t"], h.when(e["t"])), ("who", e.get("who") or ""),
                          ("action", e.get("action") or ""), ("dataset", e.get("dataset") or ""),
                          ("old", e.get("old") or ""), ("new", e.get("new") or "")]) for e in auto[-200:]])
                + "</details>")
    return out


def _next_run(run: RunData) -> str:
    tok_s = run.run_tok_s()
    lines = ["# measured in this run: starting points for the next run's config and `budgetq plan`", "datasets:"]
    rows: list[tuple[dict[str, Any], list[h.Cell]]] = []
    for d in run.datasets:
        mean = None if d.mean is None else round(d.mean)
        ds_rate = run.run_tok_s(d.name)
        lines.append(f"  - name: {d.name}")
        lines.append(f"    prior_mean_tokens: {mean if mean else d.prior_mean}"
                     f"   # measured over {d.answers:,} answers (was {d.prior_mean}); "
                     f"{h.pct(d.cut_share)} cut by max_tokens {d.max_tokens:,}")
        rows.append(({"ds": d.name}, [("dataset", d.name), ("mean", mean), ("prior_mean", d.prior_mean),
                                      ("max_tokens", d.max_tokens), h.share("cut_share", d.cut_share),
                                      ("tok_s", None if ds_rate is None else round(ds_rate, 1))]))
    lines.append(f"# fleet: {'-' if tok_s is None else f'{tok_s:,.0f}'} counted tok/s while a producer ran")
    if tok_s:
        lines.append(f"# budgetq plan -c CONFIG --tok-s {tok_s:.0f}")
    return (f'<pre id="next-run-yaml" data-tok-s="{"" if tok_s is None else round(tok_s, 1)}">'
            + h.esc("\n".join(lines)) + "</pre>"
            + h.table("next-run", ["dataset", "measured mean", "prior_mean_tokens", "max_tokens", "cut by max_tokens",
                                   "tok/s (its share of the fleet's)"], rows))


def render(run: RunData) -> str:
    from budgetq.producer.ops import report_plots as plots  # matplotlib: only when a report is drawn

    kept, target, label = _shares(run)
    deadline = next((s.get("deadline") for s in reversed(run.samples) if s["kind"] == "sample"), None)
    names = [d.name for d in run.datasets]
    no_log = "" if run.run_log else ('<p class="muted">no run-log.jsonl in the output directory (a run of a '
                                     "budgetq before the run report): nothing over time to draw</p>")
    split = "" if run.managed else ('<p class="muted">no total or deadline splits this run by weight: the '
                                    "kept shares are set against the budgets' shares</p>")
    with plots.LOCK:
        sections = [
            ("summary", "Datasets", _summary(run, kept, target, label)),
            ("tokens-over-time", "Tokens kept over time, against budget and deadline",
             no_log + plots.tokens_over_time(run, deadline)
             + f'<p class="muted">deadline: {h.esc(h.when(deadline)) if deadline else "none"}; dotted lines: the '
             "events below</p>"),
            ("fleet", "Fleet tok/s and live workers over time", plots.fleet_rate(run)),
            ("lengths", "Response lengths", _histograms(run, plots)),
            ("latency", "Request latency", _latency(run, plots)),
            ("shares", f"Kept share vs {label}", split + plots.shares(names, kept, target, label)),
            ("ledger", "Where every prompt ended (the ledger)", _ledger(run, plots)),
            ("waste", "Waste and discarded answers", _waste(run, plots)),
            ("events", "Events", _events(run)),
            ("next-run", "Next run: plan inputs", _next_run(run)),
        ]
    title = f"budgetq run report: {run.out_dir.resolve()}"
    return h.page(title, run.state, run.state_line, sections, time.time())


def write_report(cfg: Config, conn: redis.Redis | None, path: Path | None = None) -> tuple[Path, RunData]:
    """Gather, render and write the report (to a temporary file renamed over the old one, so a
    reader never opens half a page)."""
    run = gather(cfg, conn)
    page = render(run)
    path = Path(path) if path is not None else default_path(cfg)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")   # produce's end and a `budgetq report` may overlap
    try:
        tmp.write_text(page, encoding="utf-8")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)   # (gone once replaced) a full disk leaves no half page behind
    return path, run
