"""Budget precision: where each policy lands, what it wastes, and how long its tail is.

    python bench/budget_precision.py [--quick | --smoke] [--speedup S] [--budget 10M]

One run of the whole pipeline (private Redis, `budgetq sim`, one `budgetq worker` process
holding N requests in flight, `budgetq produce`) per policy (drain = the seed's naive policy,
soft, strict) and N (32, 128, 256), back to back against one SGLang-like simulator
(256 running requests, 20k tok/s peak, sped up). Two datasets, each with its own budget:
A1 (mean 1,577) and B2 (mean 3,793), lognormal sigma 1.0 (heavy tail), max_tokens 8,192.

Per dataset: final used (Redis), waste (tokens the simulator generated for the dataset's rids,
`<dataset>-<prompt id>`, minus the tokens kept in out/<dataset>.jsonl: aborted requests and
results rejected after the budget was crossed), and the time from 95% of the budget to done.
"95%" is when the kept results, in the order the simulator finished them, add up to 95% of
the budget; "done" is when the dataset's last request left the simulator. The ideal is 5%
of the budget at the dataset's own recent rate (kept tokens/s while it went from 80% to 90%
of its budget: after the other dataset may have finished, before soft mode tapers).
Simulated seconds = wall seconds x speed-up.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import threading
import time
from dataclasses import dataclass

import _common as c

from budgetq.shared import keys
from budgetq.shared.identity import job_id
from budgetq.shared.tokens import format_tokens, parse_tokens

MEANS = {"A1": 1577, "B2": 3793}
SIGMA = 1.0
MAX_TOKENS = 8192
POLICIES = ("drain", "soft", "strict")
# invariant I4 (docs/architecture.md):
SOFT_SLACK = 10_000  # soft lands within [budget, budget + 10k] on 10M at 256 in flight


@dataclass
class Settings:
    budget: int
    speedup: float
    concurrencies: tuple[int, ...]
    control_interval_s: float
    policies: tuple[str, ...] = POLICIES
    workers: int = 1


@dataclass
class Outcome:
    policy: str
    in_flight: int
    sim_running: float      # median requests running at the simulator during the run's middle
    worker_peak: int | str
    ds: str
    budget: int
    used: int
    generated: int          # the simulator's tokens for this dataset
    tail_s: float           # wall seconds from 95% of the budget to done
    ideal_s: float          # wall seconds the last 5% takes at the steady rate
    speedup: float

    @property
    def waste(self) -> int:
        return self.generated - self.used

    def target(self) -> str:
        if self.policy == "strict":
            ok = self.budget - MAX_TOKENS <= self.used <= self.budget
            return f"[B-8192, B]: {'met' if ok else 'missed'}"
        if self.policy == "soft" and self.in_flight == 256:
            ok = self.budget <= self.used <= self.budget + SOFT_SLACK
            return f"[B, B+10k]: {'met' if ok else 'missed'}"
        return "-"

    def row(self) -> list[object]:
        return [self.policy, self.in_flight, self.sim_running, self.worker_peak, self.ds, format_tokens(self.budget),
                self.used, f"{self.used / self.budget:.5f}", self.used - self.budget, self.generated, self.waste,
                f"{100 * self.waste / max(1, self.generated):.2f}%", *self._tail_cells(), self.target()]

    def _tail_cells(self) -> list[object]:
        if not math.isfinite(self.tail_s):  # strict may stop short of 95%: no tail to time
            return ["-", "-", "-", "-"]
        ideal = self.ideal_s if math.isfinite(self.ideal_s) else 0.0
        return [self.tail_s, self.tail_s * self.speedup, ideal * self.speedup,
                self.tail_s / ideal if ideal else "-"]


HEADERS = ["policy", "in flight", "sim running (median)", "worker peak (sum)", "dataset", "budget", "final used",
           "used/budget", "used - budget", "sim generated", "waste tokens", "waste %", "95%->done wall s",
           "95%->done sim s", "ideal sim s", "ratio to ideal", "target"]


class Sampler(threading.Thread):
    """Samples the simulator's running count every quarter second, to check the in-flight level."""

    def __init__(self, sim: c.Sim) -> None:
        super().__init__(daemon=True)
        self.sim = sim
        self.samples: list[tuple[float, int]] = []
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(0.25):
            try:
                self.samples.append((time.time(), self.sim.stats()["running"]))
            except OSError:
                pass


def rows_needed(budget: int, mean: int) -> int:
    """Enough prompts for the budget plus a drain overshoot, whatever the cap does to the mean."""
    return int(budget / mean * 1.4) + 2000


def crossing_times(kept: list[dict], budget: int, fractions: tuple[float, ...]) -> list[float]:
    """When the kept tokens, in finish order, first reach each fraction of the budget (unix time)."""
    out, total, i = [], 0, 0
    ordered = sorted(kept, key=lambda r: r["finished"])
    for f in fractions:
        while i < len(ordered) and total < f * budget:
            total += ordered[i]["completion_tokens"]
            i += 1
        out.append(ordered[i - 1]["finished"] if total >= f * budget else float("nan"))
    return out


def analyse(ds: str, budget: int, records: list[dict], kept_ids: set[str]) -> tuple[int, float, float]:
    """(generated tokens, wall s 95%->done, ideal wall s) of one dataset from the simulator's records."""
    mine = [r for r in records if r["rid"].startswith(f"{ds}--")]
    kept_jobs = {job_id(ds, k) for k in kept_ids}
    kept = [r for r in mine if r["rid"].split(".")[0] in kept_jobs]  # rid = job id [+ ".<attempt>"]
    generated = sum(r["completion_tokens"] for r in mine)
    t80, t90, t95 = crossing_times(kept, budget, (0.80, 0.90, 0.95))
    done = max(r["finished"] for r in mine)
    rate = 0.10 * budget / max(1e-6, t90 - t80)
    return generated, done - t95, 0.05 * budget / rate


def in_flight_median(samples: list[tuple[float, int]], records: list[dict], total_budget: int, n: int) -> float:
    """Median running at the simulator from ramp-up until 90% of all budgets were kept (the tail left out)."""
    finished = [r for r in records if r["finish"] not in ("abort", "drop")]
    until = crossing_times(finished, total_budget, (0.9,))[0]
    middle = [k for t, k in samples if not until < t] or [0]
    ramped = next((i for i, k in enumerate(middle) if k >= 0.9 * min(n, 256)), 0)
    return statistics.median(middle[ramped:])


def worker_peak(workers: list) -> int | str:
    """Sum of the workers' peaks in flight (their exit lines), or "?" if one did not log its exit."""
    try:
        return sum(c.worker_exit(c.log_text(w)).peak_in_flight for w in workers)
    except RuntimeError:  # keep the run's numbers; say what went wrong
        print("  warning: a worker's exit line is missing; log tails:\n"
              + "\n".join(c.log_text(w)[-1000:] for w in workers), flush=True)
        return "?"


def write_config(stack: c.Stack, sim: c.Sim, s: Settings, policy: str, n: int) -> c.Path:
    datasets = []
    for ds, mean in MEANS.items():
        path = stack.dir / f"{ds}.jsonl"
        if not path.exists():  # the same prompts, so the same lengths, in every run
            c.write_prompts(path, rows_needed(s.budget, mean))
        datasets.append(c.dataset(ds, path, s.budget, mode=policy, max_tokens=MAX_TOKENS, prior=mean))
    worker = {"concurrency": n, "control_interval_s": s.control_interval_s, "grace_s": 5}
    return stack.config(sim.url, datasets, worker=worker, producer={"progress": "off"})


def run_pipeline(stack: c.Stack, cfg: c.Path, s: Settings, name: str, n: int) -> list:
    """Workers and producer until the producer has seen every dataset complete; returns the workers."""
    return stack.run(cfg, name, s.workers, n // s.workers)


def run_once(stack: c.Stack, sim: c.Sim, s: Settings, policy: str, n: int) -> list[Outcome]:
    stack.flush()
    sim.reset()
    cfg = write_config(stack, sim, s, policy, n)
    sampler = Sampler(sim)
    sampler.start()
    try:
        workers = run_pipeline(stack, cfg, s, f"{policy}-{n}", n)
    finally:
        sampler.done.set()
    sim.wait_idle()
    records = sim.records()
    peak = worker_peak(workers)
    running = in_flight_median(sampler.samples, records, s.budget * len(MEANS), n)
    conn = stack.conn()
    out = []
    for ds in MEANS:
        used = int(conn.get(keys.used_key(ds)) or 0)
        kept_ids = {json.loads(line)["id"] for line in (stack.dir / "out" / f"{ds}.jsonl").read_text().splitlines()}
        generated, tail, ideal = analyse(ds, s.budget, records, kept_ids)
        out.append(Outcome(policy, n, running, peak, ds, s.budget, used, generated, tail, ideal, s.speedup))
    return out


def settings(args: argparse.Namespace) -> Settings:
    if args.smoke:
        budget, speedup, inflight = "150k", 50.0, (32,)
    elif args.quick:
        budget, speedup, inflight = "400k", 40.0, (32, 256)
    else:
        budget, speedup, inflight = "10M", 20.0, (32, 128, 256)
    return Settings(parse_tokens(args.budget or budget), args.speedup or speedup, tuple(args.in_flight or inflight),
                    args.control_interval_s, tuple(args.policy or POLICIES), args.workers)


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="400k budgets, 32 and 256 in flight (< 60 s)")
    ap.add_argument("--smoke", action="store_true", help="tiny, for the test suite")
    ap.add_argument("--budget", help="per dataset (default 10M)")
    ap.add_argument("--speedup", type=float, help="simulator speed-up (default 20)")
    ap.add_argument("--in-flight", type=int, action="append", help="only this in-flight level (repeatable)")
    ap.add_argument("--policy", choices=POLICIES, action="append", help="only this policy (repeatable)")
    ap.add_argument("--workers", type=int, default=1, help="split the in-flight level over this many processes")
    ap.add_argument("--control-interval-s", type=float, default=0.1,
                    help="worker.control_interval_s (default 0.1: ~0.5 s at real speed scaled by the speed-up, "
                         "bounded so the worker's refresh stays cheap)")
    args = ap.parse_args(argv)
    s = settings(args)
    c.print_header("Budget precision: drain vs. soft vs. strict", ["bench/budget_precision.py", *argv])
    sim_flags = ["--max-running-requests", "256", "--speedup", str(s.speedup), "--length-sigma", str(SIGMA),
                 "--keep-records", "1000000"]
    for ds, mean in MEANS.items():
        sim_flags += ["--length-mean-for", f"{ds}-={mean}"]
    print(f"simulator: budgetq sim {' '.join(sim_flags)}")
    print(f"budget {format_tokens(s.budget)} per dataset; {s.workers} worker process(es); "
          f"worker.control_interval_s {s.control_interval_s}\n", flush=True)
    sim = c.Sim(*sim_flags)
    stack = c.Stack.start()
    results: list[Outcome] = []
    try:
        for n in s.concurrencies:
            for policy in s.policies:
                t0 = time.monotonic()
                got = run_once(stack, sim, s, policy, n)
                results += got
                print(f"  {policy} at {n}: " + ", ".join(f"{o.ds} used/budget {o.used / o.budget:.4f} "
                                                         f"waste {o.waste:,}" for o in got)
                      + f" ({time.monotonic() - t0:.0f} s)", flush=True)
    finally:
        stack.close()
        sim.close()
        print(c.md_table(HEADERS, [o.row() for o in results]))  # what was measured, even if a run failed


if __name__ == "__main__":
    main(sys.argv[1:])
