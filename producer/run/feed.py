"""One dataset as the producer feeds it: its reader, its queue and what this run read and enqueued."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from rq import Queue

from budgetq.producer.reading.reader import Filtered, Invalid, Prompt
from budgetq.producer.reading.tally import RowTally
from budgetq.shared.config import DatasetConfig


@dataclass
class Feed:
    ds: DatasetConfig
    rows: Iterator[Prompt | Invalid | Filtered]
    queue: Queue
    legacy: bool = False     # Redis may still hold job ids of the old scheme (see producer/run/migrate.py)
    pending: list[Prompt] = field(default_factory=list)  # read, not yet enqueued (kept over a Redis outage)
    read: int = 0            # rows of the file read this run (every item the reader yielded)
    enqueued: int = 0
    # valid / invalid (duplicates included) / duplicates / filtered rows read this run, as check
    # counts them (producer/reading/tally.py); the summary's duplicate_ids
    tally: RowTally = field(default_factory=RowTally)
    filtered_recorded: int = 0  # the filtered count in Redis: the most any run of this dataset filtered
    already_done: int = 0
    already_live: int = 0
    ended: bool = False      # every row read
    halted: bool = False     # budget reached: reading paused (resumes if the budget is raised)
    complete: bool = False


def recorded_invalid(path: Path) -> set[tuple[int, str]]:
    """(line, reason) of every bad row an earlier run already wrote to ``path``."""
    seen: set[tuple[int, str]] = set()
    if path.exists():
        with open(path, encoding="utf-8", errors="replace") as fh:
            for line in fh:
                try:
                    rec = json.loads(line)
                    seen.add((int(rec["line"]), str(rec["reason"])))
                except (ValueError, KeyError, TypeError):
                    continue
    return seen
