"""Parse token counts written by people: ``10M``, ``2.5k``, ``10_000_000``, ``1e7``, ``2.5e6``.

Exact: the digits are read as a decimal, never through a float (``99999999999999999999``
would round), and counts beyond what Redis' INCRBY can hold (a signed 64-bit integer) are
refused rather than stored wrapped or rounded.
"""

import math
import re
from decimal import Decimal

_SUFFIX = {"": 1, "k": 1_000, "m": 1_000_000, "g": 1_000_000_000, "b": 1_000_000_000}
MAX_TOKENS = 2**63 - 1  # Redis integers (INCRBY, the budget counters) are signed 64-bit
# A sign is read too, so "-5" is named as a negative count, not as something unreadable.
_PATTERN = re.compile(r"^\s*([-+]?[0-9][0-9_]*(?:\.[0-9]+)?(?:e[-+]?[0-9]{1,2})?)\s*([kmgb]?)\s*$", re.IGNORECASE)
_NOT_FINITE = re.compile(r"^\s*[-+]?(nan|inf|infinity)\s*$", re.IGNORECASE)


def shown(value: int | float | str) -> str:
    """A value as the user wrote it, for "(got ...)": ``-5`` for both ``-5`` and ``"-5"``."""
    return value.strip() if isinstance(value, str) else repr(value)


def parse_signed_tokens(value: int | float | str) -> int:
    """A whole number of tokens, negative ones included (their meaning is the caller's to name);
    raise ValueError naming the bad value."""
    if isinstance(value, bool):
        raise ValueError(f"not a token count: {value!r}")
    if isinstance(value, int):
        number = value
    elif isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"not a finite token count: {value!r}")
        if not value.is_integer():
            raise ValueError(f"not a whole token count: {value!r}")
        number = int(value)
    else:
        if _NOT_FINITE.match(str(value)):
            raise ValueError(f"not a finite token count: {value!r}")
        match = _PATTERN.match(str(value))
        if not match:
            raise ValueError(f"not a token count: {value!r} (use e.g. 10M, 2.5k, 10_000_000, 1e7)")
        scaled = Decimal(match.group(1).replace("_", "")) * _SUFFIX[match.group(2).lower()]
        if scaled > MAX_TOKENS:  # before int() (exponents have at most two digits: 1e99 is refused here)
            raise ValueError(f"token count too large: {value!r} (at most {MAX_TOKENS:,}, what a Redis integer holds)")
        if scaled != scaled.to_integral_value():
            raise ValueError(f"not a whole token count: {value!r}")
        number = int(scaled)
    if number > MAX_TOKENS:
        raise ValueError(f"token count too large: {value!r} (at most {MAX_TOKENS:,}, what a Redis integer holds)")
    return number


def parse_tokens(value: int | float | str) -> int:
    """A whole number of tokens >= 0; raise ValueError naming the bad value."""
    number = parse_signed_tokens(value)
    if number < 0:
        raise ValueError(f"a token count must be >= 0 (got {shown(value)})")
    return number


def format_tokens(n: int) -> str:
    """Short human form: 10000000 -> '10.00M'."""
    for div, suffix in ((1_000_000_000, "G"), (1_000_000, "M"), (1_000, "k")):
        if abs(n) >= div:
            return f"{n / div:.2f}{suffix}"
    return str(n)
