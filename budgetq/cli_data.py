"""Data subcommands (export). Filled in by the datasets work."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    return None
