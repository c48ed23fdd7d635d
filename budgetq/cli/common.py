"""What every subcommand module shares: the config flags, finding and loading the config, Redis,
flag types, and writing to stdout (full-width tables off a terminal, frames flushed one by one)."""

from __future__ import annotations

import argparse
import functools
import logging
import math
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import redis

from budgetq.shared.config import Config

if TYPE_CHECKING:
    from rich.console import Console, RenderableType

log = logging.getLogger("budgetq")
# Without -c: $BUDGETQ_CONFIG, else this file in the working directory (what `budgetq init` writes).
DEFAULT_CONFIG = "budgetq.yaml"
CONFIG_ENV = "BUDGETQ_CONFIG"
# Off a terminal (CI logs, `| tee`, a file) tables are never cut to the 80 columns rich assumes
# there: they are as wide as their content, up to this.
PIPE_WIDTH = 1000


def with_config(sp: argparse.ArgumentParser, servers: bool = True) -> argparse.ArgumentParser:
    """-c and --redis-url; --server-url only for the commands that talk to the servers."""
    sp.add_argument("-c", "--config", help=f"YAML config file (default: ${CONFIG_ENV}, else ./{DEFAULT_CONFIG} if "
                                           "it exists; `budgetq init` writes one)")
    sp.add_argument("--redis-url", help="overrides redis_url and BUDGETQ_REDIS_URL")
    if servers:
        sp.add_argument("--server-url", action="append", help="server URL (repeatable); overrides server.urls")
    return sp


# A bad value given by flag is named by the flag (`--deadline 40: ...`), not blamed on the config file.
FLAG_FIELDS = {("redis_url",): "--redis-url", ("server", "urls"): "--server-url", ("output_dir",): "--output-dir",
               ("run", "deadline"): "--deadline", ("run", "total_budget"): "--total-budget"}
OUTPUT_DIR_HELP = "the results' directory: <dataset>.jsonl and the rest (overrides output_dir and BUDGETQ_OUTPUT_DIR)"


def find_config(args: argparse.Namespace, environ: dict[str, str] | None = None) -> str | None:
    """The config file a command uses: -c, else $BUDGETQ_CONFIG, else ./budgetq.yaml if it exists."""
    env = os.environ if environ is None else environ
    if getattr(args, "config", None):
        return args.config
    if env.get(CONFIG_ENV):
        return env[CONFIG_ENV]
    return DEFAULT_CONFIG if Path(DEFAULT_CONFIG).is_file() else None


def load(args: argparse.Namespace) -> Config:
    from budgetq.shared.config_load import load_config
    from budgetq.shared.redis_conn import describe

    given = getattr(args, "config", None)
    path = find_config(args)
    overrides: dict[tuple[str, ...], Any] = {("redis_url",): getattr(args, "redis_url", None)}
    if getattr(args, "server_url", None):
        overrides[("server", "urls")] = args.server_url
    if getattr(args, "output_dir", None):
        overrides[("output_dir",)] = args.output_dir
    for flag, field in (("deadline", ("run", "deadline")), ("total_budget", ("run", "total_budget"))):
        if getattr(args, flag, None) is not None:  # the config's run: settings, by the same names
            overrides[field] = getattr(args, flag)
    from budgetq.shared.logs import register_config_secrets

    cfg = load_config(path, overrides, flags=FLAG_FIELDS)
    register_config_secrets(cfg)  # never log the API key or passwords, wherever they came from
    args.loaded_redis_url = cfg.redis_url  # for main()'s one-line Redis errors (host named, never the password)
    chosen_redis = getattr(args, "redis_url", None) or os.environ.get("BUDGETQ_REDIS_URL")
    if not given and (path or not chosen_redis):
        # Picked for the user (a config found by itself, or the defaults' localhost Redis): say
        # which, so a command never silently runs against a Redis nobody named. One line on
        # stderr (a log line, so --log-format json and --log-level hold).
        where = f"config {path}" if path else f"no config file (no -c, ${CONFIG_ENV} or ./{DEFAULT_CONFIG})"
        log.info("%s; redis %s", where, describe(cfg.redis_url))
    args.config = path
    return cfg


def open_redis(cfg: Config, what: str, wait_s: float = 0.0, stop: Callable[[], bool] | None = None
               ) -> redis.Redis | None:
    """A client that has answered a PING (one try unless ``wait_s``); None if ``stop()`` came first.

    A refused password, a missing database or a silent server is a one-line BudgetqError here,
    before any command of the subcommand runs.
    """
    from budgetq.shared.redis_conn import connect, wait_ready

    conn = connect(cfg.redis_url)
    return conn if wait_ready(conn, cfg.redis_url, wait_s, what, stop) else None


def positive_int(text: str) -> int:
    """argparse type: an integer > 0 (the flag and the value are named by argparse's message)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0 (got {text!r})")
    return value


def seconds(minimum: float, strict: bool = False, maximum: float | None = None) -> Callable[[str], float]:
    """argparse type: a finite number of seconds >= minimum (> minimum if strict), <= maximum."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if not math.isfinite(value) or value < minimum or (strict and value == minimum) \
                or (maximum is not None and value > maximum):
            bound = f"{'>' if strict else '>='} {minimum:g}" + (f" and <= {maximum:g}" if maximum is not None else "")
            raise argparse.ArgumentTypeError(f"must be {bound} (got {text!r})")
        return value
    return parse


def int_range(lo: int, hi: int) -> Callable[[str], int]:
    """argparse type: an integer in [lo, hi] (instead of ``choices=range(...)``, which lists every value)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if not lo <= value <= hi:
            raise argparse.ArgumentTypeError(f"must be between {lo} and {hi} (got {text!r})")
        return value
    return parse


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def log_level(text: str) -> str:
    """argparse type of --log-level: a level name in any case (WARN and FATAL, logging's aliases, too)."""
    level = text.upper()
    if level not in logging.getLevelNamesMapping() or level == "NOTSET":
        raise argparse.ArgumentTypeError(f"{text!r} is not one of {', '.join(LOG_LEVELS)}")
    return level


def one_of(*names: str):
    """argparse type: one of ``names``, in any case (``--log-format JSON``), returned in lower case."""
    def parse(text: str) -> str:
        if text.lower() not in names:
            raise argparse.ArgumentTypeError(f"{text!r} is not one of {', '.join(names)}")
        return text.lower()
    return parse


@functools.cache
def _console_class() -> type[Console]:
    from rich.console import Console

    class StdoutConsole(Console):
        def on_broken_pipe(self) -> None:
            # rich's own handler exits with status 1 and says nothing; main() turns a closed
            # stdout into the quiet 141 every command keeps (docs/cli.md).
            self.quiet = True
            raise BrokenPipeError

    return StdoutConsole


def stdout_console(min_width: int = 0) -> Console:
    """The console for tables on stdout: the terminal's width (at least ``min_width``) on a
    terminal, else never cut. A closed stdout raises BrokenPipeError from its print()."""
    console = _console_class()
    if not sys.stdout.isatty():
        return console(width=PIPE_WIDTH, soft_wrap=False)
    on_terminal = console()
    return console(width=min_width) if on_terminal.width < min_width else on_terminal


def watch(frame: Callable[[], RenderableType], interval: float, console: Console | None = None) -> int:
    """Redraw ``frame()`` every ``interval`` s until interrupted (SIGINT, SIGTERM: status 0); a
    closed stdout raises BrokenPipeError (main() ends the command with 141).

    On a terminal: in place (rich Live). Otherwise (``> file``, ``| tee``): each frame printed
    whole and flushed at once, so the file holds every frame up to the moment it is stopped
    (Live off a terminal writes only when it stops, which SIGTERM never lets it do).
    """
    import signal

    console = console or stdout_console()

    def stop(_signum: int, _frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    try:
        if console.is_terminal:
            from rich.live import Live

            with Live(frame(), console=console, auto_refresh=False, screen=False) as live:
                while True:
                    time.sleep(interval)
                    live.update(frame(), refresh=True)
        while True:
            console.print(frame())
            console.print()
            console.file.flush()
            time.sleep(interval)
    except KeyboardInterrupt:
        return 0


def discover_context(cfg: Config, timeout_s: float = 3.0) -> None:
    """``server.context_length`` unset and a tokenizer to count with: take the servers' own, the
    smallest ``max_model_len`` their /v1/models reports, so prompts over it are recorded invalid
    at the producer instead of failing at the server. Servers not up yet: left unset, one line."""
    if cfg.server.context_length is not None or not cfg.server.tokenizer:
        return
    import asyncio

    from budgetq.worker.sglang_client import probe_server

    async def ask() -> list:
        return list(await asyncio.gather(*(probe_server(cfg.server, url, timeout_s) for url in cfg.server.urls)))

    known = sorted((i.max_model_len, i.url) for i in asyncio.run(ask()) if i.max_model_len)
    if not known:
        log.info("server context length unknown (no server reported max_model_len on /v1/models): prompts are "
                 "not checked against it; set server.context_length to check them")
        return
    cfg.server.context_length, url = known[0]
    log.info("server context length %d tokens (/v1/models of %s): prompts over it less max_tokens are "
             "recorded invalid", cfg.server.context_length, url)
