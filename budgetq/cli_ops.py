"""``budgetq status`` and ``budgetq monitor``: what operators watch.

Both read one snapshot (shared.status.snapshot); the JSON printed by ``status --json`` is the
same object the monitor serves at /api/status (schema in docs/operations.md).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from budgetq.cli_common import load, with_config
from shared.config import Config
from shared.errors import BudgetqError


def _server_urls(cfg: Config) -> list[str]:
    # Configured URLs are listed even before a worker reports them, but only if someone set
    # them: the built-in default would show a server nobody runs.
    return cfg.server.urls if "server" in cfg.model_fields_set else []


def _snapshot(cfg: Config, conn, history_s: int = 60) -> dict:
    import redis

    from shared.logs import redact_url
    from shared.status import snapshot

    try:
        return snapshot(conn, cfg.redis_url, _server_urls(cfg), history_s=history_s)
    except redis.RedisError as exc:
        raise BudgetqError(f"cannot read status from {redact_url(cfg.redis_url)}: {exc}") from None


def cmd_status(args: argparse.Namespace) -> int:
    import redis
    from rich.console import Console

    from budgetq.status_view import render
    from shared.logs import register_config_secrets

    cfg = load(args)
    register_config_secrets(cfg)
    conn = redis.Redis.from_url(cfg.redis_url)
    if not args.watch:
        snap = _snapshot(cfg, conn, args.history_s)
        if args.json:
            print(json.dumps(snap, indent=2))
        else:
            Console(width=None if sys.stdout.isatty() else 160).print(render(snap))
        return 0
    if args.json:  # one compact JSON object per line, for piping into jq or a log shipper
        try:
            while True:
                print(json.dumps(_snapshot(cfg, conn, args.history_s), separators=(",", ":")), flush=True)
                time.sleep(args.interval)
        except (KeyboardInterrupt, BrokenPipeError):
            return 0
    return _watch(cfg, conn, args.interval, render, Console())


def _watch(cfg: Config, conn, interval: float, render, console) -> int:
    from rich.live import Live
    from rich.text import Text

    def frame():
        try:
            return render(_snapshot(cfg, conn))
        except BudgetqError as exc:  # Redis restarting: keep watching, say so
            return Text(f"{time.strftime('%H:%M:%S')} {exc} (retrying)", style="red")

    try:
        with Live(frame(), console=console, auto_refresh=False, screen=False) as live:
            while True:
                time.sleep(interval)
                live.update(frame(), refresh=True)
    except KeyboardInterrupt:
        return 0


def cmd_monitor(args: argparse.Namespace) -> int:
    import asyncio

    from producer.monitor import check_bind, serve_forever

    cfg = load(args)
    check_bind(cfg.monitor, args.host or cfg.monitor.host, args.allow_unauthenticated)
    try:
        asyncio.run(serve_forever(cfg, args.host, args.port, args.allow_unauthenticated))
    except KeyboardInterrupt:
        pass
    return 0


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0: {text!r}")
    return value


def register(sub: argparse._SubParsersAction) -> None:
    sp = with_config(sub.add_parser("status", help="per-dataset budget, progress, workers and endpoints"))
    sp.add_argument("--json", action="store_true", help="the stable JSON snapshot (docs/operations.md)")
    sp.add_argument("--watch", action="store_true", help="redraw live (with --json: one JSON object per line)")
    sp.add_argument("--interval", type=_positive, default=1.0, help="seconds between --watch refreshes")
    sp.add_argument("--history-s", type=int, default=60, choices=range(0, 3601), metavar="0..3600",
                    help="seconds of 5 s token buckets in each dataset's history (--json)")
    sp.set_defaults(func=cmd_status)
    sp = with_config(sub.add_parser("monitor", help="web monitor: live page, /api/status, /metrics"))
    sp.add_argument("--host", help="overrides monitor.host (default 127.0.0.1)")
    sp.add_argument("--port", type=int, help="overrides monitor.port (default 9200)")
    sp.add_argument("--allow-unauthenticated", action="store_true",
                    help="serve on a non-loopback host without basic auth (only behind another access control, "
                         "e.g. a port published on 127.0.0.1)")
    sp.set_defaults(func=cmd_monitor)
