"""Live control of a run, from any machine that reaches its Redis: ``budget set``, ``pause``,
``resume``, ``retry-failed`` and ``reconcile`` (the library side: shared/control.py)."""

from __future__ import annotations

import argparse
import json

import redis

from budgetq.cli import plan as cli_plan
from budgetq.cli.common import OUTPUT_DIR_HELP, load, open_redis, with_config
from budgetq.shared.config_fields import parse_budget
from budgetq.shared.errors import BudgetqError
from budgetq.shared.tokens import format_tokens

# After jobs went back on a queue (retry-failed, a raise, a resume): workers run them, but only a
# producer writes their rows, and the one of a finished run has exited.
COLLECT_NOTE = "their results are collected by a running `budgetq produce` (start one if the run had ended)"


def _conn(args: argparse.Namespace):
    cfg = load(args)
    return cfg, open_redis(cfg, args.cmd)


def cmd_budget_set(args: argparse.Namespace) -> int:
    from budgetq.shared import control

    try:
        tokens = parse_budget(args.tokens)   # the config's rule and message (argparse reads "-5" as a value)
    except ValueError as exc:
        raise BudgetqError(f"budget for {args.dataset}: {exc}") from None
    _cfg, conn = _conn(args)
    change = control.set_budget(conn, args.dataset, tokens, args.abort_in_flight)
    print(f"{args.dataset}: budget {format_tokens(int(change.old))} -> {format_tokens(tokens)}" + change.describe()
          + ("; aborted 0 requests in flight" if args.abort_in_flight and not change.aborted else "")
          + _held(conn, args.dataset))
    if change.requeued:
        print(COLLECT_NOTE)
    return 0


def _held(conn: redis.Redis, dataset: str) -> str:
    """``; admissions stay held by the producer: <why>`` while its hold (output disk full) stands:
    a raise or a resume changes nothing until the producer lifts it."""
    from budgetq.shared.budget import dataset_state

    hold = dataset_state(conn, dataset).hold
    return f"; admissions stay held by the producer: {hold}" if hold else ""


def cmd_pause(args: argparse.Namespace) -> int:
    from budgetq.shared import control

    _cfg, conn = _conn(args)
    paused = args.cmd == "pause"
    change = control.set_paused(conn, args.dataset, paused, getattr(args, "abort_in_flight", False))
    print(f"{args.dataset}: {'paused' if paused else 'resumed'}" + change.describe()
          + ("" if paused else _held(conn, args.dataset)))
    if change.requeued:
        print(COLLECT_NOTE)
    return 0


def cmd_retry_failed(args: argparse.Namespace) -> int:
    from budgetq.shared import control
    from budgetq.shared.redis_conn import dataset_names

    _cfg, conn = _conn(args)
    names = args.dataset or dataset_names(conn)
    counts = control.retry_failed(conn, names)
    for ds, n in counts.items():
        print(f"{ds}: requeued {n} failed jobs")
    if sum(counts.values()):
        print(COLLECT_NOTE)
    return 0


def cmd_reconcile(args: argparse.Namespace) -> int:
    from budgetq.producer.run.reconcile import reconcile

    cfg, conn = _conn(args)
    names = args.dataset or [d.name for d in cfg.datasets]
    if not names:
        raise BudgetqError("reconcile needs the datasets of a config (-c CONFIG)")
    reports = [reconcile(conn, cfg, cfg.dataset(n), rebuild=args.rebuild, force=args.force) for n in names]
    if args.json:
        print(json.dumps([r.as_dict() for r in reports], indent=2))
    for r in reports if not args.json else []:
        diff = r.used_after - r.used_before
        print(f"{r.dataset}: {r.rows_on_disk} rows on disk, {r.rows_in_stream} waiting in Redis; "
              f"used {r.used_before} -> {r.used_after} (files say {r.used_expected}, {diff:+d}); "
              f"adopted {r.adopted} rows (+{r.tokens_added} tokens); {r.stale_done} done ids without a row"
              + ("" if r.rebuilt or not r.stale_done else " (run with --rebuild to forget them)"))
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    bp = sub.add_parser("budget", help="change a budget live").add_subparsers(dest="bcmd", required=True)
    sp = with_config(bp.add_parser("set", help="set a dataset's budget (effective on the next admission)"),
                     servers=False)
    sp.add_argument("dataset")
    sp.add_argument("tokens", help="above 0, e.g. 12M, 2.5k, 10_000_000 (to stop a dataset: budgetq pause)")
    sp.add_argument("--abort-in-flight", action="store_true",
                    help="also cancel the dataset's requests in flight (their results will not count)")
    sp.set_defaults(func=cmd_budget_set)
    cli_plan.register_budget(bp)  # deadline, total, weight, show (budgetq/cli/plan.py)
    for name in ("pause", "resume"):
        sp = with_config(sub.add_parser(name, help=f"{name} a dataset (effective on the next admission)"),
                         servers=False)
        sp.add_argument("dataset")
        if name == "pause":
            sp.add_argument("--abort-in-flight", action="store_true", help="also cancel its requests in flight")
        sp.set_defaults(func=cmd_pause)
    sp = with_config(sub.add_parser("retry-failed", help="requeue failed jobs (all datasets, or those named)"),
                     servers=False)
    sp.add_argument("dataset", nargs="*")
    sp.set_defaults(func=cmd_retry_failed)
    sp = with_config(sub.add_parser("reconcile", help="rebuild counters and done sets from the output files"),
                     servers=False)
    sp.add_argument("dataset", nargs="*")
    sp.add_argument("--output-dir", help=OUTPUT_DIR_HELP)
    sp.add_argument("--rebuild", action="store_true",
                    help="also set the stats to what the files say and forget done ids without a row (without it: "
                         "adopt missing rows and set used to the files)")
    sp.add_argument("--force", action="store_true",
                    help="run even with requests in flight (reconcile reads again while commits change the counters)")
    sp.add_argument("--json", action="store_true")
    sp.set_defaults(func=cmd_reconcile)
