"""How a dataset ends, said in one place: why it stopped (or is stopping), how long until it does
(the ETA), and whether a run is complete.

A dataset ends at the first of its three ends: its budget, its prompts (every row of the file
read and sent), or the run's deadline. ``stop_reason`` names the one that ended it, or what keeps
it from moving (held, paused, interrupted), or ``running``; ``eta`` is the time to the first end
still ahead. `budgetq produce`'s summary and exit status, `budgetq status` (table and --json),
/metrics, the monitor page and the progress lines all call these functions and nothing else.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from budgetq.shared.budget import DatasetState
from budgetq.shared.ledger import is_settled

# Until this many results are in, the prompts' end is projected at the dataset's prior mean
# (prior_mean_tokens) rather than at the mean of the few answers measured so far.
MEASURED_AFTER = 20


class Stop(enum.StrEnum):
    """Why a dataset stopped, or what it is doing; the first three are ends (the run is complete
    once every dataset has reached one and nothing of it is queued or running)."""

    BUDGET = "budget reached"        # no new request admitted: used reached the budget
    DEADLINE = "deadline"            # the run's deadline stopped admissions (docs/budget.md)
    OUT_OF_PROMPTS = "out of prompts"  # every row of the file read, nothing left to send
    HELD = "held"                    # the producer holds admissions (output disk full or read-only)
    PAUSED = "paused"                # an operator paused it (`budgetq resume` goes on)
    INTERRUPTED = "interrupted"      # the producer was stopped (SIGINT/SIGTERM) before it ended
    RUNNING = "running"              # none of the above: it goes on


ENDS = frozenset({Stop.BUDGET, Stop.DEADLINE, Stop.OUT_OF_PROMPTS})


def stop_reason(st: DatasetState, ledger: dict[str, Any], deadline_stopped: bool = False,
                producer_gone: bool = False) -> Stop:
    """The one reason for ``st`` (its Redis state) with ``ledger`` (shared/ledger.py).

    ``deadline_stopped``: the run has a deadline and its admissions stopped for it
    (shared/run_plan.py ``deadline_stopped``). The ends, in this order: the prompts (every row
    read, none left to send: not queued, not skipped for the budget), the deadline, the budget;
    a dataset that reached its own budget (the config's, not a limit the deadline's pacing set)
    ended by its budget even once the deadline has passed.
    An end with nothing queued or running is the reason whatever else holds; before that a hold
    or a pause comes first (they say what to do), then the end it drains toward, then a
    producer stopped before any end (``interrupted``): on request, or gone without a word
    (``producer_gone``: its key expired, shared/presence.py).
    """
    end: Stop | None = None
    if st.source_ended and ledger["queued"] == 0 and ledger["skipped"] == 0:
        end = Stop.OUT_OF_PROMPTS
    elif deadline_stopped and not st.own_budget_reached:
        end = Stop.DEADLINE
    elif st.exhausted or deadline_stopped:  # (its own budget came before the deadline)
        end = Stop.BUDGET
    if end is not None and is_settled(ledger):
        return end
    if st.hold:
        return Stop.HELD
    if st.operator_paused:
        return Stop.PAUSED
    if end is not None:
        return end
    return Stop.INTERRUPTED if st.interrupted or producer_gone else Stop.RUNNING


def is_complete(stop: Stop | str, ledger: dict[str, Any]) -> bool:
    """The dataset reached an end and every prompt of it has ended (nothing queued or running)."""
    return Stop(stop) in ENDS and is_settled(ledger)


def prompts_left(ledger: dict[str, Any]) -> int | None:
    """Prompts still to answer: queued, running, and the rows not read yet (None while the file's
    size is unknown and reading has not ended)."""
    if ledger.get("unread") is None:
        return None
    return int(ledger["queued"] + ledger["running"] + ledger["unread"])


def mean_counted(st: DatasetState) -> float:
    """Counted tokens per answered prompt: measured once MEASURED_AFTER results are in, else the
    dataset's prior mean (prior_mean_tokens). A prompt that ended discarded is answered too (with
    budget_counts kept it counted nothing: the prompts a budget needs grow with the discards)."""
    answered = st.stats.get("committed", 0) + st.stats.get("truncated", 0) + st.stats.get("discarded", 0)
    if answered >= MEASURED_AFTER:
        return st.stats.get("sum_tokens", 0) / answered
    return float(max(1, st.prior_mean))


def mean_response(st: DatasetState) -> float | None:
    """Measured mean response length (completion tokens) over every answer that ended, cut and
    discarded ones included (commit.lua's sum_completion); None before the first."""
    answered = (st.stats.get("committed", 0) + st.stats.get("truncated", 0) + st.stats.get("discarded", 0)
                + st.stats.get("discard_retried", 0))
    return st.stats.get("sum_completion", 0) / answered if answered else None


@dataclass(frozen=True)
class Eta:
    """Seconds to the dataset's end (None: unknown) and which end comes first: ``budget``,
    ``prompts`` or ``deadline`` (None with no ETA)."""

    seconds: float | None
    by: str | None


def tokens_to_end(budget_left: float, left: int | None, mean: float) -> tuple[float, str]:
    """Tokens still to count before the dataset ends, and which end that is: the rest of its budget,
    or what the prompts left bring at ``mean`` tokens each, whichever is fewer."""
    if left is not None and left * mean < budget_left:
        return float(left * mean), "prompts"
    return float(max(0.0, budget_left)), "budget"


def eta(budget_left: float, tok_s: float | None, left: int | None, mean: float,
        deadline_in_s: float | None = None) -> Eta:
    """The time to the first of the dataset's ends at ``tok_s`` counted tokens per second: its
    budget, its prompts (``left`` of them, ``mean`` tokens each), the run's deadline (``deadline_in_s``
    from now). 0 once the budget is reached (the last requests drain). Without a rate only the
    deadline is known."""
    tokens, by = tokens_to_end(budget_left, left, mean)
    seconds: float | None
    if budget_left <= 0:
        seconds, by = 0.0, "budget"
    elif tok_s:
        seconds = tokens / tok_s
    else:
        seconds = None
    if deadline_in_s is not None and (seconds is None or deadline_in_s < seconds):
        seconds, by = max(0.0, deadline_in_s), "deadline"
    return Eta(seconds, by if seconds is not None else None)


def dataset_eta(st: DatasetState, ledger: dict[str, Any], tok_s: float | None,
                deadline_in_s: float | None = None) -> Eta:
    """``eta`` of a dataset from its Redis state and ledger."""
    return eta(st.limit - st.used, tok_s, prompts_left(ledger), mean_counted(st), deadline_in_s)
