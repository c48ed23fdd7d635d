"""One dataset as the producer feeds it: its reader, its queue and what this run read and enqueued."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import redis
from rq import Queue

from budgetq.producer.reading.reader import Filtered, Invalid, Prompt, read_prompts
from budgetq.producer.reading.tally import RowTally
from budgetq.shared import keys
from budgetq.shared.config import DatasetConfig, ServerConfig
from budgetq.shared.identity import PromptId, answer_id, answer_seed, answer_suffix
from budgetq.shared.logs import safe
from budgetq.shared.schema import SamplingParams
from budgetq.shared.stats import Conf

log = logging.getLogger("budgetq.producer")


@dataclass(frozen=True)
class Answer:
    """One answer to generate: a prompt and which of its ``samples`` answers (None: samples: 1).
    Each is its own job, done-set member and row, keyed by ``id`` (shared/identity.py answer_id)."""
    prompt: Prompt
    sample: int | None = None

    @property
    def id(self) -> PromptId:
        return answer_id(self.prompt.id, self.sample or 1)

    @property
    def line(self) -> int:
        return self.prompt.line

    def sampling(self, ds: DatasetConfig) -> SamplingParams:
        """The dataset's sampling, with this answer's own seed when the prompt has several answers."""
        if self.sample is None:
            return ds.sampling
        return ds.sampling.model_copy(update={"seed": answer_seed(ds.sampling.seed, ds.name, self.prompt.id,
                                                                  self.sample)})


def refuse_suffix(ds: DatasetConfig, item: Prompt | Invalid | Filtered) -> Prompt | Invalid | Filtered:
    """With samples > 1, a prompt whose id ends in ``#<digits>`` becomes an invalid row: its answers'
    ids could meet another prompt's (shared/identity.py answer_id). The producer and check both apply it."""
    if isinstance(item, Prompt) and ds.answers_max > 1 and answer_suffix(item.id):
        return Invalid(item.line, f"id {safe(item.id)[:80]!r} ends in '#<digits>', the form of answer ids in a "
                                  f"dataset with samples: {ds.samples}: rename it")
    return item


def answers(ds: DatasetConfig, p: Prompt, round_: int = 1) -> list[Answer]:
    """The answers prompt ``p`` gives in reading round ``round_``: one (samples: 1), all ``samples``
    of them, numbered from 1 (samples: N, one round), or answer ``round_`` (samples: auto)."""
    if ds.samples == 1:
        return [Answer(p)]
    if ds.samples == "auto":
        return [Answer(p, round_)]
    return [Answer(p, k) for k in range(1, ds.samples + 1)]


@dataclass
class Feed:
    ds: DatasetConfig
    rows: Iterator[Prompt | Invalid | Filtered]
    queue: Queue
    legacy: bool = False     # Redis may still hold job ids of the old scheme (see producer/run/migrate.py)
    pending: list[Answer] = field(default_factory=list)  # read, not yet enqueued (kept over a Redis outage)
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
    # samples: auto: the reading round (the file is read once per round; round k enqueues every
    # prompt's k-th answer), up to max_samples; rows are tallied (valid, invalid, filtered) in round 1 only
    round: int = 1

    def next_round(self, server: ServerConfig, conn: redis.Redis) -> bool:
        """samples: auto, the file read to its end: start the next reading round, unless the last one
        (max_samples) has ended. Called only while the budget admits requests (the producer's ``_fill``
        returns early once it does not), so further answers are drawn only for a budget left to fill.
        Rounds are enqueued in order into one FIFO queue: every prompt gets its k-th answer before
        any gets its (k+1)-th."""
        if self.ds.samples != "auto" or self.round >= self.ds.answers_max:
            return False
        if self.round == 1:  # every row read once: their count is exact (the ledger's unread, the ETA)
            conn.hset(keys.conf_key(self.ds.name), mapping={Conf.SOURCE_ROWS: self.read, Conf.SOURCE_ESTIMATED: 0})
        self.round += 1
        self.rows = read_prompts(self.ds, server)
        log.info("dataset %s: samples: auto: every prompt has %d answer(s) and the budget admits more: "
                 "round %d of at most %d", self.ds.name, self.round - 1, self.round, self.ds.answers_max)
        return True


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
