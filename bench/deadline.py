"""Deadline precision: the last row against the deadline, token shares against the weights, and
the waste of requests aborted at the deadline, at two fleet speeds and two deadlines.

    python bench/deadline.py [--speedup 10]

Three datasets with weights 1, 2, 3, each with prompts enough; one worker with 16 requests in
flight against `budgetq sim` in its linear regime (per-request decode speed independent of the
batch), ~300-token answers (lognormal, sigma 0.5). "fast" decodes 120 tok/s per request (~2.5 s
per answer), "slow" 60 tok/s (~5 s). Times are simulated seconds (wall x speed-up).
"""

from __future__ import annotations

import argparse
import sys
import time

import _common as c

from budgetq.shared import keys, run_plan
from budgetq.shared.identity import job_id

WEIGHTS = {"A": 1.0, "B": 2.0, "C": 3.0}
SPEEDS = {"fast": 122_000, "slow": 61_000}  # --peak-tok-s with --half-batch 1000: ~120 / ~60 tok/s per request


def run_case(stack: c.Stack, speed: str, deadline_s: float, speedup: float, rows_each: int) -> list[object]:
    stack.flush()
    sim = c.Sim("--speedup", str(speedup), "--half-batch", "1000", "--peak-tok-s", str(SPEEDS[speed]),
                "--length-mean", "300", "--length-sigma", "0.5", "--max-running-requests", "512", "--seed", "3")
    try:
        datasets = []
        for name, w in WEIGHTS.items():
            path = stack.dir / f"{name}.jsonl"
            c.write_prompts(path, rows_each)
            d = c.dataset(name, path, "1M", max_tokens=1200, prior=300)
            del d["budget"]
            datasets.append({**d, "weight": w})
        wall = deadline_s / speedup
        cfg = stack.config(sim.url, datasets, run={"deadline": f"{wall}s", "control_interval_s": 0.1,
                                                   "rate_window_s": 2.0},
                           worker={"concurrency": 16, "control_interval_s": 0.05, "heartbeat_ttl_s": 5},
                           producer={"poll_interval_s": 0.02, "progress": "off"})
        stack.run(cfg, f"{speed}-{deadline_s:.0f}", workers=1, per_worker=16)
        conn = stack.conn()
        deadline = run_plan.read_settings(conn).deadline
        assert deadline is not None
        out = stack.dir / "out"
        kept = set()
        for name in WEIGHTS:
            for line in (out / f"{name}.jsonl").read_text().splitlines():
                kept.add(job_id(name, line.split('"id":"', 1)[1].split('"', 1)[0]))
        recs = sim.records()
        finished = [r["finished"] for r in recs if r["finish"] in ("stop", "length") and r["rid"].rsplit(".", 1)[0]
                    in kept]
        stats = sim.stats()
        at_deadline = sum(r["completion_tokens"] for r in recs if r["finish"] == "abort" and r["finished"] >= deadline)
        used = {n: int(conn.get(keys.used_key(n)) or 0) for n in WEIGHTS}
        total = sum(used.values())
        err = max(abs(used[n] / total / (w / sum(WEIGHTS.values())) - 1) for n, w in WEIGHTS.items())
        first = min(r["arrived"] for r in recs)
        busy_to = max(finished)
        return [speed, f"{deadline_s:.0f} s", f"{(max(finished) - deadline) * speedup:+.1f} s",
                f"{(max(finished) - deadline) / wall:+.1%}", f"{err:.1%}",
                f"{at_deadline / stats['generated_tokens']:.2%}",
                f"{stats['aborted_tokens'] / stats['generated_tokens']:.2%}", f"{total:,}",
                f"{(busy_to - first) / (deadline - first):.0%}"]
    finally:
        sim.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--speedup", type=float, default=10.0)
    ap.add_argument("--deadlines", type=float, nargs="+", default=[60.0, 120.0], help="simulated seconds")
    args = ap.parse_args()
    c.print_header("deadline precision", ["bench/deadline.py", *sys.argv[1:]])
    stack = c.Stack.start()
    rows = []
    try:
        for speed in SPEEDS:
            for d in args.deadlines:
                started = time.monotonic()
                rows.append(run_case(stack, speed, d, args.speedup, rows_each=int(40 * d)))
                print(f"  {speed} {d:.0f} s: {time.monotonic() - started:.1f} s wall", flush=True)
    finally:
        stack.close()
    print(c.md_table(["fleet", "deadline", "last row vs deadline", "(of the deadline)", "max share error",
                      "aborted at the deadline", "all waste", "tokens counted", "last row at (of the run)"], rows))


if __name__ == "__main__":
    main()
