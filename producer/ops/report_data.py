"""What `budgetq report` shows, gathered: the output directory first (the rows, truncated and
invalid files, the run log), Redis where it is still there (ledger, control logs, the producer).

Everything the report draws is computed here, once; producer/ops/report.py only renders it (the
page's tables and its plots show the same numbers, and tests/test_report.py recounts them from
the rows on its own).
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis

from budgetq.producer.ops.report_files import Answers, number, read_answers, read_invalid, read_run_log
from budgetq.producer.ops.report_log import MAX_EVERY_S, run_log_path
from budgetq.shared.config import Config
from budgetq.shared.errors import BudgetqError

HIST_BINS = 40
# The producer's own budget moves (an older producer logged them with people's).
AUTO_ACTIONS = ("budget_total", "budget_deadline")


@dataclass
class DsReport:
    name: str
    budget: int | None
    weight: float
    prior_mean: int | None
    max_tokens: int
    count: str
    kept: Answers
    truncated: Answers                                    # keep: complete's file of cut answers
    invalid: Counter[str]
    ledger: dict[str, Any] | None = None
    wasted: int | None = None
    used: int | None = None
    timeline: list[tuple[float, int, int]] = field(default_factory=list)  # (t, used, budget)
    by_reason: dict[str, int] | None = None   # discarded answers by reason (commit.lua's discards hash)

    @property
    def discarded(self) -> dict[str, int] | None:
        return dict(self.by_reason) if self.by_reason else discarded_by_reason(self.ledger)

    @property
    def answers(self) -> int:
        return self.kept.rows + self.truncated.rows

    @property
    def cut(self) -> int:
        """Answers cut by max_tokens: kept ones with finish_reason length, and the truncated file's."""
        return self.kept.cut + self.truncated.rows

    @property
    def cut_share(self) -> float | None:
        return self.cut / self.answers if self.answers else None

    @property
    def mean(self) -> float | None:
        n = self.answers
        return (sum(self.kept.lengths) + sum(self.truncated.lengths)) / n if n else None

    def histogram(self) -> tuple[list[int], list[int]]:
        """Bin edges and counts of every answer's completion_tokens (kept and truncated).

        Whole-token bins, each [lo, hi): a reader (and the report's test) can count the rows of a
        bin from the edges the page prints, with no float edge that rounds either way."""
        lengths = self.kept.lengths + self.truncated.lengths
        top = max([self.max_tokens, *lengths])
        width = top // HIST_BINS + 1              # HIST_BINS * width > top: every length has a bin
        edges = [i * width for i in range(HIST_BINS + 1)]
        counts = [0] * HIST_BINS
        for n in lengths:
            counts[max(0, n) // width] += 1
        return edges, counts


@dataclass
class RunData:
    out_dir: Path
    datasets: list[DsReport]
    starts: list[dict[str, Any]]
    samples: list[dict[str, Any]]
    events: list[dict[str, Any]]
    end: dict[str, Any] | None                            # the last `produce`'s end, if it was the last word
    state: str                                            # complete | stopped | going | no-end
    state_line: str
    redis: bool
    run_log: bool
    managed: bool                                         # a deadline or total splits by weight

    def fleet_rate(self) -> list[tuple[float, float, int]]:
        """(t, tok/s, workers) between samples of one `produce` (a restart is a gap, not a spike)."""
        out: list[tuple[float, float, int]] = []
        prev: dict[str, Any] | None = None
        for s in self.samples:
            if s["kind"] != "sample":
                prev = None   # a start or an end: the time between two producers is no rate
                continue
            total = sum(d.get("used", 0) for d in s["ds"].values())
            if prev is not None and s["t"] > prev["t"]:
                out.append((s["t"], max(0.0, (total - prev["total"]) / (s["t"] - prev["t"])), s.get("workers", 0)))
            prev = {"t": s["t"], "total": total}
        return out

    def run_tok_s(self, dataset: str | None = None) -> float | None:
        """Counted tokens per second (of the fleet, or of one dataset) over the time a producer ran:
        the gap between a producer's death and the next start is left out."""
        span = tokens = 0.0
        prev: tuple[float, int] | None = None
        for s in self.samples:
            if s["kind"] != "sample":
                prev = None
                continue
            ds = s["ds"] if dataset is None else {dataset: s["ds"].get(dataset, {})}
            total = sum(d.get("used", 0) for d in ds.values())
            if prev is not None:
                span += s["t"] - prev[0]
                tokens += total - prev[1]
            prev = (s["t"], total)
        return tokens / span if span > 0 else None

    def marks(self) -> list[tuple[float, str]]:
        """What happened when, for the plots: producer starts, restarts and deaths, workers lost,
        and every control-log move (pause, resume, budget, weight, deadline, total)."""
        out: list[tuple[float, str]] = []
        prev: dict[str, Any] | None = None
        open_start = False
        for r in self.samples:
            if r["kind"] == "end":
                open_start = False   # this producer ended in order: a next start is a restart, no death
                continue
            if r["kind"] == "start":
                if open_start and prev is not None:
                    out.append((prev["t"], "producer died"))
                out.append((r["t"], "produce restarted" if any(m[1].startswith("produce") for m in out)
                            else "produce started"))
                open_start = True
                prev = None
                continue
            if prev is not None and r.get("workers", 0) < prev.get("workers", 0):
                out.append((r["t"], f"workers {prev['workers']} -> {r['workers']}"))
            prev = r
        for e in self.events:
            # People's moves, and the producer's abort at the deadline; its automatic budget moves
            # (hundreds over a long run) are the budget's steps in the plot, not marks.
            person = e.get("source") == "operator" and e.get("action") not in AUTO_ACTIONS
            if person or e.get("action") == "abort":
                new = "" if e.get("action") in ("pause", "resume") else e.get("new") or ""   # (new: True/False)
                out.append((e["t"], f"{e.get('action')} {e.get('dataset') or ''} {new}".strip()))
        return sorted(out)


def discarded_by_reason(ledger: dict[str, Any] | None) -> dict[str, int] | None:
    """Prompts discarded, by reason, where the ledger records them (the ``discarded``
    state: a count, or counts by reason); None where it has no such state. Nothing is guessed
    from the rows: a budgetq that does not discard has nothing to show here."""
    v = (ledger or {}).get("discarded")
    if isinstance(v, dict):
        return {str(k): int(n) for k, n in v.items() if number(n)}
    if number(v) and int(v or 0) > 0:
        return {"(all reasons)": int(v or 0)}
    return None


def answers_by_reason(raw: dict[str, Any] | None) -> dict[str, int] | None:
    """status's ``discarded_by_reason`` ({reason: {"answers", "tokens"}}) as {reason: answers}."""
    if not isinstance(raw, dict):
        return None
    return {str(k): int(v.get("answers") or 0) for k, v in raw.items() if isinstance(v, dict)}


def _from_redis(conn: redis.Redis, names: list[str]) -> dict[str, Any]:
    from budgetq.shared import keys, presence, run_plan
    from budgetq.shared.budget import dataset_state
    from budgetq.shared.ledger import read_ledgers
    from budgetq.shared.stats import Stat, discards_by_reason
    from budgetq.shared.status import control_entries

    ledgers = read_ledgers(conn, names)
    states = {n: dataset_state(conn, n) for n in names}
    events = []
    for auto in (False, True):
        for e in control_entries(conn, n=1000, auto=auto):
            events.append({"kind": "event", "id": f"{'auto' if auto else 'operator'}:{e['id']}", "t": e["ts"] or 0.0,
                           "source": "auto" if auto else "operator", **{k: e[k] for k in
                                                                         ("who", "action", "dataset", "old", "new")}})
    return {"ledgers": ledgers, "used": {n: s.used for n, s in states.items()},
            "budget": {n: s.limit for n, s in states.items()},
            "wasted": {n: s.stats.get(Stat.WASTED_TOKENS, 0) for n, s in states.items()},
            "events": events, "producer": presence.read(conn), "managed": run_plan.read_settings(conn).managed,
            "weights": run_plan.read_settings(conn).weights,
            "discards": {n: answers_by_reason(discards_by_reason(conn.hgetall(keys.discards_key(n)))) for n in names}}


# Without Redis, a run log whose last line is this recent is taken for a run still going (a
# producer samples at least every report_log.MAX_EVERY_S while it runs).
RECENT_S = 3 * MAX_EVERY_S


def _state(recs: list[dict[str, Any]], live: dict[str, Any] | None, now: float) -> tuple[str, str]:
    """(state, the line the report opens with): complete, stopped, going or no-end."""
    last_start = max((i for i, r in enumerate(recs) if r["kind"] == "start"), default=-1)
    end = next((r for r in recs[last_start + 1:] if r["kind"] == "end"), None) if last_start >= 0 else None
    producer = (live or {}).get("producer")
    if producer:
        return "going", (f"RUN STILL GOING (producer {producer.get('host')}:{producer.get('pid')}): this report "
                         "is a snapshot; `budgetq report` again, or the report `produce` writes at its end, has more")
    if end is not None:
        if end["report"].get("complete"):
            return "complete", "run complete: every dataset is at its end"
        return "stopped", "run stopped before its end: `budgetq produce` again continues it"
    if not recs:
        return "no-end", ("no run log (run-log.jsonl, written by `budgetq produce` since the run report came): "
                          "whether the run is over is not known; the rows are all this report has")
    if live is not None:
        return "no-end", ("no producer is running and the run log has no end: its producer died; "
                          "`budgetq produce` continues the run")
    age = now - recs[-1]["t"]
    if age < RECENT_S:
        return "going", (f"RUN STILL GOING, by the run log (its last line {age:.0f} s old; Redis not reachable): "
                         "this report is a snapshot")
    return "no-end", (f"the run log has no end, its last line is {age:.0f} s old and Redis is not reachable: "
                      "the producer died or lost Redis; `budgetq produce` continues the run")


def _registered(conn: redis.Redis, names: list[str]) -> bool:
    """Whether this Redis holds the run's datasets at all (a flushed or other Redis does not)."""
    from budgetq.shared import keys

    pipe = conn.pipeline(transaction=False)
    for n in names:
        pipe.exists(keys.conf_key(n))
    return any(pipe.execute())


def check_dir(cfg: Config) -> None:
    """The output directory has something of a run: a BudgetqError naming what is missing if not
    (called before Redis is tried, so a wrong directory is the one line said)."""
    out_dir = Path(cfg.output_dir)
    names = [d.name for d in cfg.datasets]
    if not names:
        raise BudgetqError("no datasets in the config: the report draws the config's datasets (-c CONFIG)")
    if not out_dir.is_dir():
        raise BudgetqError(f"output_dir {out_dir}: missing (no run has written there)")
    if not run_log_path(out_dir).exists() and not any((out_dir / f"{n}.jsonl").exists() for n in names):
        raise BudgetqError(f"output_dir {out_dir}: no {run_log_path(out_dir).name} and no rows file "
                           f"({', '.join(f'{n}.jsonl' for n in names)}): no run has written here")


def gather(cfg: Config, conn: redis.Redis | None, keep: bool = False) -> RunData:
    """Everything the report shows. A bad or partial output directory is a BudgetqError naming the
    file (and line) that is missing or wrong: the CLI prints it as one line. ``keep``: for a process
    that draws it again (read_answers)."""
    check_dir(cfg)
    out_dir = Path(cfg.output_dir)
    names = [d.name for d in cfg.datasets]
    log_path = run_log_path(out_dir)
    recs = read_run_log(log_path)
    if conn is not None and not _registered(conn, names):
        conn = None   # a flushed Redis, or another run's: the output directory alone tells this run
    live = _from_redis(conn, names) if conn is not None else None
    state, line = _state(recs, live, time.time())
    samples = [r for r in recs if r["kind"] in ("sample", "start", "end")]
    last = next((r for r in reversed(recs) if r["kind"] == "sample"), None)
    ends = [r for r in recs if r["kind"] == "end"]
    end_rows = {d["dataset"]: d for d in ends[-1]["report"].get("datasets", [])} if ends else {}
    datasets = []
    for d in cfg.datasets:
        n = d.name
        kept = read_answers(out_dir / f"{n}.jsonl", d.count, keep)
        seen = (last or {}).get("ds", {}).get(n, {})
        r = DsReport(n, d.budget, d.weight, d.prior_mean_tokens, d.sampling.max_tokens, d.count, kept,
                     read_answers(out_dir / f"{n}.truncated.jsonl", d.count, keep),
                     read_invalid(out_dir / f"{n}.invalid.jsonl"))
        if live is not None:
            r.ledger, r.used, r.wasted = live["ledgers"][n], live["used"][n], live["wasted"][n]
            r.weight, r.budget = live["weights"].get(n, r.weight), live["budget"][n]
            r.by_reason = live["discards"][n]
        else:   # Redis gone: the last word the run log has
            r.ledger = seen.get("ledger") or end_rows.get(n)
            r.used = seen.get("used")
            r.wasted = (seen.get("tokens") or {}).get("wasted", end_rows.get(n, {}).get("wasted_tokens"))
            r.weight, r.budget = seen.get("weight", r.weight), seen.get("budget", r.budget)
            r.by_reason = answers_by_reason(seen.get("discarded_by_reason"))
        # Rows the run counted but the directory lacks: a partial copy. (While a producer runs, its
        # newest rows may not be collected yet, so only a run that is not going is checked.)
        said = int((r.ledger or {}).get("rows") or 0)
        if state != "going" and said > 0 and kept.rows == 0:
            raise BudgetqError(f"{out_dir / (n + '.jsonl')}: missing or empty, but the run counted {said:,} rows "
                               f"of {n} ({'Redis' if live is not None else log_path.name}): a partial output "
                               "directory?")
        r.timeline = [(s["t"], s["ds"][n]["used"], s["ds"][n]["budget"]) for s in samples
                      if s["kind"] == "sample" and n in s["ds"]]
        datasets.append(r)
    events = {e["id"]: e for e in recs if e["kind"] == "event"}
    for e in (live or {}).get("events", []):
        events.setdefault(e["id"], e)
    managed = live["managed"] if live is not None else any(
        s.get("deadline") is not None or s.get("total") is not None for s in samples if s["kind"] == "sample")
    return RunData(out_dir, datasets, [r for r in recs if r["kind"] == "start"], samples,
                   sorted(events.values(), key=lambda e: e["t"]), ends[-1] if ends else None, state, line,
                   live is not None, bool(recs), managed)
