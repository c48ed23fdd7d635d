"""Producer memory and enqueue rate: a 10k vs. a 1M-row dataset.

    python bench/producer_memory.py [--quick | --smoke]

`budgetq produce` reads the whole file and enqueues every row, with its normal back-pressure
(queue depth <= high_water). Instead of workers, a fake consumer in this process pops job ids
off the RQ queue as fast as it can and deletes their job hashes, so the producer never waits
for generation and Redis stays small. Why not real workers on the --instant simulator:
a million prompts would take them half an hour on this machine and the number would measure
the workers, not the producer. The producer's peak RSS comes from the kernel (wait4's
ru_maxrss, the high-water mark of its resident set); the enqueue rate is rows over the time
from the first job popped to the last. Target: peak RSS flat (streaming + back-pressure).
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from dataclasses import dataclass

import _common as c

from budgetq.shared import keys

DS = "M1"
HIGH_WATER = 1024  # the default for worker.concurrency 256 (4 x)


@dataclass
class Result:
    rows: int
    file_mb: float
    popped: int
    seconds: float          # first pop -> last pop
    wall_s: float           # producer process, start to exit
    peak_rss_mb: float
    cpu_s: float

    @property
    def rate(self) -> float:
        return self.popped / self.seconds


class Consumer(threading.Thread):
    """Pops the dataset's queue and deletes the job hashes, until told the producer has exited."""

    def __init__(self, stack: c.Stack) -> None:
        super().__init__(daemon=True)
        self.conn = stack.conn()
        self.producer_exited = threading.Event()
        self.popped = 0
        self.first = self.last = 0.0

    def run(self) -> None:
        queue = keys.rq_queue_key(DS)
        while True:
            ids = self.conn.lpop(queue, 1000)
            if ids:
                now = time.monotonic()
                self.first = self.first or now
                self.last = now
                self.popped += len(ids)
                self.conn.delete(*[keys.rq_job_key(i.decode()) for i in ids])
            elif self.producer_exited.is_set():
                return
            else:
                time.sleep(0.002)


def run_producer(stack: c.Stack, sim: c.Sim, rows: int) -> Result:
    stack.flush()
    data = stack.dir / f"{DS}-{rows}.jsonl"
    c.write_prompts(data, rows)
    cfg = stack.config(sim.url, [c.dataset(DS, data, 10**15, max_tokens=1024, prior=100)],
                       producer={"high_water": HIGH_WATER, "progress": "off"})
    consumer = Consumer(stack)
    consumer.start()
    t0 = time.monotonic()
    proc = stack.producer(cfg, f"producer-{rows}")
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.monotonic() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    consumer.producer_exited.set()
    consumer.join(60)
    if proc.returncode != 0:
        raise RuntimeError(f"producer exited with {proc.returncode}:\n{c.log_text(proc)[-3000:]}")
    if consumer.popped != rows:
        raise RuntimeError(f"{consumer.popped} jobs popped for {rows} rows:\n{c.log_text(proc)[-3000:]}")
    size = data.stat().st_size / 2**20
    data.unlink()
    return Result(rows, size, consumer.popped, consumer.last - consumer.first, wall, usage.ru_maxrss / 1024,
                  usage.ru_utime + usage.ru_stime)


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="10k vs 100k rows (< 60 s)")
    ap.add_argument("--smoke", action="store_true", help="tiny, for the test suite")
    args = ap.parse_args(argv)
    sizes = (2_000, 10_000) if args.smoke else (10_000, 100_000) if args.quick else (10_000, 1_000_000)
    c.print_header("Producer memory and enqueue rate", ["bench/producer_memory.py", *argv])
    print(f"producer.high_water {HIGH_WATER}; rows of ~120 characters; fake consumer pops 1,000 ids at a time\n",
          flush=True)
    # The producer never sends a request, but its config names a server: give it a real one.
    sim = c.Sim("--instant", "--keep-records", "0")
    stack = c.Stack.start()
    try:
        results = []
        for rows in sizes:
            results.append(run_producer(stack, sim, rows))
            r = results[-1]
            print(f"  {rows:,} rows: {r.rate:,.0f} rows/s, peak RSS {r.peak_rss_mb:.1f} MB", flush=True)
    finally:
        stack.close()
        sim.close()
    base = results[0]
    print(c.md_table(["rows", "file MB", "enqueued", "enqueue s", "rows/s", "producer wall s", "producer CPU s",
                      "CPU ms per 1k rows", "peak RSS MB", "peak RSS ratio to the smallest"],
                     [[r.rows, r.file_mb, r.popped, r.seconds, r.rate, r.wall_s, r.cpu_s, 1e6 * r.cpu_s / r.rows,
                       r.peak_rss_mb, r.peak_rss_mb / base.peak_rss_mb] for r in results]))


if __name__ == "__main__":
    main(sys.argv[1:])
