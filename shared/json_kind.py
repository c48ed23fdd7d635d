"""A JSON value's type as a person says it, for one-line error messages about bad input.

Used by the producer's readers and mapping (``row is an array, not a JSON object``) and by
shared/identity.py (``id field 'id' is an object ({...})``).
"""

from __future__ import annotations

from typing import Any


def kind(value: Any) -> str:
    """'null', 'a boolean', 'a number', 'a string', 'an array', 'an object', else 'a <type name>'."""
    if value is None:
        return "null"
    if isinstance(value, bool):  # before int: a bool is an int to isinstance
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list | tuple):
        return "an array"
    if isinstance(value, dict):
        return "an object"
    return f"a {type(value).__name__}"
