"""Waste at the end of a soft budget: the end game's variants side by side, on the same prompts.

    python bench/end_game.py [--smoke] [--speedup S] [--case NAME ...] [--variants elapsed,streamed]

Each case runs twice, back to back, on one simulator that behaves like a GPU SGLang server:
256 running requests, ~600 tok/s per request at 256 running (153.6k tok/s in all), a dropped
non-streaming client noticed only at SGLang's ~4 s state-wait poll, responses of the seed's
B2 profile (lognormal sigma 1.0, capped at 8,192), 2 worker processes:

- ``before``: ``end_margin_z: 0``, ``server.abort_on_cancel: false``,
  ``worker.taper_estimate: completed`` (the end game before the margin and /abort_request: the taper's length
  estimate from completed answers only; a request aborted at the crossing keeps generating
  until the server notices the disconnect);
- ``after``: the defaults (``end_margin_z: 1.0``; running requests counted as censored
  lengths; cancelled requests also aborted with ``POST /abort_request``), answers not streamed;
- ``elapsed`` / ``streamed`` (the default pair, since answers are streamed): ``after`` with ``server.stream: false``
  (each running request's tokens so far *estimated* as elapsed time x the decode rate) vs. ``true``
  (its tokens so far as its stream says: SGLang's meta_info.completion_tokens; worker/tracked.py
  ``Tracked.generated``). ``--variants before,after`` gives the earlier comparison.

Printed per case and variant: used/budget and overshoot per dataset (worst), waste (tokens
the simulator generated that no kept row holds, as a share of what it generated), the time
from 95% of all budgets kept to the last request leaving, against the ideal (the last 5% at
the run's steady rate), and kept / (capacity x wall).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass

import _common as c
from budget_precision import Sampler

from budgetq.shared import keys
from budgetq.shared.identity import job_id, split_job_id
from budgetq.shared.tokens import format_tokens
from budgetq.worker.sglang_wire import job_id_of_rid

SIGMA = 1.0
MAX_TOKENS = 8192
RUNNING = 256
PER_REQUEST_TOK_S = 600.0
HALF_BATCH = 32.0
PEAK = PER_REQUEST_TOK_S * (RUNNING + HALF_BATCH)   # sim capacity model: peak * B / (B + half)
CAPACITY = PEAK * RUNNING / (RUNNING + HALF_BATCH)  # tok/s (simulated) with every slot busy
B2 = 3793
# Ten datasets of different mean lengths (the two named in the seed, A1 and B2, among them).
TEN = {"A1": 1577, "B2": 3793, "C1": 2210, "D1": 980, "E1": 2890, "F1": 1820, "G1": 3310, "H1": 1250,
       "I1": 2640, "J1": 4120}
_AFTER = {"end_margin_z": 1.0, "abort_on_cancel": True, "taper_estimate": "censored"}
VARIANTS = {"before": {"end_margin_z": 0.0, "abort_on_cancel": False, "taper_estimate": "completed", "stream": False},
            "after": {**_AFTER, "stream": False},
            "elapsed": {**_AFTER, "stream": False},
            "streamed": {**_AFTER, "stream": True}}
DEFAULT_VARIANTS = ["elapsed", "streamed"]


@dataclass(frozen=True)
class Case:
    name: str
    datasets: dict[str, int]  # name -> mean length
    budget: int
    workers: int = 2
    per_worker: int = 128


CASES = [Case("one-10M", {"B2": B2}, 10_000_000), Case("ten-1M", TEN, 1_000_000), Case("one-2M", {"B2": B2}, 2_000_000)]
SMOKE = [Case("one-300k", {"B2": B2}, 300_000, per_worker=32)]


@dataclass
class Result:
    case: str
    variant: str
    worst_ratio: float
    worst_over: int
    in_bounds: bool
    generated: int
    kept: int
    tail_s: float
    ideal_s: float
    efficiency: float
    running: float  # median requests running at the simulator, from 20% of the run to 95% kept

    @property
    def waste(self) -> int:
        return self.generated - self.kept

    def row(self) -> list[object]:
        return [self.case, self.variant, f"{self.worst_ratio:.5f}", self.worst_over,
                "yes" if self.in_bounds else "NO", self.generated, self.waste,
                f"{100 * self.waste / max(1, self.generated):.2f}%", self.tail_s, self.ideal_s,
                f"{self.tail_s / self.ideal_s:.2f}" if self.ideal_s else "-", f"{self.efficiency:.3f}", self.running]


HEADERS = ["case", "variant", "used/budget (worst)", "used - budget (worst)", "all in [B, B+max_tokens)",
           "sim generated", "waste tokens", "waste %", "95%->done sim s", "ideal sim s", "ratio to ideal",
           "kept / (capacity x wall)", "sim running (median)"]


SUMMARY = ["case", "variant", "runs", "waste % (median)", "waste % (max)", "ratio to ideal (median)",
           "kept / (capacity x wall) (median)", "all in [B, B+max_tokens)"]


def _summary(case: str, variant: str, runs: list[Result]) -> list[object]:
    waste = [100 * r.waste / max(1, r.generated) for r in runs]
    ratio = [r.tail_s / r.ideal_s for r in runs if r.ideal_s]
    return [case, variant, len(runs), f"{statistics.median(waste):.2f}%", f"{max(waste):.2f}%",
            f"{statistics.median(ratio):.2f}" if ratio else "-",
            f"{statistics.median(r.efficiency for r in runs):.3f}", "yes" if all(r.in_bounds for r in runs) else "NO"]


def _tail(records: list[dict], kept_jobs: set[str], total_budget: int) -> tuple[float, float, float, float]:
    """(t95, t_done, steady rate tok/s, first arrival) in simulated-time units of the records."""
    kept = sorted((r for r in records if job_id_of_rid(r["rid"]) in kept_jobs), key=lambda r: r["finished"])
    marks, total, i = {}, 0, 0
    for f in (0.5, 0.8, 0.95):
        while i < len(kept) and total < f * total_budget:
            total += kept[i]["completion_tokens"]
            i += 1
        marks[f] = kept[i - 1]["finished"]
    rate = 0.3 * total_budget / max(1e-9, marks[0.8] - marks[0.5])
    return marks[0.95], max(r["finished"] for r in records), rate, min(r["arrived"] for r in records)


def run_case(stack: c.Stack, sim: c.Sim, case: Case, variant: str, speedup: float) -> Result:
    stack.flush()
    sim.reset()
    datasets = []
    for ds, mean in case.datasets.items():
        path = stack.dir / f"{ds}-{case.budget}.jsonl"
        if not path.exists():  # the same prompts (so the same lengths) for both variants
            c.write_prompts(path, int(case.budget / mean * 1.5) + 500)
        d = c.dataset(ds, path, case.budget, max_tokens=MAX_TOKENS, prior=mean)
        d["end_margin_z"] = VARIANTS[variant]["end_margin_z"]
        datasets.append(d)
    cfg = stack.config(sim.url, datasets, server={"urls": [sim.url],
                                                  "abort_on_cancel": VARIANTS[variant]["abort_on_cancel"],
                                                  "stream": VARIANTS[variant]["stream"]},
                       worker={"concurrency": case.per_worker, "control_interval_s": 0.1, "grace_s": 5,
                               "taper_estimate": VARIANTS[variant]["taper_estimate"]},
                       producer={"progress": "off"})
    sampler = Sampler(sim)
    sampler.start()
    try:
        stack.run(cfg, f"{case.name}-{variant}", case.workers, case.per_worker)
    finally:
        sampler.done.set()
    sim.wait_idle(120)
    records = sim.records()
    conn = stack.conn()
    kept_jobs: set[str] = set()
    used_total, ratios, overs = 0, [], []
    for ds in case.datasets:
        used = int(conn.get(keys.used_key(ds)) or 0)
        used_total += used
        ratios.append(used / case.budget)
        overs.append(used - case.budget)
        lines = (stack.dir / "out" / f"{ds}.jsonl").read_text().splitlines()
        kept_jobs |= {job_id(ds, json.loads(line)["id"]) for line in lines}
    mine = [r for r in records if split_job_id(job_id_of_rid(r["rid"]))[0] in case.datasets]
    generated = sum(r["completion_tokens"] for r in mine)
    total_budget = case.budget * len(case.datasets)
    t95, done, rate, first = _tail(mine, kept_jobs, total_budget)
    in_bounds = all(0 <= o < MAX_TOKENS for o in overs)
    # records' times are wall seconds: the simulated time is speedup x that
    efficiency = used_total / (CAPACITY * (done - first) * speedup)
    middle = [k for t, k in sampler.samples if first + 0.2 * (t95 - first) <= t <= t95] or [0]
    return Result(case.name, variant, max(ratios), max(overs), in_bounds, generated, used_total,
                  (done - t95) * speedup, 0.05 * total_budget / rate * speedup, efficiency,
                  statistics.median(middle))


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="one tiny case, for the test suite")
    ap.add_argument("--speedup", type=float, default=4.0,
                    help="simulated seconds per wall second (default 4: a mean response lasts ~1.6 wall s, "
                         "16 control intervals of 0.1 s)")
    ap.add_argument("--case", action="append", help="only this case (repeatable)")
    ap.add_argument("--repeat", type=int, default=1,
                    help="run each case's variants this many times, alternating (the machine is noisy)")
    ap.add_argument("--disconnect-poll-s", type=float, default=4.0,
                    help="simulated seconds before the server notices a dropped client (SGLang: 4)")
    ap.add_argument("--variants", default=",".join(DEFAULT_VARIANTS),
                    help=f"comma-separated, run in this order per case: {', '.join(VARIANTS)}")
    args = ap.parse_args(argv)
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown or not variants:
        ap.error(f"--variants {args.variants}: known are {', '.join(VARIANTS)}")
    cases = SMOKE if args.smoke else [k for k in CASES if not args.case or k.name in args.case]
    c.print_header(f"End game: waste at the end of a soft budget, {' vs. '.join(variants)}",
                   ["bench/end_game.py", *argv])
    means = sorted({m for k in cases for m in k.datasets.values()})
    flags = ["--max-running-requests", str(RUNNING), "--peak-tok-s", str(PEAK), "--half-batch", str(HALF_BATCH),
             "--speedup", str(args.speedup), "--length-sigma", str(SIGMA), "--keep-records", "1000000"]
    if args.disconnect_poll_s >= 0:
        flags += ["--disconnect-poll-s", str(args.disconnect_poll_s)]
    for k in cases:
        for ds, mean in k.datasets.items():
            if f"{ds}-={mean}" not in flags:
                flags += ["--length-mean-for", f"{ds}-={mean}"]
    print(f"simulator: budgetq sim {' '.join(flags)}")
    print(f"capacity {CAPACITY:,.0f} tok/s at {RUNNING} running; means {means}\n", flush=True)
    sim = c.Sim(*flags)
    stack = c.Stack.start()
    results: list[Result] = []
    try:
        for case in cases:
            for _ in range(args.repeat):
                for variant in variants:
                    t0 = time.monotonic()
                    r = run_case(stack, sim, case, variant, args.speedup)
                    results.append(r)
                    print(f"  {case.name} {variant}: used/budget {r.worst_ratio:.4f}, waste {r.waste:,} "
                          f"({100 * r.waste / max(1, r.generated):.2f}%), efficiency {r.efficiency:.3f} "
                          f"({time.monotonic() - t0:.0f} s)", flush=True)
    finally:
        stack.close()
        sim.close()
        print(c.md_table(HEADERS, [r.row() for r in results]))
    if args.repeat > 1:
        print("\nMedians over the repeats:\n")
        print(c.md_table(SUMMARY, [_summary(case.name, v, [r for r in results if (r.case, r.variant) ==
                                                             (case.name, v)]) for case in cases for v in variants]))
    print(f"\nbudgets: {', '.join(f'{k.name} {format_tokens(k.budget)} x {len(k.datasets)}' for k in cases)}")


if __name__ == "__main__":
    main(sys.argv[1:])
