"""Logging setup for every budgetq process: plain text or one JSON object per line, secrets redacted.

Secrets (the SGLang API key, the monitor password, the password inside a Redis URL) must
never reach a log line. Two layers make that hold whatever the call site does:
- a filter on our handler rewrites every record's message (and traceback) through
  ``redact()`` before any formatter sees it;
- ``redact()`` masks credentials in any URL (``scheme://user:PASSWORD@``), bearer tokens,
  and every literal registered with ``register_secret()`` (filled from the BUDGETQ_* env
  vars at setup, and from a loaded config by ``register_config_secrets``).

Ids, names and values from datasets and servers are hostile input: a prompt id holding
"\n2026-01-01 ... WARNING ..." would forge a log line, "\x1b[2J" would clear a terminal.
``escape()`` shows every control character as ``\n``, ``\x1b``, ``\u2028``, ...; the text
formatter applies it to every message, extra field and exception message (a traceback keeps
its own line structure), so no call site can forget it; JSON lines are escaped by the
encoder, plus the line separators it leaves raw. ``safe(value)`` is the same for one value
going anywhere else (a job description, a status line).
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
import threading
import time
import traceback
from collections.abc import Mapping
from typing import Any
from urllib.parse import quote, unquote, urlsplit

MASK = "***"
# Shorter literals would mask unrelated text (a 3-character password is already a problem).
_MIN_SECRET_LEN = 4
_URL_CREDENTIALS = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)(?P<user>[^:@/\s'\"]*):(?P<pw>[^@/\s'\"]+)@")
_BEARER = re.compile(r"(?P<head>\bBearer\s+)[^\s'\",}]+", re.IGNORECASE)
# Env vars whose whole value is a secret, and those that hold a URL that may embed one.
SECRET_ENV = ("BUDGETQ_API_KEY", "BUDGETQ_MONITOR_PASSWORD", "REDIS_PASSWORD", "RQ_DASHBOARD_PASSWORD")
URL_ENV = ("BUDGETQ_REDIS_URL", "RQ_DASHBOARD_REDIS_URL")

# C0/C1 controls, DEL, and what str.splitlines() or a terminal treats as a line break or a
# direction override (a crafted id could otherwise reorder what a reader sees).
# Lone surrogates too: stderr (UTF-8) cannot write them, and the record would be lost.
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069\ud800-\udfff]")
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}

_secrets: set[str] = set()
_lock = threading.Lock()


def _esc(m: re.Match[str]) -> str:
    ch = m.group()
    if ch in _NAMED:
        return _NAMED[ch]
    return f"\\x{ord(ch):02x}" if ord(ch) < 0x100 else f"\\u{ord(ch):04x}"


def escape(text: str) -> str:
    """``text`` with every control character shown escaped (``\n``, ``\x1b``, ``\u2028``); one line."""
    return _CONTROL.sub(_esc, text) if text else text


def safe(value: Any) -> str:
    """Any value as one printable line (``str()``, control characters escaped)."""
    return escape(value if isinstance(value, str) else str(value))


def format_exception(exc_info: Any) -> str:
    """A traceback, with each exception's message escaped (the frames are our code, not input)."""
    try:
        te = traceback.TracebackException(*exc_info)
        stack, todo = set(), [te]
        while todo:
            t = todo.pop()
            if id(t) in stack:
                continue
            stack.add(id(t))
            if isinstance(getattr(t, "_str", None), str):
                t._str = escape(t._str)  # type: ignore[attr-defined]  # CPython keeps the message there
            todo += [c for c in (t.__cause__, t.__context__) if c is not None]
            todo += list(getattr(t, "exceptions", None) or [])
        return "".join(te.format()).rstrip("\n")
    except Exception:  # noqa: BLE001 - never lose the record over its traceback
        return escape("".join(traceback.format_exception(*exc_info)))


def register_secret(value: str | None) -> None:
    """Mask this literal (and its URL-encoded form) wherever it appears in logs from now on."""
    if not value or len(value) < _MIN_SECRET_LEN:
        return
    with _lock:
        _secrets.update({value, quote(value, safe=""), unquote(value)})


def forget_secrets() -> None:
    """Unregister every secret (tests: one test's secrets must not mask the next one's output)."""
    with _lock:
        _secrets.clear()


def url_password(url: str | None) -> str | None:
    """The password part of a URL such as ``rediss://user:pw@host:6380/0`` (None if there is none)."""
    if not url:
        return None
    try:
        pw = urlsplit(url).password
    except ValueError:
        return None
    return unquote(pw) if pw else None


def redact_url(url: str) -> str:
    """The URL with its password replaced by ``***`` (user name kept: it is not a secret)."""
    return _URL_CREDENTIALS.sub(lambda m: f"{m['scheme']}{m['user']}:{MASK}@", url)


def redact(text: str) -> str:
    """``text`` with URL passwords, bearer tokens and registered secrets masked."""
    if not text:
        return text
    text = _URL_CREDENTIALS.sub(lambda m: f"{m['scheme']}{m['user']}:{MASK}@", text)
    text = _BEARER.sub(lambda m: f"{m['head']}{MASK}", text)
    with _lock:
        secrets = sorted(_secrets, key=len, reverse=True)  # longest first: a secret may contain another
    for s in secrets:
        if s in text:
            text = text.replace(s, MASK)
    return text


def register_env_secrets(env: Mapping[str, str] | None = None) -> None:
    source = os.environ if env is None else env
    for var in SECRET_ENV:
        register_secret(source.get(var))
    for var in URL_ENV:
        register_secret(url_password(source.get(var)))


def register_config_secrets(cfg: Any) -> None:
    """Register the secrets of a loaded ``shared.config.Config`` (API key, Redis and monitor passwords)."""
    register_secret(getattr(cfg.server, "api_key", None))
    register_secret(url_password(cfg.redis_url))
    register_secret(getattr(cfg.monitor, "password", None))


class RedactFilter(logging.Filter):
    """Rewrites a record's message and traceback through ``redact()``; never drops a record.

    Attached to the handler (not a logger) so it also sees records propagated from every
    library logger (redis, aiohttp, rq).
    """

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # noqa: BLE001 - a bad format string must not lose the record
            message = f"{record.msg!r} % {record.args!r}"
        record.msg, record.args = redact(message), None
        if record.exc_info and record.exc_info[0] is not None:
            record.exc_text = redact(format_exception(record.exc_info))
            record.exc_info = None
        elif record.exc_text:
            record.exc_text = redact(record.exc_text)
        if record.stack_info:
            record.stack_info = redact(record.stack_info)
        for key, value in list(record.__dict__.items()):
            if key not in _STANDARD and isinstance(value, str):
                setattr(record, key, redact(value))
        return True


_STANDARD = set(logging.LogRecord("", 0, "", 0, "", None, None).__dict__) | {"message", "asctime", "taskName"}


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts (ISO 8601 UTC), level, logger, msg, pid, any ``extra=`` fields,
    and ``exc`` (the traceback) when there is one."""

    def format(self, record: logging.LogRecord) -> str:
        t = time.gmtime(record.created)
        out: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", t) + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
            "pid": record.process,
        }
        for key, value in record.__dict__.items():
            if key not in _STANDARD and key not in out:
                out[key] = value if isinstance(value, str | int | float | bool | type(None)) else repr(value)
        if record.exc_text:
            out["exc"] = record.exc_text
        elif record.exc_info:
            out["exc"] = format_exception(record.exc_info)
        if record.stack_info:
            out["stack"] = record.stack_info
        # json escapes C0 controls; U+2028/2029 (and C1) it leaves raw, and splitlines() breaks on them.
        return _CONTROL.sub(lambda m: f"\\u{ord(m.group()):04x}", json.dumps(out, ensure_ascii=False, default=str))


class TextFormatter(logging.Formatter):
    """``time logger LEVEL message`` plus ``key=value`` for any ``extra=`` fields, one event per line
    (a traceback follows on its own lines, as usual)."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(name)s %(levelname)s %(message)s")

    def formatException(self, ei: Any) -> str:  # noqa: N802 - logging's name
        return format_exception(ei)

    def format(self, record: logging.LogRecord) -> str:
        saved = record.msg, record.args
        try:
            record.msg, record.args = escape(record.getMessage()), None
        except Exception:  # noqa: BLE001 - a bad format string must not lose the record
            record.msg, record.args = escape(f"{record.msg!r} % {record.args!r}"), None
        try:
            line = super().format(record)
        finally:
            record.msg, record.args = saved
        extras = [f"{k}={safe(v)}" for k, v in record.__dict__.items() if k not in _STANDARD]
        if not extras:
            return line
        head, sep, tail = line.partition("\n")
        return f"{head} {' '.join(extras)}{sep}{tail}"


def setup_logging(level: str = "INFO", fmt: str = "text") -> None:
    """Configure the root logger once per process: stderr, text or JSON, secrets redacted."""
    register_env_secrets()
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    handler.addFilter(RedactFilter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
