"""``worker.concurrency: auto`` vs. hand-tuned fixed concurrency on servers of different sizes.

    python bench/concurrency_auto.py [--quick | --smoke]

Three simulators of different sizes (``--max-running-requests`` 32, 64 and 128, ``--speedup 4``,
mean answer 1,000 tokens) and two ``budgetq worker`` processes on one dataset whose budget is
never reached (least-loaded routing). Each configuration runs back to back on the same servers:
fixed ``--concurrency`` C per worker for several C, then ``--concurrency auto``. Throughput is
the servers' generated tokens over a steady window (opening after a warm-up), in simulated
tok/s; "waiting" is the servers' queued requests sampled at the window's end (requests that
would be aborted, not just stopped, if a budget were crossed now). Goal: auto >= 0.98 of the
best fixed configuration's tok/s.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass

import _common as c

DS = "A1"
SIZES = (32, 64, 128)
GOAL = 0.98


@dataclass
class Run:
    setting: str
    tok_s: float
    running: int
    waiting: int
    limits: str


def one_run(stack: c.Stack, sims: list[c.Sim], cfg: c.Path, setting: str, warmup_s: float, window_s: float) -> Run:
    stack.flush()
    workers = [stack.spawn(f"worker-{setting}-{i}", [*c.CLI, "worker", "-c", str(cfg), "--concurrency", setting])
               for i in range(2)]
    producer = stack.producer(cfg, f"producer-{setting}")
    try:
        # The warm-up opens once both workers have requests at the servers (their start is slow on
        # a loaded machine: a fixed wait measured nothing there).
        deadline = time.monotonic() + 180
        while sum(s.stats()["running"] for s in sims) < 2 * min(32, int(setting) if setting.isdigit() else 32):
            if dead := [p.args for p in (producer, *workers) if p.poll() is not None]:
                raise RuntimeError(f"{setting}: a process exited before the run got going: {dead}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{setting}: the workers never got requests to the servers in 180 s")
            time.sleep(0.1)
        time.sleep(warmup_s)
        before = sum(s.stats()["generated_tokens"] for s in sims)
        t0 = time.monotonic()
        time.sleep(window_s)
        stats = [s.stats() for s in sims]
        seconds = time.monotonic() - t0
        from budgetq.shared.status import snapshot

        limits = sorted(w["concurrency"] for w in snapshot(stack.conn(), stack.url)["workers"])
    finally:
        for p in (producer, *workers):
            c.stop_process(p)
    for s in sims:
        s.wait_idle()
    generated = sum(s["generated_tokens"] for s in stats) - before
    return Run(setting, generated / seconds * 1.0, sum(s["running"] for s in stats),
               sum(s["queued"] for s in stats), " + ".join(map(str, limits)))


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="shorter windows, fewer settings (~1.5 min)")
    ap.add_argument("--smoke", action="store_true", help="tiny, for the test suite")
    args = ap.parse_args(argv)
    fixed, warmup_s, window_s = ["32", "64", "128", "192", "256"], 6.0, 12.0
    if args.quick:
        fixed, warmup_s, window_s = ["64", "192", "256"], 5.0, 6.0
    if args.smoke:
        fixed, warmup_s, window_s = ["64"], 3.0, 2.0
    c.print_header("concurrency auto vs. fixed, 3 servers of 32/64/128 slots, 2 workers",
                   ["bench/concurrency_auto.py", *argv])
    sims = [c.Sim("--max-running-requests", str(n), "--speedup", "4", "--length-mean", "1000", "--keep-records", "0")
            for n in SIZES]
    stack = c.Stack.start()
    try:
        data = stack.dir / f"{DS}.jsonl"
        c.write_prompts(data, 50_000)
        cfg = stack.config(sims[0].url, [c.dataset(DS, data, 10**12, max_tokens=8192, prior=1000)],
                           server={"urls": [s.url for s in sims]}, producer={"progress": "off", "high_water": 2000},
                           # grace_s 0: a stopped run's requests are dropped at once, the window is over
                           worker={"capacity_interval_s": 1.0, "grace_s": 0})
        runs = []
        for setting in [*fixed, "auto"]:
            runs.append(one_run(stack, sims, cfg, setting, warmup_s, window_s))
            print(f"  {setting}: {runs[-1].tok_s:,.0f} tok/s", flush=True)
    finally:
        stack.close()
        for s in sims:
            s.close()
    best = max((r for r in runs if r.setting != "auto"), key=lambda r: r.tok_s)
    auto = runs[-1]
    print(c.md_table(["--concurrency per worker", "workers' limits", "tok/s (simulated)", "ratio to best fixed",
                      "running (of 224)", "waiting at the servers"],
                     [[r.setting, r.limits, r.tok_s, r.tok_s / best.tok_s, r.running, r.waiting] for r in runs]))
    print()
    ratio = auto.tok_s / best.tok_s
    print(c.md_table(["auto tok/s", f"best fixed ({best.setting}) tok/s", "ratio auto / best fixed", "goal"],
                     [[auto.tok_s, best.tok_s, ratio, f">= {GOAL}: " + ("met" if ratio >= GOAL else "missed")]]))


if __name__ == "__main__":
    main(sys.argv[1:])
