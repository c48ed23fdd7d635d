"""What every subcommand module shares: the config flags and loading the config from them."""

from __future__ import annotations

import argparse

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
    return cfg
