"""The layout of a dataset's two hashes, ``keys.conf_key`` and ``keys.stats_key``, documented once.

Both are written from Lua (shared/lua/*.lua) and from Python. Field names are members of
``Conf`` and ``Stat`` (StrEnums, so a member *is* its field name on the wire); the Lua
scripts spell them as literals, and tests/test_stats_layout.py parses every script and
checks that each field a script reads or writes on these hashes is a member here, and that
Python modules write only members. A field added anywhere without being added here fails it.
"""

from __future__ import annotations

import enum
from typing import Any


class Conf(enum.StrEnum):
    """Fields of ``conf_key(ds)``: a dataset's settings (written by the producer and operators)."""

    LIMIT = "limit"                  # the token budget; reserve.lua / commit.lua compare used to it
    CFG_LIMIT = "cfg_limit"          # the config's budget last applied: a restart with the same config
                                     # keeps a budget set live (shared/budget.py register_dataset)
    OWN_BUDGET = "own_budget"        # its own budget (the config's, or one set live), whatever a deadline
                                     # or total makes the limit: reached, it ended the dataset (shared/ends.py)
    MODE = "mode"                    # soft | strict | drain (reserve.lua's admission policy)
    COUNT = "count"                  # completion | total: what a result adds to used
    KEEP = "keep"                    # all | complete: complete sets results cut by max_tokens aside
    PAUSED = "paused"                # "1" while an operator paused the dataset
    HOLD = "hold"                    # why the producer holds admissions (output disk full); reserve.lua
                                     # treats it like paused; absent or "" = none (producer/run/disk_guard.py)
    PRIOR_MEAN = "prior_mean"        # expected length before enough results are in
    MAX_TOKENS = "max_tokens"        # per-request cap; also the histogram's range (commit.lua)
    END_MARGIN_Z = "end_margin_z"    # reserve.lua's end-game margin, in standard deviations
    ABORT_EPOCH = "abort_epoch"      # bumped by withdraw.lua (operator's --abort-in-flight)
    REGISTERED_AT = "registered_at"  # unix seconds of the last register_dataset
    ID_SCHEME = "id_scheme"          # job-id scheme of the dataset (shared/identity.py)
    ID_FIELD = "id_field"            # where its prompt ids come from, JSON (producer/run/id_rule.py)
    SOURCE_ENDED = "source_ended"    # "1" once the producer has read every row (cleared on registration)
    SOURCE_ROWS = "source_rows"      # rows of the dataset's file, counted by the producer at start
                                     # (producer/reading/row_count.py), exact once every row is read
    SOURCE_ESTIMATED = "source_estimated"  # "1" while source_rows is an estimate (a large file's sample)
    SOURCE_LIMIT = "source_limit"    # the dataset's limit: at most this many valid prompts ("" = none)
    SAMPLES = "samples"              # answers per prompt (samples: N): the ledger counts answers
    INTERRUPTED = "interrupted"      # "1": the producer was stopped on request before the dataset ended
                                     # (shared/ends.py; cleared on registration)
    BUDGET_COUNTS = "budget_counts"  # kept | spent: what a budget bounds (commit.lua): the rows' tokens, or
                                     # every token generated (truncated and discarded answers too)
    QUALITY = "quality"              # JSON {guard, gates, retry_discarded}: the worker's guard and gates
                                     # for the dataset (shared/budget.py quality_settings)


class Stat(enum.StrEnum):
    """Fields of ``stats_key(ds)``: counters, only ever incremented (HINCRBY).

    Who writes each is noted; "ending" ones are counted by finish.lua as a job ends
    (shared/jobs.py's ``finish(..., stat=)``), "requeue" ones by requeue.lua, "reopen" ones by
    reopen.lua. Where a prompt is *now* is not a counter: shared/ledger.py derives it.
    """

    # -- jobs
    COMMITTED = "committed"            # commit.lua, adopt.lua: results counted toward the budget
    TRUNCATED = "truncated"            # commit.lua, adopt.lua: cut by max_tokens, kept aside (keep: complete)
    DISCARDED = "discarded"            # commit.lua: answers the guard or a gate discarded, the prompt done
                                       # (not generated again); a ledger state (out/<ds>.discarded.jsonl)
    DISCARD_RETRIED = "discard_retried"  # commit.lua: discarded answers whose prompt was sent again
                                       # (retry_discarded): not a state, the prompt is still running
    ENQUEUED = "enqueued"              # producer: prompts put on the queue for the first time
    ADOPTED = "adopted"                # adopt.lua: rows on disk Redis had lost, marked done again
    FILTERED = "filtered"              # producer: rows its filter left out (never enqueued)
    DUPLICATE_RESULT = "duplicate_result"  # commit.lua: a result for a prompt already committed, dropped
    REJECTED = "rejected"              # commit.lua: result arrived after its admission was withdrawn
    WITHDRAWN = "withdrawn"            # commit.lua (crossing), withdraw.lua: admissions cancelled
    SKIPPED = "skipped"                # ending: budget exhausted, never sent
    ABORTED = "aborted"                # requeue: cancelled at the server or its result refused after
                                       # its admission was withdrawn; back on the queue
    FAILED = "failed"                  # ending: the request failed (or its payload was unreadable)
    ALREADY_DONE = "already_done"      # ending: another copy of the job had committed it
    CAPTURED = "captured"              # ending (features pass, in the <ds>-features stats hash): hidden
                                       # states of a row decoded and sent to the pass
    EXTRA_REQUESTS = "extra_requests"  # commit.lua: requests beyond one per committed or truncated result
                                       # (regenerate: all; every request of a discarded one), so
                                       # reserve.lua's mean stays per request
    REQUEUED = "requeued"              # requeue: shutdown or paused dataset
    RECOVERED = "recovered"            # requeue / maintenance: lease ran out (worker died)
    LOST_COMMIT = "lost_commit"        # finish.lua: ended as committed, but a failover had lost the
                                       # commit (not in the done set): requeued to run again
    REOPENED = "reopened"              # reopen: skipped jobs requeued once the budget admits them again
    RETRIED = "retried"                # worker: one retry of a request (worker/sglang_client.py)
    RETRIED_FAILED = "retried_failed"  # reopen: `budgetq retry-failed` (shared/control.py)
    INVALID = "invalid"                # producer: an input row that cannot become a job
    # -- tokens
    SUM_TOKENS = "sum_tokens"                # commit.lua, adopt.lua: tokens counted (= used, absent adjustments)
    SUM_COMPLETION = "sum_completion"        # commit.lua, adopt.lua: completion lengths of committed+truncated
                                             # +discarded (every request that ended: reserve.lua's mean)
    SUM_SQ_COMPLETION = "sum_sq_completion"  # their squares: reserve.lua's end-game spread
    TRUNCATED_TOKENS = "truncated_tokens"    # commit.lua: tokens of truncated results
    GENERATED_TOKENS = "generated_tokens"    # commit.lua, release.lua: everything the servers generated
    WASTED_TOKENS = "wasted_tokens"          # commit.lua, release.lua: generated for no kept row
    DISCARDED_TOKENS = "discarded_tokens"    # commit.lua: completion tokens of discarded answers (retried ones
                                             # too); by reason in keys.discards_key
    KEPT_TOKENS = "kept_tokens"              # commit.lua, adopt.lua: completion tokens of the rows (committed)


# Counted by the Lua scripts from a field name passed in ARGV (finish.lua ARGV[16],
# requeue.lua ARGV[3], reopen.lua ARGV[3]) rather than spelled in the script.
ENDING_STATS = frozenset({Stat.SKIPPED, Stat.FAILED, Stat.ALREADY_DONE, Stat.CAPTURED})
REQUEUE_STATS = frozenset({Stat.REQUEUED, Stat.RECOVERED, Stat.ABORTED})
REOPEN_STATS = frozenset({Stat.REOPENED, Stat.RETRIED_FAILED})


def discards_by_reason(raw: dict[Any, Any]) -> dict[str, dict[str, int]]:
    """The discards hash (``keys.discards_key``, written by commit.lua: ``<reason>`` -> answers,
    ``<reason>:tokens`` -> their completion tokens) as {reason: {"answers": n, "tokens": t}}, sorted."""
    flat: dict[str, int] = {}
    for k, v in raw.items():
        name = k.decode() if isinstance(k, bytes) else str(k)
        try:
            flat[name] = int(float(v.decode() if isinstance(v, bytes) else v))
        except (TypeError, ValueError):
            flat[name] = 0
    return {field: {"answers": flat[field], "tokens": flat.get(f"{field}:tokens", 0)}
            for field in sorted(flat) if not field.endswith(":tokens")}
