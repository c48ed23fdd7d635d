"""The report's plots: matplotlib figures, each returned as an SVG string the page inlines.

Why matplotlib and SVG: the report must open in any browser with no network, years later.
Inline SVG needs no JavaScript and nothing loaded (plotly's page would carry ~3.5 MB of its own
JS per file); matplotlib is the most widely kept plotting library in Python, its Agg/SVG
backends need no display, and SVG text stays text (fonttype none), so the files stay small and
the numbers in the plots can be searched. Imported only by `budgetq report` and produce's end.
"""

from __future__ import annotations

import datetime as dt
import io
import threading
from typing import TYPE_CHECKING, Any

import matplotlib

matplotlib.use("Agg")   # no display, ever (a producer host has none)

import matplotlib.pyplot as plt  # noqa: E402

if TYPE_CHECKING:
    from budgetq.producer.ops.report_data import DsReport, RunData

plt.rcParams.update({"svg.fonttype": "none", "svg.hashsalt": "budgetq", "font.size": 9,
                     "axes.spines.top": False, "axes.spines.right": False})
COLORS = plt.rcParams["axes.prop_cycle"].by_key()["color"]
# pyplot keeps global state: one report drawn at a time in a process (the monitor's /report runs
# in a thread beside the producer's own report at its end).
LOCK = threading.Lock()


def _svg(fig: Any) -> str:
    buf = io.StringIO()
    fig.savefig(buf, format="svg", bbox_inches="tight", metadata={"Date": None})
    plt.close(fig)
    text = buf.getvalue()
    return text[text.index("<svg"):]   # inline: no XML prolog or doctype


def _time_axis(ax: Any, t0: float) -> None:
    ax.set_xlabel(f"time since {dt.datetime.fromtimestamp(t0, dt.UTC):%Y-%m-%d %H:%M:%S} UTC")
    ax.xaxis.set_major_formatter(plt.FuncFormatter(lambda x, _p: _hms(x)))


def _hms(s: float) -> str:
    s = int(s)
    return f"{s // 3600}h{s % 3600 // 60:02d}" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def _tokens(x: float, _p: Any = None) -> str:
    for div, unit in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= div:
            return f"{x / div:g}{unit}"
    return f"{x:g}"


# Up to this many events are named on the plots; past it, numbered as in the report's events table.
NAMED_MARKS = 8


def _marks(ax: Any, run: RunData, t0: float, labels: bool) -> None:
    marks = run.marks()
    for i, (t, what) in enumerate(marks, 1):
        if t < t0:
            continue   # before the run's first start (a Redis's older entries): in the table only
        ax.axvline(t - t0, color="0.55", lw=0.8, ls=":")
        if labels:
            ax.annotate(what if len(marks) <= NAMED_MARKS else str(i), (t - t0, 1.0),
                        xycoords=("data", "axes fraction"), rotation=90 if len(marks) <= NAMED_MARKS else 0,
                        fontsize=7, va="top", ha="right", color="0.35")


def _no_data(text: str, w: float = 6, h: float = 1.2) -> str:
    fig, ax = plt.subplots(figsize=(w, h))
    ax.axis("off")
    ax.text(0.5, 0.5, text, ha="center", va="center", color="0.4")
    return _svg(fig)


def _t0(run: RunData) -> float | None:
    ts = [s["t"] for s in run.samples]
    return min(ts) if ts else None


def tokens_over_time(run: RunData, deadline: float | None) -> str:
    """One panel per dataset: tokens kept against its budget, the deadline, the run's events."""
    t0 = _t0(run)
    if t0 is None:
        return _no_data("no run log (run-log.jsonl): written by `budgetq produce`; nothing over time to draw")
    n = len(run.datasets)
    fig, axes = plt.subplots(n, 1, figsize=(8, 1.9 * n + 0.4), sharex=True, squeeze=False)
    for i, (ax, d) in enumerate(zip(axes[:, 0], run.datasets, strict=True)):
        ts = [t - t0 for t, _u, _b in d.timeline]
        ax.plot(ts, [u for _t, u, _b in d.timeline], color=COLORS[i % len(COLORS)], lw=1.6, label="kept (used)")
        ax.step(ts, [b for _t, _u, b in d.timeline], where="post", color="k", lw=0.9, ls="--", label="budget")
        if deadline is not None:
            ax.axvline(deadline - t0, color="C3", lw=1.2, label="deadline")
        _marks(ax, run, t0, labels=i == 0)
        ax.set_ylabel(d.name)
        ax.yaxis.set_major_formatter(plt.FuncFormatter(_tokens))
        ax.set_ylim(bottom=0)
        if i == 0:
            ax.legend(loc="lower right", fontsize=7, frameon=False)
    _time_axis(axes[-1, 0], t0)
    return _svg(fig)


def fleet_rate(run: RunData) -> str:
    t0 = _t0(run)
    rate = run.fleet_rate()
    if t0 is None or not rate:
        return _no_data("no run log samples: no fleet rate to draw")
    # a few samples' moving mean: single samples half a second apart are mostly noise
    k = max(1, len(rate) // 100)
    ts = [t - t0 for t, _r, _w in rate]
    smooth = [sum(r for _t, r, _w in rate[max(0, j - k):j + 1]) / len(rate[max(0, j - k):j + 1])
              for j in range(len(rate))]
    fig, ax = plt.subplots(figsize=(8, 2.4))
    ax.plot(ts, smooth, color="C0", lw=1.4, label="tok/s (counted)")
    ax.yaxis.set_major_formatter(plt.FuncFormatter(_tokens))
    ax.set_ylabel("tok/s")
    ax.set_ylim(bottom=0)
    w = ax.twinx()
    w.step(ts, [wk for _t, _r, wk in rate], where="post", color="C2", lw=1.0, label="live workers")
    w.set_ylabel("workers")
    w.set_ylim(bottom=0)
    w.spines["right"].set_visible(True)
    _marks(ax, run, t0, labels=True)
    _time_axis(ax, t0)
    fig.legend(loc="lower center", bbox_to_anchor=(0.5, 0.98), ncol=2, fontsize=7, frameon=False)
    return _svg(fig)


def histogram(d: DsReport) -> str:
    edges, counts = d.histogram()
    if not d.answers:
        return _no_data(f"{d.name}: no answers yet", w=4, h=1)
    fig, ax = plt.subplots(figsize=(4.2, 2.4))
    ax.stairs(counts, edges, fill=True, color="C0", alpha=0.75)
    if d.prior_mean:
        ax.axvline(d.prior_mean, color="C1", lw=1.2, ls="--", label=f"prior_mean_tokens {d.prior_mean:,}")
    if d.mean is not None:
        ax.axvline(d.mean, color="C2", lw=1.4, label=f"measured mean {d.mean:,.0f}")
    ax.axvline(d.max_tokens, color="C3", lw=1.4, label=f"max_tokens {d.max_tokens:,}")
    ax.set_title(f"{d.name}: {d.answers:,} answers, {100 * (d.cut_share or 0):.1f}% cut by max_tokens", fontsize=9)
    ax.set_xlabel("completion tokens")
    ax.set_ylabel("answers")
    ax.legend(fontsize=7, frameon=False)
    return _svg(fig)


def _bars(names: list[str], series: list[tuple[str, list[float]]], ylabel: str, fmt: Any = None,
          h: float = 2.4) -> str:
    fig, ax = plt.subplots(figsize=(max(4.0, 1.1 * len(names) + 2), h))
    width = 0.8 / max(1, len(series))
    for j, (label, values) in enumerate(series):
        xs = [i + (j - (len(series) - 1) / 2) * width for i in range(len(names))]
        ax.bar(xs, values, width, label=label, color=COLORS[j % len(COLORS)])
    ax.set_xticks(range(len(names)), names)
    ax.set_ylabel(ylabel)
    if fmt is not None:
        ax.yaxis.set_major_formatter(plt.FuncFormatter(fmt))
    ax.legend(fontsize=7, frameon=False)
    return _svg(fig)


def latency(run: RunData, quantiles: dict[str, dict[str, float] | None]) -> str:
    names = [d.name for d in run.datasets]
    if not any(quantiles.values()):
        return _no_data("no latencies in the rows")
    return _bars(names, [(q, [(quantiles[n] or {}).get(q, 0.0) for n in names]) for q in ("p50", "p95", "p99")],
                 "request latency (s)")


def shares(names: list[str], kept: list[float], target: list[float], target_label: str) -> str:
    return _bars(names, [("kept share", kept), (target_label, target)], "share of tokens",
                 fmt=lambda x, _p: f"{100 * x:.0f}%")


def ledger(names: list[str], states: list[str], values: dict[str, list[int]]) -> str:
    fig, ax = plt.subplots(figsize=(8, 0.5 * len(names) + 1.2))
    left = [0] * len(names)
    for j, s in enumerate(states):
        vals = values[s]
        if not any(vals):
            continue
        ax.barh(names, vals, left=left, label=s, color=COLORS[j % len(COLORS)])
        left = [a + b for a, b in zip(left, vals, strict=True)]
    ax.invert_yaxis()
    ax.set_xlabel("prompts (rows of the dataset's file)")
    ax.legend(fontsize=7, frameon=False, ncol=min(6, len(states)), loc="lower center", bbox_to_anchor=(0.5, 1.0))
    return _svg(fig)


def discarded(rows: list[tuple[str, str, int]]) -> str:
    """Prompts discarded, by (dataset, reason): drawn only where the ledger records them."""
    labels = [f"{ds}: {reason}" for ds, reason, _n in rows]
    fig, ax = plt.subplots(figsize=(7, 0.4 * len(rows) + 1))
    ax.barh(labels, [n for _d, _r, n in rows], color="C3")
    ax.invert_yaxis()
    ax.set_xlabel("discarded prompts")
    return _svg(fig)
