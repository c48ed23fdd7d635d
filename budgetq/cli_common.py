"""What every subcommand module shares: the config flags, loading the config, Redis, flag types."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

import redis

from shared.config import Config


def with_config(sp: argparse.ArgumentParser) -> argparse.ArgumentParser:
    sp.add_argument("-c", "--config", help="YAML config file (see examples/budgetq.yaml)")
    sp.add_argument("--redis-url", help="overrides redis_url and BUDGETQ_REDIS_URL")
    sp.add_argument("--server-url", action="append", help="SGLang URL (repeatable); overrides server.urls")
    return sp


def load(args: argparse.Namespace) -> Config:
    from shared.config import load_config

    overrides = {("redis_url",): getattr(args, "redis_url", None)}
    if getattr(args, "server_url", None):
        overrides[("server", "urls")] = args.server_url
    if getattr(args, "output_dir", None):
        overrides[("output_dir",)] = args.output_dir
    from shared.logs import register_config_secrets

    cfg = load_config(args.config, overrides)
    register_config_secrets(cfg)  # never log the API key or passwords, wherever they came from
    args.loaded_redis_url = cfg.redis_url  # for main()'s one-line Redis errors (host named, never the password)
    return cfg


def open_redis(cfg: Config, what: str, wait_s: float = 0.0, stop: Callable[[], bool] | None = None
               ) -> redis.Redis | None:
    """A client that has answered a PING (one try unless ``wait_s``); None if ``stop()`` came first.

    A refused password, a missing database or a silent server is a one-line BudgetqError here,
    before any command of the subcommand runs.
    """
    from shared.redis_conn import connect, wait_ready

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
