"""The producer's budget loop: a deadline and a total, split by weight, kept in each dataset's limit.

Every ``run.control_interval_s`` (and whenever a dataset's reading ends or it completes) it reads
the settings (shared/run_plan.py: live changes from another shell included), measures the
fleet's counted tok/s and the response times of the rows written, and writes each dataset's
effective budget as its Redis ``limit``: the ledger workers already obey, so they need nothing
new. Each change is logged as ``budget_total`` or ``budget_deadline`` in the automatic moves' log
(keys.CONTROL_AUTO_LOG, by ``producer (deadline pacing)``), apart from people's actions.

With a deadline the budgets are also *paced* (``_paced``): each dataset is held near its share
of the progress so far, so all reach their shares together at the end and a projection that
turns out wrong later (a fleet that slows) does not leave the early finishers over theirs.

With a deadline the loop has three phases (producer/run/allocation.py ``phase``): *run*, the
budgets are what the fleet can count before admissions stop, ``tail_s`` (the response-time
quantile) before the deadline; *drain*, admissions have stopped (limit = used: no crossing, no
withdrawal) and the last responses finish; *over*, what still runs is aborted (its prompt is
not done, so a later run sends it again).
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import redis

from budgetq.producer.run.allocation import (
    Claim,
    Latencies,
    RateMeter,
    admitted_floor,
    deadline_total,
    phase,
    prompts_allow,
    water_fill,
)
from budgetq.shared import budget, keys, run_plan
from budgetq.shared.config import Config, DatasetConfig
from budgetq.shared.control import log_action
from budgetq.shared.ends import eta, mean_counted, prompts_left
from budgetq.shared.ledger import read_ledgers
from budgetq.shared.scripts import run as run_script
from budgetq.shared.stats import Conf

if TYPE_CHECKING:
    from budgetq.producer.run.feed import Feed

log = logging.getLogger("budgetq.producer")
# A top-level "latency_s" of a row (inside strings JSON escapes the quote).
_LATENCY = re.compile(rb'(?<!\\)"latency_s":\s*([0-9.eE+-]+)')
# Until the fleet's rate is measured, a dataset without a budget of its own is not held back.
UNMEASURED = 10**15
SEED_BYTES = 1 << 20   # a restarted producer reads the last MiB of each output file for response times
# How far ahead of its share of the progress a paced dataset may run (a fraction of the progress).
PACE_SLACK = 0.05
# Who the control log names for this loop's moves (shared/control.py: apart from people's actions).
_ACTORS = {"deadline": "producer (deadline pacing)", "total": "producer (total split)"}


class _RowTail:
    """Response times of the rows appended to an output file since we last looked."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = max(0, path.stat().st_size - SEED_BYTES) if path.exists() else 0
        self._skip_partial = self.offset > 0

    def read(self) -> list[float]:
        try:
            size = self.path.stat().st_size
        except OSError:
            return []
        if size <= self.offset:
            return []
        with open(self.path, "rb") as fh:
            fh.seek(self.offset)
            data = fh.read(size - self.offset)
        end = data.rfind(b"\n") + 1  # only whole lines; the rest next time
        chunk = data[:end]
        self.offset += end
        if self._skip_partial:
            chunk = chunk[chunk.find(b"\n") + 1:]
            self._skip_partial = False
        out = []
        for line in chunk.split(b"\n"):
            found = _LATENCY.findall(line)
            if found:
                try:
                    out.append(float(found[-1]))
                except ValueError:
                    continue
        return out


def _changed_enough(old: int, new: int, st: budget.DatasetState, final: bool = False) -> bool:
    """A move worth writing (and logging): one that could change an admission soon.

    Far from its budget a dataset's room (limit - used - reserved) is large and a move of a few
    percent changes nothing yet; a move is written once it is a third of that room, or near the
    end one response (max_tokens) or 0.5% of the budget, whichever is smaller. So a run makes
    tens to a few hundred moves per dataset (each pace step is one), not one per control
    interval; any move that stops or frees admissions is written.

    ``final``: every dataset is complete (``BudgetLoop.settled``), so the shares are final and no
    more moves are coming: a dataset that stopped below its final share reopens for any rise that
    admits an answer (soft: above what it used; strict: room for max_tokens), so every soft share
    ends in ``[share, share + max_tokens)``.
    """
    room = max(0, old - st.used - st.reserved)
    step = max(1, min(st.max_tokens, max(old, new) // 200))
    reached = st.used + st.max_tokens > old if st.mode == "strict" else st.used >= old
    if reached and new > old and final:
        return new > st.used if st.mode != "strict" else new - st.used >= st.max_tokens
    if (new <= st.used + st.reserved) != (old <= st.used + st.reserved):
        return True
    return abs(new - old) >= max(step, room // 3)


class BudgetLoop:
    def __init__(self, conn: redis.Redis, cfg: Config) -> None:
        self.conn = conn
        self.cfg = cfg
        self.run_cfg = cfg.run
        self.datasets = {d.name: d for d in cfg.datasets}
        applied = run_plan.apply_config(conn, cfg.run.deadline, cfg.run.total_budget,
                                        {d.name: d.weight for d in cfg.datasets}, time.time())
        if applied:
            log.info("budgets: from the config: %s", ", ".join(applied))
        self.settings = run_plan.read_settings(conn)
        self.meter = RateMeter(cfg.run.rate_window_s)
        # A restarted producer starts with an empty meter: until it has measured the fleet again
        # (a fifth of rate_window_s and 20 results), the last producer's rate stands in, so the
        # deadline's budgets do not open to unlimited for that while.
        last = run_plan.read_state(conn) or {}
        seed = last.get("tok_s")
        self._seed_rate = float(seed) if isinstance(seed, int | float) and seed > 0 else None
        if self._seed_rate is not None and self.settings.deadline is not None:
            log.info("budgets: the fleet's rate is taken as the last producer's (%.0f tok/s) until it is measured "
                     "again", self._seed_rate)
        self.per_ds = {d.name: RateMeter(cfg.run.rate_window_s, min_results=5) for d in cfg.datasets}
        self.latencies = Latencies()
        self._tails = {d.name: _RowTail(cfg.output_dir / f"{d.name}.jsonl") for d in cfg.datasets}
        self._last = 0.0
        self._seen: tuple = ()
        self._phase = "none"
        self._aborted_for: float | None = None
        self._warned_past = False
        self.state: dict[str, Any] = {}

    @property
    def active(self) -> bool:
        """The run's limits are this loop's (a deadline or a total is set)."""
        return self.settings.managed

    # -- called by the producer ----------------------------------------------------------------
    def tick(self, feeds: Sequence[Feed]) -> None:
        now = time.time()
        seen = tuple((f.ended, f.complete) for f in feeds)
        tail = self._tail_s()
        due = now - self._last >= self.run_cfg.control_interval_s or seen != self._seen \
            or phase(now, self.settings.deadline, tail) != self._phase
        if not due:
            return
        self._last, self._seen = now, seen
        self.settings = run_plan.read_settings(self.conn)
        if not self.settings.managed:
            self._phase = "none"
            return
        self._recompute(now, feeds)

    # -- the work ------------------------------------------------------------------------------
    def _rate(self) -> float | None:
        """The fleet's counted tok/s: measured, else the last producer's (a restart), else None."""
        measured = self.meter.rate()
        if measured is not None:
            self._seed_rate = None
            return measured
        return self._seed_rate

    def _tail_s(self) -> float:
        return self.latencies.quantile(self.run_cfg.tail_quantile) or 0.0

    def _read(self, names: list[str]) -> dict[str, Any]:
        pipe = self.conn.pipeline(transaction=False)
        for n in names:
            budget.queue_state_commands(pipe, n)
            pipe.llen(keys.rq_queue_key(n))
        replies = pipe.execute()
        per = budget.STATE_REPLIES + 1
        out = {}
        for i, n in enumerate(names):
            chunk = replies[i * per:(i + 1) * per]
            out[n] = (budget.parse_state(n, chunk[:budget.STATE_REPLIES]), int(chunk[-1]))
        return out

    def settled(self, feeds: Sequence[Feed]) -> bool:
        """Every dataset is complete: recompute once more (what one that finished below its share
        left goes to the others); False if that raised a finished dataset's budget (it reopens)."""
        self.settings = run_plan.read_settings(self.conn)
        if not self.settings.managed:
            return True
        raised = self._recompute(time.time(), feeds, final=True)
        return not any(f.halted and f.ds.name in raised for f in feeds)

    def _recompute(self, now: float, feeds: Sequence[Feed], final: bool = False) -> set[str]:
        names = [f.ds.name for f in feeds]
        states = self._read(names)
        for rows in self._tails.values():
            for s in rows.read():
                self.latencies.add(s)
        counted = sum(st.used for st, _q in states.values())
        results = sum(st.stats.get("committed", 0) for st, _q in states.values())
        self.meter.add(now, counted, results)
        for n, (st, _q) in states.items():
            self.per_ds[n].add(now, st.used, st.stats.get("committed", 0))
        rate = self._rate()
        tail = self._tail_s()
        deadline = self.settings.deadline
        ph = phase(now, deadline, tail)
        if ph == "run" and deadline is not None and run_plan.drain_deadline(self.conn) == deadline:
            ph = "drain"  # once admissions stopped for this deadline, they stay stopped (tail_s moves)
        self._phase = ph
        ledgers = read_ledgers(self.conn, names)
        claims = []
        for f in feeds:
            st, queued = states[f.ds.name]
            claims.append(self._claim(f, st, queued, ledgers[f.ds.name]))
        in_flight = sum(st.reserved for st, _q in states.values())
        totals: list[tuple[int, str]] = []
        if self.settings.total_budget is not None:
            totals.append((self.settings.total_budget, "total"))
        if deadline is not None and ph == "run" and rate is not None:
            totals.append((deadline_total(counted, in_flight, rate, now, deadline, tail), "deadline"))
        limits: dict[str, int] = {}
        reason = "total"
        if ph in ("drain", "over"):
            reason = "deadline"
            limits = {n: min(st.limit, st.used) if st.in_flight else st.used for n, (st, _q) in states.items()}
            if ph == "drain" and run_plan.drain_deadline(self.conn) != deadline:
                run_plan.mark_drain(self.conn, deadline)
                log.info("deadline %s: admissions stop now, %.1f s before it (the %.0f%% response time); "
                         "%d requests in flight finish", run_plan.format_when(deadline), deadline - now if deadline
                         else 0, 100 * self.run_cfg.tail_quantile, sum(st.in_flight for st, _q in states.values()))
        elif totals:
            total, reason = min(totals)
            limits = water_fill(total, claims)
            if reason == "deadline":
                limits = self._paced(limits, states, claims)
        elif deadline is not None:
            # A deadline, no rate measured yet (the first responses): nothing binds but each
            # dataset's own budget, until the fleet's rate is known.
            limits = {c.name: UNMEASURED if c.cap is None else c.cap for c in claims}
            reason = "deadline"
        raised = self._write(limits, states, reason, final)
        if ph == "over":
            self._abort_at_deadline(states, deadline)
        self._publish(now, states, ledgers, limits, rate, tail, ph)
        return raised

    def _paced(self, shares: dict[str, int], states: dict[str, Any], claims: list[Claim]) -> dict[str, int]:
        """Keep every dataset near its share of the progress so far, so that all reach their
        shares together at the end, whatever the projection's error then.

        Workers claim from every queue in turn, so a dataset of small weight would otherwise
        reach its share early, on the projection of that moment, and a fleet that slows later
        leaves it over its share. Its limit is its share of what has been admitted (counted +
        in flight) plus room (``PACE_SLACK`` of that progress, never less than two control
        intervals of the fleet's tokens): a dataset ahead of that waits (WAIT: parked, its slots
        serve the others), one behind admits. The room grows with the progress, not with what is
        left, so the shares hold all along: a deadline moved in from another shell, or a fleet
        that slows, finds no dataset far ahead of its share; and a limit moves in steps of a
        share of the progress, so a run of any length makes a few hundred moves, not one per
        interval. Never below used + in flight + half an answer: a
        dataset held back does not cross its limit. A dataset held at its cap (its own budget,
        or what its prompts allow) is not paced: it cannot take more than that anyway.
        """
        capped = {c.name for c in claims if c.cap is not None and shares[c.name] >= c.cap}
        paced = [n for n in shares if n not in capped]
        progress = sum(states[n][0].used + states[n][0].reserved for n in paced)
        total = sum(shares[n] for n in paced)
        if total <= 0 or progress <= 0:
            return shares
        rate = self._rate() or 0.0
        room = max(PACE_SLACK * progress, 2 * self.run_cfg.control_interval_s * rate)
        out = dict(shares)
        for n in paced:
            st, _q = states[n]
            committed = st.stats.get("committed", 0)
            mean = st.stats.get("sum_tokens", 0) / committed if committed else float(st.prior_mean or 1)
            pace = int(shares[n] * min(1.0, (progress + room) / total))
            out[n] = min(shares[n], max(pace, st.used + st.reserved + int(mean // 2)))
        return out

    def _claim(self, f: Feed, st: budget.DatasetState, queued: int, ledger: dict[str, Any]) -> Claim:
        ds: DatasetConfig = f.ds
        cap = ds.budget
        can = self._prompts_allow(f, st, queued, ledger)
        if can is not None:
            cap = can if cap is None else min(cap, can)
        floor = admitted_floor(st.used, st.reserved, st.limit)
        return Claim(ds.name, self.settings.weight(ds.name), floor=floor, cap=cap)

    @staticmethod
    def _prompts_allow(f: Feed, st: budget.DatasetState, queued: int, ledger: dict[str, Any]) -> int | None:
        """What the dataset's prompts let it count in all; None while that is unknown.

        Out of prompts (every row read, nothing queued, running or skipped): exactly what it used, so
        the rest of its share goes to the others. A dataset that stopped at its budget is *not* out
        of prompts: its skipped and unread prompts can still run, so when a short dataset leaves
        more to share, its budget rises and it reopens (the producer requeues what it skipped).
        While prompts are left and their number is known, an upper estimate (``prompts_allow``):
        a short dataset's shortfall goes to the others early, before any of them reaches a share
        it would later outgrow.
        """
        skipped = int(ledger.get("skipped") or 0)
        if f.complete and f.ended and not f.pending and skipped == 0:
            return st.used
        if f.ds.regenerate != "last":  # (regenerate: all: requests per job vary; known once it completes)
            return None
        unread = ledger.get("unread")
        if not f.ended and (unread is None or ledger.get("unread_estimated")):
            return None  # a file whose size is not known yet, or a row limit: no estimate
        left = queued + skipped + (len(f.pending) if f.ended else int(unread or 0))
        answered = st.stats.get("committed", 0) + st.stats.get("truncated", 0)
        mean = max(mean_counted(st), float(st.prior_mean or 1))
        sd = 0.0
        if answered:
            m1 = st.stats.get("sum_completion", st.stats.get("sum_tokens", 0)) / answered
            sd = max(0.0, st.stats.get("sum_sq_completion", 0) / answered - m1 * m1) ** 0.5
        per = None if st.count == "total" else (st.max_tokens or None)  # total: prompt tokens count too
        return prompts_allow(st.used, st.reserved, st.in_flight, left, mean, sd, per)

    def _write(self, limits: dict[str, int], states: dict[str, Any], reason: str, final: bool = False) -> set[str]:
        """Write the limits that moved enough (``final``: see ``_changed_enough``); returns the datasets whose
        limit rose."""
        raised = set()
        for n, new in limits.items():
            st, _q = states[n]
            old = st.limit
            if new == old or not _changed_enough(old, new, st, final):
                continue
            self.conn.hset(keys.conf_key(n), Conf.LIMIT, new)
            log_action(self.conn, f"budget_{reason}", n, old, new, actor=_ACTORS[reason])
            if new > old:
                raised.add(n)
        return raised

    def _abort_at_deadline(self, states: dict[str, Any], deadline: float | None) -> None:
        if self._aborted_for == deadline:
            return
        self._aborted_for = deadline
        running = {n: st.in_flight for n, (st, _q) in states.items() if st.in_flight}
        for n in running:
            aborted = run_script(self.conn, budget.withdraw(n))
            log_action(self.conn, "abort", n, new=f"{aborted} requests in flight at the deadline",
                       actor="producer (deadline passed)")
        if running:
            log.warning("deadline %s passed: aborted %s requests still running; their prompts are not done and "
                        "a later run sends them again", run_plan.format_when(deadline),
                        ", ".join(f"{n}: {k}" for n, k in running.items()))
        elif not self._warned_past:
            log.info("deadline %s passed: nothing more is admitted (`budgetq budget deadline` sets a new one)",
                     run_plan.format_when(deadline))
        self._warned_past = True

    def _publish(self, now: float, states: dict[str, Any], ledgers: dict[str, dict[str, Any]],
                 limits: dict[str, int], rate: float | None, tail: float, ph: str) -> None:
        ds_out = {}
        deadline = self.settings.deadline
        for n, (st, queued) in states.items():
            limit = limits.get(n, st.limit)
            r = self.per_ds[n].rate()
            # The first of its ends (shared/ends.py): this limit, its prompts, the deadline.
            end = eta(limit - st.used, r, prompts_left(ledgers[n]), mean_counted(st),
                      None if deadline is None else deadline - now)
            finish = None if end.seconds is None else now + end.seconds
            ds_out[n] = {"weight": self.settings.weight(n), "limit": limit, "used": st.used,
                         "reserved": st.reserved, "queued": queued, "tok_s": None if r is None else round(r, 2),
                         "projected_finish": None if finish is None else round(finish, 3)}
        self.state = {"at": round(now, 3), "phase": ph, "deadline": self.settings.deadline,
                      "total_budget": self.settings.total_budget,
                      "tok_s": None if rate is None else round(rate, 2), "tail_s": round(tail, 3),
                      "tail_quantile": self.run_cfg.tail_quantile, "latencies": len(self.latencies),
                      "datasets": ds_out}
        run_plan.write_state(self.conn, self.state)
