"""``budgetq`` subcommands. Parses flags, sets up logging, calls library functions.

The run commands live here (produce, worker, demo); the other groups each have a module with
a ``register(sub)`` function: cli_control (budget set, pause, resume, retry-failed, reconcile),
cli_sim (sim), cli_ops (status, monitor), cli_data (export, check), cli_init (init).
Conventions every command keeps (docs/cli.md): a bad flag or value is one line on stderr, exit
status 2; a closed stdout (``| head``) ends the command quietly (status 141, like SIGPIPE).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import re
import sys
from pathlib import Path
from typing import Any

import redis

from budgetq.cli import control as cli_control
from budgetq.cli import data as cli_data
from budgetq.cli import features as cli_features
from budgetq.cli import init as cli_init
from budgetq.cli import ops as cli_ops
from budgetq.cli import plan as cli_plan
from budgetq.cli import report as cli_report
from budgetq.cli import sim as cli_sim
from budgetq.cli.common import (
    LOG_LEVELS,
    OUTPUT_DIR_HELP,
    discover_context,
    load,
    log_level,
    one_of,
    open_redis,
    positive_int,
    seconds,
    stdout_console,
    with_config,
)
from budgetq.shared.config import Config
from budgetq.shared.errors import BudgetqError
from budgetq.shared.logs import setup_logging
from budgetq.shared.retry import REDIS_DOWN

log = logging.getLogger("budgetq.producer")
# After a first SIGTERM/SIGINT the producer finishes its tick and writes what it collected;
# if that cannot happen (Redis hung or down), it stops at once after this long, as on a second signal.
PRODUCER_STOP_S = 15.0
# Exit status after stdout was closed under us (`budgetq status --json | head`): the shell's for SIGPIPE.
BROKEN_PIPE_STATUS = 141
# `budgetq produce` stopped before the end of its run (interrupted): `budgetq produce` again continues
# it. Not 1 (an uncaught error's, and produce's own for rows left without hidden states) nor 2 (bad
# flags, config, Redis: nothing to continue). The exit codes are a table in docs/cli.md.
STOPPED_STATUS = 3


def print_summary(rows: list[dict], report: dict | None = None) -> None:
    from budgetq.cli.status_view import end_of_run_table, summary_table

    # On a terminal at least 120 columns (the table scrolls rather than cutting names); off one
    # (CI logs, `| tee`) as wide as the table is.
    console = stdout_console(min_width=120)
    console.print(summary_table(rows))
    if report is not None:
        console.print(end_of_run_table(report))
        console.print(run_line(report))


def run_line(report: dict) -> str:
    """The summary's last line: whether the run is complete, with the exit status it ends with."""
    if report["complete"]:
        return (f"run complete: every dataset reached its end "
                f"({', '.join(sorted({r['stop'] for r in report['datasets']}))})")
    left = ", ".join(f"{r['dataset']} {r['stop']}" for r in report["datasets"] if not r["complete"]) \
        or "the hidden-states pass interrupted"
    return (f"run stopped before the end (exit {STOPPED_STATUS}): {left}; `budgetq produce` again continues it")


def _empty_files(cfg: Config) -> set[str]:
    """Datasets whose local file holds nothing but whitespace: warned about by name before the run."""
    empty = set()
    for ds in cfg.datasets:
        path = Path(ds.path)
        if "://" in ds.path or not path.is_file():
            continue
        size = path.stat().st_size
        if size == 0 or (size < 1 << 20 and not path.read_bytes().strip()):
            log.warning("dataset %s: %s is empty: no prompts to send", ds.name, path)
            empty.add(ds.name)
    return empty


def _warn_no_rows(cfg: Config, rows: list[dict], warned: set[str]) -> None:
    for r in rows:
        if r["dataset"] in warned or r["stop"] != "out of prompts":
            continue
        if not (r["enqueued"] or r["rows"] or r["invalid"] or r["filtered"] or r["already_done"] or r["skipped"]
                or r["failed"]):
            log.warning("dataset %s: %s gave no rows", r["dataset"], cfg.dataset(r["dataset"]).path)


def cmd_produce(args: argparse.Namespace) -> int:
    import signal

    from budgetq.hidden_states.collect.inline import Capture
    from budgetq.producer.run.hooks import register_capture
    from budgetq.producer.run.producer import Producer
    from budgetq.producer.run.progress import ProgressReporter

    register_capture(Capture)  # the producer's loop calls it; producer/ never imports hidden_states

    cfg = load(args)
    if not cfg.datasets:
        raise BudgetqError(f"no datasets in {args.config}" if args.config else
                           "no datasets: pass a config with a datasets: list (-c CONFIG, or `budgetq init`)")
    discover_context(cfg)
    state: dict = {"stop": False, "producer": None}

    def hard_stop(_signum: int, _frame: object) -> None:
        raise KeyboardInterrupt

    def stop(signum: int, _frame: object) -> None:
        # Everything lives in Redis and the output files: stopping loses nothing, a new
        # `budgetq produce` continues. Finish writing what has been collected first; a
        # second signal (or PRODUCER_STOP_S without an orderly end) stops at once.
        if state["stop"]:
            raise KeyboardInterrupt
        state["stop"] = True
        if state["producer"] is not None:
            state["producer"].stop_requested = True
        signal.signal(signal.SIGALRM, hard_stop)
        signal.setitimer(signal.ITIMER_REAL, PRODUCER_STOP_S)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    warned = _empty_files(cfg)
    if open_redis(cfg, "producer", cfg.redis_wait_s, stop=lambda: state["stop"]) is None:
        log.warning("stopped before the run started")
        return STOPPED_STATUS
    producer = _start_producer(cfg, Producer, lambda: state["stop"])
    if producer is None:
        return STOPPED_STATUS
    state["producer"] = producer
    producer.stop_requested = state["stop"]
    monitor = None
    if args.monitor:
        from budgetq.producer.ops.monitor import MonitorThread

        monitor = MonitorThread(cfg)
        port = monitor.start()
        log.info("monitor on http://%s:%d", cfg.monitor.host, port)
    # --json: stdout holds the one JSON object; bars (producer.progress: bars) go to stderr.
    progress = ProgressReporter(cfg, producer.conn, stream=sys.stderr if args.json else None)
    from budgetq.producer.ops.report_log import RunLog

    run_log = RunLog(cfg, producer.conn)  # out/run-log.jsonl: what `budgetq report` draws over time
    run_log.start()

    def on_tick(_p: object) -> None:
        progress.update()
        run_log.tick()

    try:
        report = producer.run(on_tick=on_tick)
    finally:
        progress.close()
        if monitor is not None:
            monitor.stop()
    run_log.end(report)
    signal.setitimer(signal.ITIMER_REAL, 0)
    rows = report["datasets"]
    # Complete: every dataset at an end (shared/ends.py); with capture: features, a stop also
    # leaves the hidden-states pass unfinished (the next `produce` continues it as well).
    if report["complete"] and state["stop"] and producer.capture.active:
        report["complete"] = False
    status = 0 if report["complete"] else STOPPED_STATUS
    if args.json:
        print(json.dumps({**report, "exit_status": status}, indent=2))
    else:
        print_summary(rows, report)
    _warn_no_rows(cfg, rows, warned)
    if args.json:  # its lines are not the JSON object: to stderr
        with contextlib.redirect_stdout(sys.stderr):
            capture = cli_features.print_capture(producer.capture, finished=report["complete"])
    else:
        capture = cli_features.print_capture(producer.capture, finished=report["complete"])
    # The run report (budgetq report), at every end, complete or not: its path is the last line.
    report_path = cli_report.write_at_end(cfg, producer.conn) if cfg.producer.report else None
    if report_path is not None:
        print(f"report: {report_path}", file=sys.stderr if args.json else sys.stdout)
    return status or capture


def _start_producer(cfg: Config, factory, stopped):
    """The producer's start (registering datasets, adopting rows on disk) retried through a Redis blip."""
    import time

    from budgetq.shared.redis_conn import explain
    from budgetq.shared.retry import backoff_s

    started, attempt = time.monotonic(), 0
    while not stopped():
        try:
            return factory(cfg)
        except REDIS_DOWN as exc:
            attempt += 1
            if time.monotonic() - started > cfg.redis_wait_s:
                raise BudgetqError(explain(exc, cfg.redis_url)) from None
            if attempt == 1:
                log.warning("producer: Redis failed while starting (%s); retrying", explain(exc, cfg.redis_url))
            time.sleep(backoff_s(min(attempt, 6), 0.2, 5.0))
    log.warning("stopped before the run started")
    return None


def concurrency_arg(text: str) -> int | str:
    """argparse type of worker --concurrency: an integer > 0, or auto."""
    return "auto" if text == "auto" else positive_int(text)


def cmd_worker(args: argparse.Namespace) -> int:
    from budgetq.worker.runner import ConcurrentWorker

    cfg = load(args)
    grace = args.grace_s if args.grace_s is not None else cfg.worker.grace_s
    concurrency = args.concurrency if args.concurrency is not None else cfg.worker.concurrency
    # auto: sized from the servers, re-read every capacity_interval_s (worker/capacity.py)
    w = ConcurrentWorker(cfg, concurrency, burst=args.burst, grace_s=grace)
    if cli_features.capture_datasets(cfg) and not args.no_features:
        # a dataset with capture: features: this process serves its features jobs too (cli_features.py)
        rc = asyncio.run(cli_features.run_worker_with_features(w, cfg, args.burst))
    else:
        rc = asyncio.run(w.run())
    if w.abandoned:
        # Threads still blocked on a Redis that does not answer would hold the exit until their
        # socket timeout; the jobs they held come back through their leases (docs/resilience.md).
        logging.shutdown()
        sys.stdout.flush()
        os._exit(rc)
    return rc


def cmd_demo(args: argparse.Namespace) -> int:
    from budgetq.cli.demo import run_demo

    return run_demo(redis_url=args.redis_url, workers=args.workers, concurrency=args.concurrency,
                    log_level=args.log_level, log_format=args.log_format)


def _register_run(sub: argparse._SubParsersAction) -> None:
    sp = with_config(sub.add_parser("produce", help="enqueue prompts and collect results"))
    sp.add_argument("--output-dir", help=OUTPUT_DIR_HELP)
    sp.add_argument("--monitor", action="store_true", help="also serve the web monitor (see monitor: in the config)")
    sp.add_argument("--json", action="store_true",
                    help="print the summary as one JSON object (docs/cli.md \"Exit codes and the summary\")")
    cli_plan.run_flags(sp, "over the config's",
                       deadline_note="; a restart with the same 12h keeps the time it was first fixed to",
                       total_note="; a restart with the same value keeps what `budgetq budget total` set live since")
    sp.set_defaults(func=cmd_produce)
    sp = with_config(sub.add_parser("worker", help="run a concurrent worker"))
    sp.add_argument("--concurrency", type=concurrency_arg,
                    help="requests in flight, or auto: sized from the servers (overrides worker.concurrency)")
    sp.add_argument("--burst", action="store_true", help="exit when the queues are empty")
    sp.add_argument("--grace-s", type=seconds(0), help="overrides worker.grace_s")
    sp.add_argument("--no-features", action="store_true",
                    help="do not serve features jobs (served by default when a dataset has capture: features)")
    sp.set_defaults(func=cmd_worker)


def _register_demo(sub: argparse._SubParsersAction) -> None:
    sp = sub.add_parser("demo", help="the whole pipeline on one machine with bundled data")
    sp.add_argument("--redis-url")
    sp.add_argument("--workers", type=positive_int, default=2)
    sp.add_argument("--concurrency", type=positive_int, default=32,
                    help="requests in flight per worker (default 32: sized with the demo's budgets, see demo.yaml)")
    sp.set_defaults(func=cmd_demo)


class _Parser(argparse.ArgumentParser):
    """Bad flags are one line naming the flag and the value (not the usage text), exit status 2."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Anything that starts like a negative number is a value, as Python 3.13's argparse reads it:
        # 3.11 takes only "-5" and "-0.5", so `budget set B2 -5k` said "arguments are required:
        # tokens" instead of naming the budget.
        self._negative_number_matcher = re.compile(r"-\.?\d")

    def error(self, message: str):  # type: ignore[override,unused-ignore]
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="budgetq", description="Token-budgeted generation on Redis + RQ + SGLang")
    p.add_argument("--version", action="version", version=f"budgetq {_version()}")
    p.add_argument("--log-level", type=log_level, default="INFO", metavar="LEVEL",
                   help=f"{', '.join(LOG_LEVELS)} (any case; default INFO)")
    p.add_argument("--log-format", type=one_of("text", "json"), default="text", metavar="{text,json}",
                   help="json: one object per line")
    sub = p.add_subparsers(dest="cmd", required=True)
    _register_run(sub)
    cli_control.register(sub)  # budget set, pause, resume, retry-failed, reconcile
    _register_demo(sub)
    cli_sim.register(sub)
    cli_ops.register(sub)
    cli_data.register(sub)
    cli_plan.register(sub)  # budgetq plan
    cli_report.register(sub)  # budgetq report
    cli_features.register(sub)  # hidden states
    cli_init.register(sub)
    return p


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("budgetq")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown (not installed)"


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(args.log_level, args.log_format)
    try:
        status = args.func(args)
        sys.stdout.flush()  # a reader that went away is seen here, not at the interpreter's exit
        return status
    except BrokenPipeError:
        return _closed_stdout()
    except (BudgetqError, FileNotFoundError) as exc:
        return _fail(args, str(exc))
    except redis.RedisError as exc:
        from budgetq.shared.redis_conn import explain

        url = getattr(args, "loaded_redis_url", None)
        return _fail(args, explain(exc, url) if url else f"redis: {exc}")
    except KeyboardInterrupt:  # a second SIGINT/SIGTERM: stopped at once, nothing written is lost
        return _fail(args, f"{args.cmd}: interrupted", status=130)


def _closed_stdout() -> int:
    """stdout was closed by its reader (``| head``): stop quietly, as a SIGPIPE'd tool does.

    stdout now points at /dev/null, so the interpreter's last flush at exit cannot raise (and
    print "Exception ignored ... BrokenPipeError") again.
    """
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):
        pass
    return BROKEN_PIPE_STATUS


def _fail(args: argparse.Namespace, message: str, status: int = 2) -> int:
    """A clear one-line error (a JSON log line with --log-format json), exit status 2."""
    from budgetq.shared.logs import redact

    message = redact(message)  # a password inside a URL of the message never reaches the terminal
    if args.log_format == "json":
        logging.getLogger("budgetq").error(message)
    else:
        print(f"budgetq: error: {message}", file=sys.stderr)
    return status


if __name__ == "__main__":
    sys.exit(main())
