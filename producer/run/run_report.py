"""What `budgetq produce` says at its end: per dataset, where every prompt of the file is (the
ledger, rows never read included) and why it stopped (shared/ends.py); for the run, whether it is
complete (the exit status) and the end-of-run block: elapsed time, tokens and mean tok/s, request
latency p50/p95/p99, and each dataset's measured mean response length next to prior_mean_tokens.

Latencies are the ``latency_s`` of each row the collector writes (the worker puts it in the row it
commits: no extra Redis write per prompt, and the number stays on disk with its row), kept in a
bounded uniform sample. Elapsed, tokens and latencies are this `produce`'s, from its start; the
ledger and the mean response length are the dataset's, over every run.
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import redis

from budgetq.shared import keys, run_plan
from budgetq.shared.budget import dataset_state
from budgetq.shared.ends import is_complete, mean_response, stop_reason
from budgetq.shared.ledger import read_ledgers
from budgetq.shared.stats import Stat, discards_by_reason

if TYPE_CHECKING:
    from budgetq.producer.run.collector import Collector
    from budgetq.producer.run.feed import Feed

LATENCY_KEEP = 100_000   # latencies kept per dataset (and for the run): 0.8 MB each, quantiles to ~0.5%
QUANTILES = (("p50", 0.50), ("p95", 0.95), ("p99", 0.99))
LEDGER_COLUMNS = ("queued", "running", "rows", "truncated", "discarded", "skipped", "failed", "aborted", "invalid",
                  "filtered", "unread", "unread_estimated", "source_rows")

log = logging.getLogger("budgetq.producer")


class Reservoir:
    """A uniform sample of at most ``keep`` values of a stream (Vitter's algorithm R; seeded, so the
    same stream gives the same sample): a run of any length costs bounded memory."""

    def __init__(self, keep: int = LATENCY_KEEP, seed: int = 0) -> None:
        self.keep = keep
        self.values: list[float] = []
        self.seen = 0
        self._rng = random.Random(seed)

    def add(self, value: float) -> None:
        if not math.isfinite(value) or value < 0:
            return
        self.seen += 1
        if len(self.values) < self.keep:
            self.values.append(value)
            return
        at = self._rng.randrange(self.seen)
        if at < self.keep:
            self.values[at] = value

    def quantiles(self) -> dict[str, Any] | None:
        """p50, p95, p99 (nearest rank, seconds) and how many rows they are over; None without one."""
        if not self.values:
            return None
        xs = sorted(self.values)
        out: dict[str, Any] = {name: round(xs[min(len(xs) - 1, max(0, math.ceil(q * len(xs)) - 1))], 3)
                               for name, q in QUANTILES}
        return {**out, "rows": self.seen}


class RunClock:
    """When this `produce` started and what each dataset had used then."""

    def __init__(self, conn: redis.Redis, names: Sequence[str]) -> None:
        self.started = time.monotonic()
        self.used_at_start = {n: int(conn.get(keys.used_key(n)) or 0) for n in names}

    def elapsed_s(self) -> float:
        return time.monotonic() - self.started


def summary_rows(conn: redis.Redis, feeds: Sequence[Feed], collector: Collector, clock: RunClock) -> list[dict]:
    """One row per dataset: its ledger (shared/ledger.py, what `budgetq status` shows), its stop
    reason, what this run did (enqueued, already done, duplicate ids among the invalid rows, tokens,
    tok/s, latencies) and its measured mean response length."""
    names = [f.ds.name for f in feeds]
    ledgers = read_ledgers(conn, names)
    sec, usec = conn.time()
    deadline = run_plan.deadline_stopped(conn, sec + usec / 1e6)
    elapsed = max(clock.elapsed_s(), 1e-9)
    rows = []
    for f in feeds:
        name = f.ds.name
        st = dataset_state(conn, name)
        ledger = ledgers[name]
        stop = stop_reason(st, ledger, deadline)
        tokens = max(0, st.used - clock.used_at_start.get(name, 0))
        mean = mean_response(st)
        rows.append({
            "dataset": name, "budget": st.limit, "used": st.used,
            **{column: ledger[column] for column in LEDGER_COLUMNS},
            "rows_on_disk": collector.rows(name), "entered": ledger["entered"],
            "unaccounted": ledger["unaccounted"], "enqueued": f.enqueued, "already_done": f.already_done,
            "duplicate_ids": f.tally.duplicates, "wasted_tokens": st.stats.get(Stat.WASTED_TOKENS, 0),
            # Spent (every token the servers generated) beside kept (the rows'), and discarded by reason.
            "budget_counts": st.budget_counts, "spent_tokens": st.stats.get(Stat.GENERATED_TOKENS, 0),
            "kept_tokens": st.stats.get(Stat.KEPT_TOKENS, 0),
            "discarded_tokens": st.stats.get(Stat.DISCARDED_TOKENS, 0),
            "discarded_by_reason": discards_by_reason(conn.hgetall(keys.discards_key(name))),
            "discarded_written": collector.discarded[name],
            "stop": str(stop), "complete": is_complete(stop, ledger),
            "rows_written": collector.written[name], "tokens_this_run": tokens,
            "tok_s": round(tokens / elapsed, 1), "latency_s": collector.latency[name].quantiles(),
            "mean_response_tokens": None if mean is None else round(mean, 1), "prior_mean_tokens": st.prior_mean,
        })
    return rows


def end_of_run(rows: list[dict], clock: RunClock, collector: Collector) -> dict[str, Any]:
    """The run as a whole: complete or not, elapsed, tokens counted this run and their mean rate,
    request latency quantiles over every row written; ``datasets``: the summary rows."""
    elapsed = clock.elapsed_s()
    tokens = sum(r["tokens_this_run"] for r in rows)
    return {"complete": all(r["complete"] for r in rows), "elapsed_s": round(elapsed, 2), "tokens": tokens,
            "tok_s": round(tokens / max(elapsed, 1e-9), 1), "rows_written": sum(r["rows_written"] for r in rows),
            "latency_s": collector.latency_all.quantiles(), "datasets": rows}


def warn_cut_rows(feeds: Sequence[Feed], collector: Collector) -> None:
    """keep=all kept answers cut by max_tokens: a drafter trained on them (SpecForge appends
    an end-of-turn) learns stops the model never made. Say so loudly, once per dataset."""
    for f in feeds:
        if (n := collector.cut_kept.get(f.ds.name, 0)) and f.ds.keep == "all":
            log.warning("dataset %s: %d row(s) written this run were cut by max_tokens (finish_reason "
                        "length) and kept (keep: all); for drafter training use keep: complete, or "
                        "`budgetq export --format specforge`, which leaves them out", f.ds.name, n)
