"""JSON for one-line error messages about bad input: a value's type as a person says it, and
what is wrong with text that does not parse.

Used by the producer's readers and mapping (``row is an array, not a JSON object``, ``bad JSON at
column 23: unterminated string ...``), by export, and by shared/identity.py (``id field 'id' is
an object ({...})``).
"""

from __future__ import annotations

import json
from typing import Any

_CONTROL_NAMES = {"\t": "a tab", "\x00": "a NUL byte"}


def json_problem(exc: json.JSONDecodeError) -> str:
    """What is wrong, as a whole sentence without the position (callers name file, line, column).
    Python's own message for two of them ends where it named the position ("Invalid control
    character at"): said whole here, and as the real problem.

    A line cut short (a truncated file, a killed writer) ends inside a string: that is an
    unterminated string, whether the decoder met the end of the text or the line's newline.
    """
    msg = exc.msg
    if msg.startswith("Unterminated string"):
        return "unterminated string: it starts at this column and never ends (is the line cut short?)"
    if msg.startswith("Invalid control character"):
        char = exc.doc[exc.pos] if 0 <= exc.pos < len(exc.doc) else ""
        if char and char in "\r\n":
            if not exc.doc[exc.pos:].strip():
                return "unterminated string: the line ends inside a string (is it cut short?)"
            return "a line break inside a string: JSON needs it escaped (write \\n)"
        name = _CONTROL_NAMES.get(char, f"control character {char!r}")
        return f"{name} inside a string: JSON needs it escaped (e.g. \\t)"
    return msg


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
