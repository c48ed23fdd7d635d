"""``budgetq report``: the run in pictures, one HTML file (producer/ops/report.py); and the report
`produce` writes at its end (``write_at_end``)."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import redis

from budgetq.cli.common import OUTPUT_DIR_HELP, load, with_config
from budgetq.shared.config import Config
from budgetq.shared.errors import BudgetqError

log = logging.getLogger("budgetq.report")


def _redis_if_there(cfg: Config) -> redis.Redis | None:
    """Redis if it answers now; the report is drawn from the output directory alone otherwise."""
    from budgetq.shared.redis_conn import connect_once, describe

    try:
        conn = connect_once(cfg.redis_url, timeout_s=2.0)
        conn.ping()
        return conn
    except (redis.RedisError, OSError, ValueError) as exc:
        log.info("redis %s not reachable (%s): the report is drawn from the output directory alone",
                 describe(cfg.redis_url), type(exc).__name__)
        return None


def cmd_report(args: argparse.Namespace) -> int:
    from budgetq.producer.ops.report import write_report
    from budgetq.producer.ops.report_data import check_dir

    cfg = load(args)
    check_dir(cfg)   # a wrong directory is said before Redis is tried
    conn = None if args.no_redis else _redis_if_there(cfg)
    try:
        path, run = write_report(cfg, conn, Path(args.out) if args.out else None)
    except ModuleNotFoundError as exc:   # matplotlib missing from a --no-deps install
        raise BudgetqError(f"report: {exc.name} is not installed (pip install matplotlib)") from None
    except OSError as exc:
        raise BudgetqError(f"report: {exc.filename or cfg.output_dir}: {exc.strerror or exc}") from None
    print(run.state_line)
    print(f"report: {path}")
    return 0


def write_at_end(cfg: Config, conn: redis.Redis) -> Path | None:
    """produce's last step: the run's report, complete or not. A report that cannot be written is
    one warning: it never changes how the run ended (``budgetq report`` draws it again later)."""
    from budgetq.producer.ops.report import write_report

    try:
        try:
            path, _run = write_report(cfg, conn)
        except redis.RedisError:   # Redis went away as the run ended: the output directory alone
            path, _run = write_report(cfg, None)
        return path
    except (BudgetqError, OSError, redis.RedisError, ModuleNotFoundError, ValueError) as exc:
        print(f"report: not written ({exc}); `budgetq report` draws it", file=sys.stderr)
        return None


def register(sub: argparse._SubParsersAction) -> None:
    sp = with_config(sub.add_parser("report", help="the run in pictures: one self-contained HTML file"),
                     servers=False)
    sp.add_argument("--out", metavar="FILE", help="where to write it (default: <output_dir>/report.html)")
    sp.add_argument("--output-dir", help=OUTPUT_DIR_HELP)
    sp.add_argument("--no-redis", action="store_true",
                    help="draw from the output directory alone, even if Redis is there")
    sp.set_defaults(func=cmd_report)
