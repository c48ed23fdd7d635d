"""Logging setup for every budgetq process: plain text or one JSON object per line."""

from __future__ import annotations

import logging


def setup_logging(level: str = "INFO", fmt: str = "text") -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
