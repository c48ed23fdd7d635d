"""Rich rendering of a status snapshot, for ``budgetq status`` and ``status --watch``."""

from __future__ import annotations

import time
from typing import Any

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from shared.status import format_duration
from shared.tokens import format_tokens

BAR_WIDTH = 20
_STATE_STYLE = {"paused": "yellow", "done": "green", "draining": "magenta", "running": "cyan", "idle": "dim"}


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
    t = Table(title="datasets", title_justify="left", expand=False)
    for col, just in (("dataset", "left"), ("state", "left"), ("used / budget", "left"), ("used", "right"),
                      ("budget", "right"), ("in flight", "right"), ("reserved", "right"), ("queued", "right"),
                      ("committed", "right"), ("skipped", "right"), ("failed", "right"), ("invalid", "right"),
                      ("tok/s", "right"), ("ETA", "right")):
        t.add_column(col, justify=just, no_wrap=True)
    for d in snap["datasets"]:
        c = d["counts"]
        t.add_row(d["dataset"], Text(d["state"], style=_STATE_STYLE.get(d["state"], "")), text_bar(d["used_pct"]),
                  f"{d['used']:,}", format_tokens(d["budget"]), f"{d['in_flight']:,}", f"{d['reserved']:,}",
                  f"{d['queued']:,}", f"{c['committed']:,}", f"{c['skipped']:,}", f"{c['failed']:,}",
                  f"{c['invalid']:,}", f"{d['tok_s']:,.0f}", format_duration(d["eta_s"]))
    if not snap["datasets"]:
        t.add_row("(no dataset registered)", *[""] * 13)
    return t


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
    for col in ("endpoint", "health", "in flight", "failures", "healthy / workers", "prompt cached"):
        t.add_column(col, justify="left" if col in ("endpoint", "health") else "right", no_wrap=True)
    for e in snap["endpoints"]:
        health = (Text("unknown", style="dim") if e["healthy"] is None
                  else Text("healthy", style="green") if e["healthy"] else Text("down", style="red"))
        prompt = e.get("prompt_tokens", 0)
        cached = f"{e.get('cached_tokens', 0) / prompt:.0%}" if prompt else "-"   # share of prompt tokens
        t.add_row(e["url"], health, f"{e['in_flight']:,}", f"{e['failures']:,}",
                  f"{e['healthy_workers']} / {e['workers']}", cached)
    if not snap["endpoints"]:
        t.add_row("(none reported)", "", "", "", "", "")
    return t


def control_table(snap: dict[str, Any]) -> Table:
    t = Table(title="recent operator actions", title_justify="left")
    for col in ("time", "who", "action", "dataset", "old", "new"):
        t.add_column(col, no_wrap=True)
    for c in snap["control"]:
        t.add_row(_clock(c["ts"]), c["who"] or "-", c["action"] or "-", c["dataset"] or "-", c["old"] or "-",
                  c["new"] or "-")
    return t


def render(snap: dict[str, Any]) -> RenderableType:
    tot = snap["totals"]
    head = Text.assemble(
        ("budgetq status", "bold"), f"  redis {snap['redis']}{' (TLS)' if snap['redis_tls'] else ''}",
        f"  at {_clock(snap['generated_at'])}",
        f"  used {format_tokens(tot['used'])} / {format_tokens(tot['budget'])}",
        f"  {tot['tok_s']:,.0f} tok/s  in flight {tot['in_flight']:,}",
        f"  workers {tot['workers']} ({tot['worker_slots']:,} slots)")
    parts: list[RenderableType] = [head, datasets_table(snap), workers_table(snap), endpoints_table(snap)]
    if snap.get("diagnosis"):  # why the servers fail, in one line (shared/server_faults.py)
        parts.insert(1, Text(snap["diagnosis"], style="bold red"))
    if snap.get("plan"):  # a deadline or a total: countdown and projected finish (budgetq/cli_plan.py)
        from budgetq.cli_plan import plan_text

        parts.insert(1, plan_text(snap["plan"], snap["generated_at"]))
    if snap["control"]:
        parts.append(control_table(snap))
    return Group(*parts)
