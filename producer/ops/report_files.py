"""The run report's reading of the output directory's files: the rows (and the truncated file),
the invalid prompts, the run log. A bad line is a BudgetqError naming its file and line.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from budgetq.shared.errors import BudgetqError


@dataclass
class Answers:
    """The answers of one file (<ds>.jsonl or <ds>.truncated.jsonl)."""

    rows: int = 0
    lengths: list[int] = field(default_factory=list)      # completion_tokens
    counted: int = 0                                      # what the budget counts (count: completion|total)
    completion: int = 0
    cut: int = 0                                          # finish_reason "length"
    latencies: list[float] = field(default_factory=list)


def _fail(path: Path, line: int, why: str) -> BudgetqError:
    return BudgetqError(f"{path}:{line}: {why}")


def number(v: Any) -> bool:
    """A JSON number (not a bool, not NaN or infinite)."""
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


@dataclass
class _Tail:
    """Where a file was read to, and what it held up to there."""

    ino: int
    offset: int
    line: int
    answers: Answers


# (path, count) -> _Tail: a process that draws the report again (the monitor's /report) reads only
# what was appended since. Rows files only grow (`produce` cuts a torn last line, which was never
# read: reading stops before a line without its newline).
_TAILS: dict[tuple[str, str], _Tail] = {}


def read_answers(path: Path, count: str, keep: bool = False) -> Answers:
    """The answers of a rows file; ``keep``: remember where it was read to (see _TAILS).

    Bytes in, parsed by orjson; a row ends only at b"\\n". The report reads every row the run
    wrote: ~300 MB/s on the test machine (docs/operations.md, "Run report")."""
    try:
        st = path.stat()
    except FileNotFoundError:
        return Answers()
    key = (str(path), count)
    tail = _TAILS.get(key) if keep else None
    if tail is None or tail.ino != st.st_ino or st.st_size < tail.offset:
        tail = _Tail(st.st_ino, 0, 0, Answers())
    try:
        a, pos, line_no = _read_from(path, count, tail)
    except BudgetqError:
        _TAILS.pop(key, None)   # part of a bad file was added to it: read it whole next time
        raise
    if keep:
        tail.offset, tail.line = pos, line_no
        _TAILS[key] = tail
    # a copy: the next read of a kept tail goes on appending to its own
    return Answers(a.rows, list(a.lengths), a.counted, a.completion, a.cut, list(a.latencies))


def _read_from(path: Path, count: str, tail: _Tail) -> tuple[Answers, int, int]:
    a = tail.answers
    pos, line_no = tail.offset, tail.line
    with open(path, "rb") as fh:
        fh.seek(pos)
        for raw in fh:
            if not raw.endswith(b"\n"):
                break   # torn (the producer died mid-write), or being written: not a row yet
            line_no += 1
            pos += len(raw)
            if not raw.strip():
                continue
            try:
                row = orjson.loads(raw)
            except orjson.JSONDecodeError:
                raise _fail(path, line_no, "not a JSON row") from None
            if not isinstance(row, dict) or not number(row.get("completion_tokens")):
                raise _fail(path, line_no, "a row without completion_tokens: not a budgetq output row")
            n = int(row["completion_tokens"])
            p = int(row["prompt_tokens"]) if number(row.get("prompt_tokens")) else 0
            a.rows += 1
            a.lengths.append(n)
            a.completion += n
            a.counted += n + (p if count == "total" else 0)
            a.cut += row.get("finish_reason") == "length"
            if number(row.get("latency_s")):
                a.latencies.append(float(row["latency_s"]))
    return a, pos, line_no


def read_invalid(path: Path) -> Counter[str]:
    """Invalid prompts by the kind of reason (the reason's words before its numbers)."""
    out: Counter[str] = Counter()
    if path.exists():
        with open(path, encoding="utf-8", errors="replace") as fh:
            for line in fh:
                try:
                    reason = str(json.loads(line).get("reason", "?"))
                except (ValueError, AttributeError):
                    continue
                out[reason.split(":")[0].split("(")[0].strip()[:60] or "?"] += 1
    return out


def read_run_log(path: Path) -> list[dict[str, Any]]:
    recs: list[dict[str, Any]] = []
    if not path.exists():
        return recs
    with open(path, encoding="utf-8", errors="replace") as fh:
        for i, line in enumerate(fh, 1):
            try:
                rec = json.loads(line)
            except ValueError:
                if not line.endswith("\n"):
                    continue   # a producer killed mid-write: its next line starts on a line of its own
                raise _fail(path, i, "not a JSON line: not a budgetq run log") from None
            if not isinstance(rec, dict) or not number(rec.get("t")) or "kind" not in rec:
                raise _fail(path, i, "a line without kind and t: not a budgetq run log")
            recs.append(rec)
    return recs
