"""``budgetq`` subcommands. Parses flags, sets up logging, calls library functions.

Each group of subcommands lives in its own module with a ``register(sub)`` function:
cli_run (here: produce, worker, budget control, demo), cli_sim, cli_ops, cli_data.
"""

from __future__ import annotations

import argparse
import asyncio
import sys

from budgetq import cli_data, cli_ops, cli_sim
from budgetq.cli_common import load, with_config
from shared.errors import BudgetqError
from shared.logs import setup_logging
from shared.tokens import format_tokens, parse_tokens


def print_summary(rows: list[dict]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="budgetq summary")
    for col in ("dataset", "budget", "used", "used/budget", "rows", "skipped", "failed", "invalid", "stop"):
        table.add_column(col)
    for r in rows:
        ratio = f"{r['used'] / r['budget']:.4f}" if r["budget"] else "-"
        table.add_row(r["dataset"], format_tokens(r["budget"]), str(r["used"]), ratio, str(r["rows"]),
                      str(r["skipped"]), str(r["failed"]), str(r["invalid"]), r["stop"])
    Console().print(table)


def cmd_produce(args: argparse.Namespace) -> int:
    from producer.run import Producer

    rows = Producer(load(args)).run()
    print_summary(rows)
    return 0


def cmd_worker(args: argparse.Namespace) -> int:
    from worker.runner import ConcurrentWorker

    cfg = load(args)
    grace = args.grace_s if args.grace_s is not None else cfg.worker.grace_s
    w = ConcurrentWorker(cfg, args.concurrency or cfg.worker.concurrency, burst=args.burst, grace_s=grace)
    return asyncio.run(w.run())


def _set_conf(args: argparse.Namespace, field: str, value: str) -> int:
    import redis

    from shared import keys

    cfg = load(args)
    conn = redis.Redis.from_url(cfg.redis_url)
    if not conn.sismember(keys.DATASETS, args.dataset):
        raise BudgetqError(f"dataset {args.dataset!r} is not registered in {cfg.redis_url.split('@')[-1]}")
    conn.hset(keys.conf_key(args.dataset), field, value)
    print(f"{args.dataset}: {field} = {value}")
    return 0


def cmd_budget_set(args: argparse.Namespace) -> int:
    try:
        tokens = parse_tokens(args.tokens)
    except ValueError as exc:
        raise BudgetqError(f"budget for {args.dataset}: {exc}") from None
    return _set_conf(args, "limit", str(tokens))


def cmd_pause(args: argparse.Namespace) -> int:
    return _set_conf(args, "paused", "1")


def cmd_resume(args: argparse.Namespace) -> int:
    return _set_conf(args, "paused", "0")


def cmd_demo(args: argparse.Namespace) -> int:
    from budgetq.demo import run_demo

    return run_demo(redis_url=args.redis_url, workers=args.workers, concurrency=args.concurrency)


def _register_run(sub: argparse._SubParsersAction) -> None:
    sp = with_config(sub.add_parser("produce", help="enqueue prompts and collect results"))
    sp.add_argument("--output-dir")
    sp.set_defaults(func=cmd_produce)
    sp = with_config(sub.add_parser("worker", help="run a concurrent worker"))
    sp.add_argument("--concurrency", type=int)
    sp.add_argument("--burst", action="store_true", help="exit when the queues are empty")
    sp.add_argument("--grace-s", type=float, help="overrides worker.grace_s")
    sp.set_defaults(func=cmd_worker)
    bp = sub.add_parser("budget", help="change a budget live").add_subparsers(dest="bcmd", required=True)
    sp = with_config(bp.add_parser("set"))
    sp.add_argument("dataset")
    sp.add_argument("tokens")
    sp.set_defaults(func=cmd_budget_set)
    for name, fn in (("pause", cmd_pause), ("resume", cmd_resume)):
        sp = with_config(sub.add_parser(name, help=f"{name} a dataset"))
        sp.add_argument("dataset")
        sp.set_defaults(func=fn)
    sp = sub.add_parser("demo", help="the whole pipeline on one machine with bundled data")
    sp.add_argument("--redis-url")
    sp.add_argument("--workers", type=int, default=2)
    sp.add_argument("--concurrency", type=int, default=64)
    sp.set_defaults(func=cmd_demo)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="budgetq", description="Token-budgeted generation on Redis + RQ + SGLang")
    p.add_argument("--log-level", default="INFO")
    p.add_argument("--log-format", choices=("text", "json"), default="text", help="json: one object per line")
    sub = p.add_subparsers(dest="cmd", required=True)
    _register_run(sub)
    cli_sim.register(sub)
    cli_ops.register(sub)
    cli_data.register(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(args.log_level, args.log_format)
    try:
        return args.func(args)
    except (BudgetqError, FileNotFoundError) as exc:
        print(f"budgetq: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
