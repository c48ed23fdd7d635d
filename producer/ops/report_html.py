"""The report's page: one HTML file, the plots inlined as SVG, every number the plots draw also
written as text in tables whose cells carry data-* attributes (tests read them back from the DOM,
and a reader can copy them). No script, no stylesheet or font from anywhere else.
"""

from __future__ import annotations

import datetime as dt
import html
from typing import Any

CSS = """
body{font:14px/1.4 system-ui,sans-serif;margin:1.5em auto;max-width:1100px;color:#222;padding:0 1em}
h1{font-size:1.4em;margin:.2em 0}h2{font-size:1.15em;margin-top:1.8em;border-bottom:1px solid #ddd}
#run-state{font-weight:600;padding:.4em .6em;border-radius:4px;background:#eef6ee}
#run-state[data-state=going],#run-state[data-state=no-end]{background:#fff4d6}
#run-state[data-state=stopped]{background:#fde8e8}
table{border-collapse:collapse;margin:.5em 0;font-variant-numeric:tabular-nums;font-size:13px}
.wide{overflow-x:auto}
td,th{padding:2px 8px;border-bottom:1px solid #eee;text-align:right}th{background:#f6f6f6}
td:first-child,th:first-child{text-align:left}.grid{display:flex;flex-wrap:wrap;gap:1em}
.grid>div{flex:0 0 auto}svg{max-width:100%;height:auto}pre{background:#f6f6f6;padding:.6em}
details{margin:.4em 0}.muted{color:#777}
"""


def esc(v: Any) -> str:
    return html.escape(str(v), quote=True)


def fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:,.3f}".rstrip("0").rstrip(".") if abs(v) < 100 else f"{v:,.1f}"
    if isinstance(v, int):
        return f"{v:,}"
    return str(v)


def pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.2f}%"


def when(t: float | None) -> str:
    return "-" if t is None else f"{dt.datetime.fromtimestamp(t, dt.UTC):%Y-%m-%d %H:%M:%S} UTC"


Cell = tuple[str, Any] | tuple[str, Any, str]


def table(tid: str, head: list[str], rows: list[tuple[dict[str, Any], list[Cell]]],
          attrs: dict[str, Any] | None = None) -> str:
    """``rows``: (the row's data-* attributes, its cells). A cell is (key, value) or (key, value,
    text): each <td> carries data-key and data-value, the value unrounded (a share as its fraction),
    so a test or a script reads the numbers the text shows rounded."""
    extra = "".join(f' data-{esc(k)}="{esc(v)}"' for k, v in (attrs or {}).items())
    out = [f'<table id="{esc(tid)}"{extra}><tr>' + "".join(f"<th>{esc(h)}</th>" for h in head) + "</tr>"]
    for row_attrs, cells in rows:
        ra = "".join(f' data-{esc(k)}="{esc(v)}"' for k, v in row_attrs.items())
        tds = []
        for cell in cells:
            key, v = cell[0], cell[1]
            shown = cell[2] if len(cell) == 3 else (v if isinstance(v, str) else fmt(v))
            tds.append(f'<td data-key="{esc(key)}" data-value="{esc("" if v is None else v)}">{esc(shown)}</td>')
        out.append(f"<tr{ra}>{''.join(tds)}</tr>")
    out.append("</table>")
    return "".join(out)


def share(key: str, v: float | None) -> Cell:
    """A share cell: its fraction in data-value, a percentage as text."""
    return (key, v, pct(v))


def page(title: str, state: str, state_line: str, sections: list[tuple[str, str, str]], generated: float) -> str:
    """``sections``: (id, heading, body html). The run's state is the first thing the page says."""
    body = "".join(f'<section id="{esc(sid)}"><h2>{esc(head)}</h2>{content}</section>'
                   for sid, head, content in sections)
    return (f"<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>{esc(title)}</title><style>{CSS}</style></head><body>"
            f'<p id="run-state" data-state="{esc(state)}">{esc(state_line)}</p>'
            f"<h1>{esc(title)}</h1><p class=\"muted\">written {esc(when(generated))} by budgetq report</p>"
            f"{body}</body></html>\n")
