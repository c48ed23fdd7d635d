"""``budgetq status`` and ``budgetq monitor``: what operators watch.

Both read one snapshot (shared.status.snapshot); the JSON printed by ``status --json`` is the
same object the monitor serves at /api/status (schema in docs/operations.md).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from budgetq.cli.common import int_range, load, open_redis, seconds, stdout_console, watch, with_config
from budgetq.shared.config import Config
from budgetq.shared.errors import BudgetqError


def _snapshot(cfg: Config, conn, history_s: int = 60) -> dict:
    import redis

    from budgetq.shared.redis_conn import explain
    from budgetq.shared.status import configured_server_urls, snapshot

    try:
        return snapshot(conn, cfg.redis_url, configured_server_urls(cfg), history_s=history_s)
    except redis.RedisError as exc:
        raise BudgetqError(f"cannot read status: {explain(exc, cfg.redis_url)}") from None


def cmd_status(args: argparse.Namespace) -> int:
    from rich.console import Group, RenderableType

    from budgetq.cli.features import features_table
    from budgetq.cli.status_view import render
    from budgetq.shared.redis_conn import connect

    cfg = load(args)
    conn = open_redis(cfg, "status") if not args.watch else connect(cfg.redis_url)  # --watch keeps retrying

    def view(snap: dict) -> RenderableType:  # + hidden states of capture: features datasets (cli_features.py)
        table = features_table(cfg, conn, snap)
        return render(snap) if table is None else Group(render(snap), table)

    if not args.watch:
        snap = _snapshot(cfg, conn, args.history_s)
        if args.json:
            print(json.dumps(snap, indent=2))
        else:
            stdout_console().print(view(snap))
        return 0
    if args.json:
        return _watch_json(cfg, conn, args.interval, args.history_s)
    return _watch(cfg, conn, args.interval, view, stdout_console())


def _watch_json(cfg: Config, conn, interval: float, history_s: int) -> int:
    """One compact JSON object per line on stdout (for jq or a log shipper); a Redis error is one
    line on stderr and the next try follows, as in the table view."""
    failing = False
    try:
        while True:
            try:
                snap = _snapshot(cfg, conn, history_s)
            except BudgetqError as exc:
                print(f"budgetq: status: {time.strftime('%H:%M:%S')} {exc} (retrying)", file=sys.stderr, flush=True)
                failing = True
            else:
                if failing:
                    print(f"budgetq: status: {time.strftime('%H:%M:%S')} Redis answers again", file=sys.stderr,
                          flush=True)
                    failing = False
                print(json.dumps(snap, separators=(",", ":")), flush=True)
            time.sleep(interval)
    except KeyboardInterrupt:  # SIGINT/SIGTERM; a closed stdout goes on to main() (status 141)
        return 0


def _watch(cfg: Config, conn, interval: float, render, console) -> int:
    from rich.text import Text

    def frame():
        try:
            return render(_snapshot(cfg, conn))
        except BudgetqError as exc:  # Redis restarting: keep watching, say so
            return Text(f"{time.strftime('%H:%M:%S')} {exc} (retrying)", style="red")

    return watch(frame, interval, console)  # off a terminal: each frame printed and flushed (cli_common)


def cmd_monitor(args: argparse.Namespace) -> int:
    import asyncio

    from budgetq.producer.ops.monitor import check_bind, serve_forever

    cfg = load(args)
    check_bind(cfg.monitor, args.host or cfg.monitor.host, args.allow_unauthenticated)
    open_redis(cfg, "monitor", cfg.redis_wait_s)  # then it serves, answering 503 while Redis is away
    try:
        asyncio.run(serve_forever(cfg, args.host, args.port, args.allow_unauthenticated))
    except KeyboardInterrupt:
        pass
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    sp = with_config(sub.add_parser("status", help="per-dataset budget, progress, workers and endpoints"))
    sp.add_argument("--json", action="store_true", help="the stable JSON snapshot (docs/operations.md)")
    sp.add_argument("--watch", action="store_true", help="redraw live (with --json: one JSON object per line)")
    sp.add_argument("--interval", type=seconds(0, strict=True, maximum=86400), default=1.0,
                    help="seconds between --watch refreshes")
    sp.add_argument("--history-s", type=int_range(0, 3600), default=60, metavar="0..3600",
                    help="seconds of 5 s token buckets in each dataset's history (--json)")
    sp.set_defaults(func=cmd_status)
    sp = with_config(sub.add_parser("monitor", help="web monitor: live page, /api/status, /metrics"))
    sp.add_argument("--host", help="overrides monitor.host (default 127.0.0.1)")
    sp.add_argument("--port", type=int_range(0, 65535), help="overrides monitor.port (default 9200)")
    sp.add_argument("--allow-unauthenticated", action="store_true",
                    help="serve on a non-loopback host without basic auth (only behind another access control, "
                         "e.g. a port published on 127.0.0.1)")
    sp.set_defaults(func=cmd_monitor)
