"""Rich rendering of a status snapshot, for ``budgetq status`` and ``status --watch``."""

from __future__ import annotations

import re
import time
from typing import Any, Literal

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from budgetq.shared import server_kind
from budgetq.shared.control import TOKEN_ACTIONS
from budgetq.shared.status import format_duration, format_eta
from budgetq.shared.tokens import format_tokens

BAR_WIDTH = 12
# What tells `running` from `in flight`, under every table that shows both (docs/operations.md).
RUNNING_VS_IN_FLIGHT = ("running: prompts claimed by a worker (waiting for a server slot, at a server, or being "
                        "committed); in flight: requests admitted by the budget and sent to a server")
_STATE_STYLE = {"held": "bold red", "paused": "yellow", "done": "green", "draining": "magenta", "running": "cyan",
                "idle": "dim"}


def text_bar(pct: float | None, width: int = BAR_WIDTH) -> Text:
    pct = pct or 0.0
    filled = min(width, int(round(width * min(pct, 100.0) / 100.0)))
    style = "dark_orange" if pct > 100 else "blue"
    bar = Text("█" * filled, style=style)
    bar.append("░" * (width - filled), style="grey50")
    bar.append(f" {pct:6.2f}%")
    return bar


def _clock(ts: float | None) -> str:
    return time.strftime("%H:%M:%S", time.localtime(ts)) if ts else "-"


def datasets_table(snap: dict[str, Any]) -> Table:
    t = Table(title="datasets", title_justify="left", expand=False, caption=RUNNING_VS_IN_FLIGHT,
              caption_justify="left")
    columns: tuple[tuple[str, Literal["left", "right"]], ...] = (
        ("dataset", "left"), ("state", "left"), ("used / budget", "left"), ("used", "right"), ("budget", "right"),
        ("in flight", "right"), ("queued", "right"), ("running", "right"), ("rows", "right"), ("discarded", "right"),
        ("skipped", "right"),
        ("failed", "right"), ("unread", "right"), ("invalid", "right"), ("ledger", "left"), ("tok/s", "right"),
        ("ETA", "right"), ("stop", "left"))
    for col, just in columns:
        t.add_column(col, justify=just, no_wrap=True)
    for d in snap["datasets"]:
        led = d["ledger"]
        t.add_row(d["dataset"], Text(d["state"], style=_STATE_STYLE.get(d["state"], "")), text_bar(d["used_pct"]),
                  f"{d['used']:,}", format_tokens(d["budget"]), f"{d['in_flight']:,}", f"{led['queued']:,}",
                  f"{led['running']:,}", f"{led['rows'] + led['truncated']:,}", f"{led.get('discarded', 0):,}",
                  f"{led['skipped']:,}", f"{led['failed']:,}", unread_cell(led), f"{led['invalid']:,}",
                  ledger_cell(led), "-" if d["tok_s"] is None else f"{d['tok_s']:,.0f}",
                  format_eta(d["eta_s"], d.get("eta_by")), d.get("stop", "-"))
    if not snap["datasets"]:
        t.add_row("(no dataset registered)", *[""] * (len(columns) - 1))
    return t


def reasons_cell(by_reason: dict[str, dict[str, int]] | None) -> str:
    """``loop 3 (41,200), empty 1 (0)``: discarded answers and their tokens, by reason."""
    if not by_reason:
        return "-"
    return ", ".join(f"{r} {v['answers']:,} ({v['tokens']:,})" for r, v in by_reason.items())


def tokens_table(snap: dict[str, Any]) -> Table:
    """Spent (every token the servers generated) beside kept (the rows' tokens), and where the rest
    went: truncated, discarded by reason, wasted (aborted or rejected). ``budget counts`` says which
    of spent and kept the dataset's budget bounds (docs/budget.md "Spent and kept")."""
    t = Table(title="tokens: spent and kept", title_justify="left", expand=False)
    for col in ("dataset", "budget counts", "spent", "kept", "kept/spent", "truncated", "discarded", "wasted",
                "discarded by reason: answers (tokens)"):
        t.add_column(col, justify="left" if col in ("dataset", "budget counts") or col.startswith("discarded by")
                     else "right", no_wrap=True)
    for d in snap["datasets"]:
        tok = d.get("tokens", {})
        spent, kept = tok.get("spent", tok.get("generated", 0)), tok.get("kept", 0)
        t.add_row(d["dataset"], d.get("budget_counts", "kept"), f"{spent:,}", f"{kept:,}",
                  f"{kept / spent:.3f}" if spent else "-", f"{tok.get('truncated', 0):,}",
                  f"{tok.get('discarded', 0):,}", f"{tok.get('wasted', 0):,}",
                  reasons_cell(d.get("discarded_by_reason")))
    return t


def hold_lines(snap: dict[str, Any]) -> list[Text]:
    """One line per hold reason under the datasets table: a held dataset's workers sit idle, and
    ``resume`` does not help; the reason says what to fix."""
    by_reason: dict[str, list[str]] = {}
    for d in snap["datasets"]:
        if d.get("hold"):
            by_reason.setdefault(d["hold"], []).append(d["dataset"])
    return [Text(f"held by the producer: {', '.join(names)}: output_dir: {reason}; workers take no new prompts "
                 "until it has room (a stopped producer's hold ends at the next `budgetq produce`)", style="red")
            for reason, names in by_reason.items()]


def unread_cell(led: dict[str, Any]) -> str:
    """Rows of the file not read: ``~`` before an estimate, ``?`` while the file's size is unknown."""
    n = led.get("unread")
    if n is None:
        return "?"
    return f"~{n:,}" if led.get("unread_estimated") else f"{n:,}"


def ledger_cell(led: dict[str, Any]) -> Text:
    """``ok 1,234`` when every prompt that entered is in one state; what is missing (or counted
    twice) otherwise."""
    if led["unaccounted"] is None:
        return Text("-", style="dim")  # the dataset's Redis state predates the ledger
    if led["balanced"]:
        return Text(f"ok {led['entered']:,}", style="green")
    n = led["unaccounted"]
    what = f"{n:,} unaccounted" if n > 0 else f"{-n:,} counted twice"
    return Text(f"{what} of {led['entered']:,}", style="red")


def summary_table(rows: list[dict[str, Any]]) -> Table:
    """The final summary of ``budgetq produce``: where every row of each dataset's file is (the
    ledger's states as ``status`` shows them, then the rows never enqueued: invalid, filtered,
    unread), what happened on the way, and why it stopped. Optional columns appear when not zero."""
    optional = [c for c in ("truncated", "discarded", "running") if any(r.get(c) for r in rows)]
    table = Table(title="budgetq summary", caption=RUNNING_VS_IN_FLIGHT if "running" in optional else None,
                  caption_justify="left")
    unbalanced = any(r["unaccounted"] for r in rows)  # 0 or None (state older than the ledger): hidden
    # Where every row of the file is: the ledger's states, then rows never enqueued (invalid, counting
    # repeated ids too as check does: producer/reading/tally.py; filtered; unread); they add up to
    # "file rows". Then what happened on the way (aborted requests went back to the queue: an event count, not a state).
    cols = ["dataset", "budget", "used", "used/budget", "rows", *optional, "skipped", "failed", "queued",
            "unread", "invalid", "of them duplicate ids", "filtered", "file rows",
            *(["unaccounted"] if unbalanced else []),
            "aborted (requeued)", "wasted", "spent", "kept", "discarded by reason: answers (tokens)", "stop"]
    for col in cols:
        left = col in ("dataset", "stop") or col.startswith("discarded by")
        table.add_column(col, justify="left" if left else "right")
    for r in rows:
        ratio = f"{r['used'] / r['budget']:.4f}" if r["budget"] else "-"
        source = r.get("source_rows")
        cells = [r["dataset"], format_tokens(r["budget"]), f"{r['used']:,}", ratio, f"{r['rows']:,}",
                 *(f"{r[c]:,}" for c in optional), f"{r['skipped']:,}", f"{r['failed']:,}", f"{r['queued']:,}",
                 unread_cell(r), f"{r['invalid']:,}", f"{r['duplicate_ids']:,}", f"{r['filtered']:,}",
                 "?" if source is None else ("~" if r.get("unread_estimated") else "") + f"{source:,}",
                 *([f"{r['unaccounted']:,}" if r["unaccounted"] is not None else "-"] if unbalanced else []),
                 f"{r['aborted']:,}", f"{r['wasted_tokens']:,}", f"{r.get('spent_tokens', 0):,}",
                 f"{r.get('kept_tokens', 0):,}", reasons_cell(r.get("discarded_by_reason")), r["stop"]]
        table.add_row(*cells)
    return table


def _latency(q: dict[str, Any] | None, name: str) -> str:
    return "-" if q is None else f"{q[name]:.2f} s"


def end_of_run_table(report: dict[str, Any]) -> Table:
    """`budgetq produce`'s end-of-run block: elapsed, tokens and mean tok/s of this run, request
    latency p50/p95/p99 (each row's latency_s), measured mean response length next to the prior."""
    table = Table(title=f"end of run: {format_duration(report['elapsed_s'])} elapsed", title_justify="left")
    for col in ("dataset", "rows written", "tokens", "mean tok/s", "latency p50", "p95", "p99",
                "mean response (tokens)", "prior_mean_tokens"):
        table.add_column(col, justify="left" if col == "dataset" else "right")
    for r in report["datasets"]:
        mean = r.get("mean_response_tokens")
        table.add_row(r["dataset"], f"{r['rows_written']:,}", f"{r['tokens_this_run']:,}", f"{r['tok_s']:,.0f}",
                      *(_latency(r["latency_s"], q) for q in ("p50", "p95", "p99")),
                      "-" if mean is None else f"{mean:,.0f}", f"{r['prior_mean_tokens']:,}")
    table.add_row("all", f"{report['rows_written']:,}", f"{report['tokens']:,}", f"{report['tok_s']:,.0f}",
                  *(_latency(report["latency_s"], q) for q in ("p50", "p95", "p99")), "", "", style="bold")
    return table


def workers_table(snap: dict[str, Any]) -> Table:
    t = Table(title="workers", title_justify="left")
    for col in ("worker", "host", "pid", "up", "in flight", "concurrency", "processed"):
        t.add_column(col, justify="left" if col in ("worker", "host") else "right", no_wrap=True)
    for w in snap["workers"]:
        t.add_row(w["name"], w["host"] or "-", str(w["pid"] or "-"), format_duration(w["uptime_s"]),
                  f"{w['in_flight']:,}", f"{w['concurrency']:,}", f"{w['processed']:,}")
    if not snap["workers"]:
        t.add_row("(no live worker)", *[""] * 6)
    return t


def endpoints_table(snap: dict[str, Any]) -> Table:
    t = Table(title="endpoints", title_justify="left")
    for col in ("endpoint", "server", "health", "in flight", "failures", "healthy / workers", "prompt cached",
                "running / waiting", "KV cache"):
        t.add_column(col, justify="left" if col in ("endpoint", "server", "health") else "right", no_wrap=True)
    for e in snap["endpoints"]:
        health = (Text("unknown", style="dim") if e["healthy"] is None
                  else Text("healthy", style="green") if e["healthy"] else Text("down", style="red"))
        prompt = e.get("prompt_tokens", 0)
        cached = f"{e.get('cached_tokens', 0) / prompt:.0%}" if prompt else "-"   # share of prompt tokens
        load = e.get("load") or {}   # the server's own numbers, as a worker last read them
        queue = f"{load['running']:,} / {load['waiting']:,}" if load.get("running") is not None else "-"
        kv = f"{load['kv_cache_use']:.0%}" if load.get("kv_cache_use") is not None else "-"
        t.add_row(e["url"], server_label(e), health, f"{e['in_flight']:,}", f"{e['failures']:,}",
                  f"{e['healthy_workers']} / {e['workers']}", cached, queue, kv)
    if not snap["endpoints"]:
        t.add_row("(none reported)", *[""] * 8)
    return t


def server_label(e: dict[str, Any]) -> str:
    """``vLLM smollm2``: the server's kind and the model its requests name (``-`` until a worker asked)."""
    if e.get("kind") is None:
        return "-"
    label = server_kind.LABELS.get(e["kind"], e["kind"])
    return f"{label} {e['model']}" if e.get("model") else label


def control_value(action: str | None, value: str | None) -> str:
    """An old or new value of the control log as budgets are shown everywhere: ``282.20k``, not
    ``282204`` (a suffix such as `` (config)`` is kept)."""
    if not value:
        return "-"
    if action in TOKEN_ACTIONS and (m := re.fullmatch(r"(-?\d+)(.*)", value, re.S)):
        return format_tokens(int(m[1])) + m[2]
    return value


def control_table(snap: dict[str, Any], auto: bool = False) -> Table:
    """People's actions; ``auto``: the producer's automatic budget moves, apart (a run's pace
    steps never push a person's action off the screen)."""
    title = "automatic budget moves (the producer's)" if auto else "recent operator actions"
    t = Table(title=title, title_justify="left")
    for col in ("time", "who", "action", "dataset", "old", "new"):
        t.add_column(col, no_wrap=True, justify="right" if col in ("old", "new") else "left")
    for c in snap["control_auto" if auto else "control"]:
        t.add_row(_clock(c["ts"]), c["who"] or "-", c["action"] or "-", c["dataset"] or "-",
                  control_value(c["action"], c["old"]), control_value(c["action"], c["new"]))
    return t


def render(snap: dict[str, Any]) -> RenderableType:
    tot = snap["totals"]
    head = Text.assemble(
        ("budgetq status", "bold"), f"  redis {snap['redis']}{' (TLS)' if snap['redis_tls'] else ''}",
        f"  at {_clock(snap['generated_at'])}",
        f"  used {format_tokens(tot['used'])} / {format_tokens(tot['budget'])}",
        f"  {tot['tok_s']:,.0f} tok/s  in flight {tot['in_flight']:,}",
        f"  workers {tot['workers']} ({tot['worker_slots']:,} slots)")
    parts: list[RenderableType] = [head, datasets_table(snap), tokens_table(snap), *hold_lines(snap),
                                   workers_table(snap), endpoints_table(snap)]
    stall = snap.get("stall")
    if stall and stall != snap.get("diagnosis"):  # no worker for the queued prompts (shared/server_faults.py)
        parts.insert(1, Text(stall, style="bold red"))
    if snap.get("producer_absent"):  # stopped, or killed without a word (shared/presence.py)
        parts.insert(1, Text(snap["producer_absent"], style="bold red"))
    if snap.get("diagnosis"):  # why the servers fail, in one line (shared/server_faults.py)
        parts.insert(1, Text(snap["diagnosis"], style="bold red"))
    if snap.get("plan"):  # a deadline or a total: countdown and projected finish (budgetq/cli/plan.py)
        from budgetq.cli.plan import plan_text

        parts.insert(1, plan_text(snap["plan"], snap["generated_at"]))
    if snap["control"]:
        parts.append(control_table(snap))
    if snap.get("control_auto"):
        parts.append(control_table(snap, auto=True))
    return Group(*parts)
