"""Orchestration cost: prompts/s one worker process sustains against a zero-latency simulator.

    python bench/orchestration.py [--quick | --smoke]

The real producer pre-enqueues N jobs (then is stopped), and only then one worker runs them:
``budgetq worker --burst`` at --concurrency 64 and 256, and a stock ``rq worker`` (SimpleWorker,
one job at a time, the same job function) on fewer jobs. The rate is N over the time from
the first job's start to the last job's end, read from the RQ job hashes (process start-up
and shutdown are left out). Round trips per prompt: the worker's own count (its exit log)
and Redis's ``total_reads_processed`` (one socket read per request burst: a round trip),
which is also available for the stock worker. CPU per prompt of worker, redis and
simulator shows where the two cores go. Target: >= 1,000 prompts/s per worker process.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import time
from dataclasses import dataclass

import _common as c
from rq.utils import utcparse

from budgetq.shared import keys
from budgetq.shared.identity import job_id

DS = "O1"
TARGET = 1000.0


@dataclass
class Run:
    worker: str
    concurrency: int
    jobs: int
    seconds: float
    round_trips: float | None    # per prompt, the worker's own count
    reads: float                 # per prompt, Redis socket reads
    commands: float              # per prompt, Redis commands
    cpu_ms: dict[str, float]     # per prompt, by process

    @property
    def rate(self) -> float:
        return self.jobs / self.seconds


def enqueue(stack: c.Stack, sim: c.Sim, n: int) -> c.Path:
    """Enqueue n jobs with the real producer, then stop it (its collector would compete for CPU)."""
    stack.flush()
    data = stack.dir / f"{DS}.jsonl"
    c.write_prompts(data, n)
    cfg = stack.config(sim.url, [c.dataset(DS, data, 10**12, max_tokens=64, prior=16)],
                       producer={"high_water": n, "progress": "off"}, worker={"concurrency": 256})
    conn = stack.conn()
    prod = stack.producer(cfg, "producer-enqueue")
    deadline = time.monotonic() + 120
    while conn.llen(keys.rq_queue_key(DS)) < n:
        if prod.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"producer did not enqueue {n} jobs:\n{c.log_text(prod)[-2000:]}")
        time.sleep(0.05)
    c.stop_process(prod)
    return cfg


def job_window(conn, n: int) -> float:
    """Seconds from the first job's start to the last job's end (RQ's own timestamps)."""
    pipe = conn.pipeline(transaction=False)
    for i in range(n):
        pipe.hmget(keys.rq_job_key(job_id(DS, f"p{i}")), "started_at", "ended_at")
    stamps = pipe.execute()
    missing = sum(1 for s, e in stamps if not s or not e)
    if missing:
        raise RuntimeError(f"{missing} of {n} jobs have no start or end time: not all ran")
    first = min(utcparse(s.decode()) for s, _ in stamps)
    last = max(utcparse(e.decode()) for _, e in stamps)
    return (last - first).total_seconds()


def _reaped(pid: int) -> tuple[int, os.struct_rusage] | None:
    """(wait status, resource usage) of an exited child, reaped; None while it runs."""
    done, status, usage = os.wait4(pid, os.WNOHANG)
    return (status, usage) if done else None


def _wait_bounded(proc, name: str, n: int) -> tuple[int, os.struct_rusage]:
    """The burst worker's end, reaped; one that has not ended a generous while after its jobs should have (n
    jobs at >= 10/s, on a loaded machine) is stopped (SIGTERM: it drains and says what it still held, then
    SIGKILL) and the bench fails with its log, rather than waiting forever."""
    give_up = time.monotonic() + max(120.0, n / 10)
    while (ended := _reaped(proc.pid)) is None:
        if time.monotonic() > give_up:
            c.stop_process(proc)
            raise RuntimeError(f"{name} --burst had not exited {max(120.0, n / 10):.0f} s after its start ("
                               f"{c.log_text(proc).count(chr(10))} log lines); stopped. Its log:\n"
                               f"{c.log_text(proc)[-4000:]}")
        time.sleep(0.05)
    return ended


def measure(stack: c.Stack, sim: c.Sim, cfg: c.Path, name: str, concurrency: int, n: int, argv: list[str],
            env: dict[str, str] | None = None) -> Run:
    conn = stack.conn()
    before = c.redis_info(conn)
    cpu0 = {"redis": c.cpu_s(stack.redis.proc.pid), "sim": c.cpu_s(sim.pid)}
    proc = stack.spawn(f"{name}-{concurrency}", argv, env=env)
    stopped, ended = False, None
    if name != "budgetq":
        # RQ's burst worker can linger up to a minute after its last job (its pubsub thread waits 60 s
        # in a read that the unsubscribe does not always wake: rq/rq#2172); once it says it is done
        # it gets 5 s, then is stopped (the rate is read from the jobs' own times, not the process's).
        give_up = time.monotonic() + 600
        while (ended := _reaped(proc.pid)) is None and "done, quitting" not in c.log_text(proc):
            if time.monotonic() > give_up:
                proc.kill()
                raise RuntimeError(f"{name} did not finish its jobs in 600 s:\n{c.log_text(proc)[-3000:]}")
            time.sleep(0.1)
        deadline = time.monotonic() + 5
        while ended is None and (ended := _reaped(proc.pid)) is None and time.monotonic() < deadline:
            time.sleep(0.1)
        if ended is None:
            proc.kill()  # not SIGTERM: RQ takes that for a stop request in the middle of its teardown
            stopped = True
    else:
        ended = _wait_bounded(proc, name, n)
    status, usage = ended if ended is not None else os.wait4(proc.pid, 0)[1:]
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0 and not (stopped and proc.returncode == -signal.SIGKILL):
        raise RuntimeError(f"{name} exited with {proc.returncode}:\n{c.log_text(proc)[-3000:]}")
    after = c.redis_info(conn)
    cpu = {"worker": usage.ru_utime + usage.ru_stime,
           "redis": c.cpu_s(stack.redis.proc.pid) - cpu0["redis"], "sim": c.cpu_s(sim.pid) - cpu0["sim"]}
    trips = None
    if name == "budgetq":
        trips = c.worker_exit(c.log_text(proc)).round_trips / n
    committed = int(conn.hget(keys.stats_key(DS), "committed") or 0)
    if committed != n:
        raise RuntimeError(f"{name}: {committed} of {n} jobs committed:\n{c.log_text(proc)[-3000:]}")
    return Run(name, concurrency, n, job_window(conn, n), trips, (after["reads"] - before["reads"] - 1) / n,
               (after["commands"] - before["commands"] - 1) / n, {k: 1000 * v / n for k, v in cpu.items()})


def budgetq_run(stack: c.Stack, sim: c.Sim, n: int, concurrency: int) -> Run:
    cfg = enqueue(stack, sim, n)
    argv = [*c.CLI, "--log-level", "INFO", "worker", "-c", str(cfg), "--concurrency", str(concurrency), "--burst"]
    return measure(stack, sim, cfg, "budgetq", concurrency, n, argv)


def stock_run(stack: c.Stack, sim: c.Sim, n: int) -> Run:
    cfg = enqueue(stack, sim, n)
    argv = [sys.executable, "-m", "rq.cli", "worker", "--burst", "-u", stack.url, "--serializer",
            "rq.serializers.JSONSerializer", "--worker-class", "rq.SimpleWorker", keys.queue_name(DS)]
    return measure(stack, sim, cfg, "rq SimpleWorker", 1, n, argv, env=dict(c.ENV, BUDGETQ_CONFIG=str(cfg)))


def row(r: Run, stock_rate: float) -> list[object]:
    return [r.worker, r.concurrency, r.jobs, r.seconds, r.rate, r.rate / TARGET, r.rate / stock_rate,
            "-" if r.round_trips is None else r.round_trips, r.reads, r.commands,
            r.cpu_ms["worker"], r.cpu_ms["redis"], r.cpu_ms["sim"]]


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer jobs, one repeat (< 60 s)")
    ap.add_argument("--smoke", action="store_true", help="tiny, for the test suite")
    args = ap.parse_args(argv)
    n, n_stock, repeats = (20_000, 300, 2) if not (args.quick or args.smoke) else (4000, 100, 1)
    concurrencies = (64, 256)
    if args.smoke:  # one budgetq run: the suite runs it beside vLLM on 2 cores, where each process start is slow
        n, n_stock, concurrencies = 300, 10, (64,)
    c.print_header("Orchestration: prompts/s of one worker process, --instant simulator", ["bench/orchestration.py",
                                                                                           *argv])
    sim = c.Sim("--instant", "--length-mean", "16", "--keep-records", "0")
    stack = c.Stack.start()
    try:
        runs: list[Run] = []
        for _ in range(repeats):
            for conc in concurrencies:
                runs.append(budgetq_run(stack, sim, n, conc))
                print(f"  budgetq c={conc}: {runs[-1].rate:,.0f} prompts/s", flush=True)
        stock = stock_run(stack, sim, n_stock)
        print(f"  rq SimpleWorker: {stock.rate:,.0f} prompts/s", flush=True)
    finally:
        stack.close()
        sim.close()
    heads = ["worker", "concurrency", "jobs", "seconds", "prompts/s", "ratio vs 1,000/s target", "ratio vs stock rq",
             "round trips/prompt (worker's count)", "redis socket reads/prompt", "redis commands/prompt (incl. in Lua)",
             "worker CPU ms/prompt", "redis CPU ms/prompt", "sim CPU ms/prompt"]
    print(c.md_table(heads, [row(r, stock.rate) for r in [*runs, stock]]))
    print()
    summary = []
    for conc in concurrencies:
        rates = [r.rate for r in runs if r.concurrency == conc]
        med = statistics.median(rates)
        summary.append([f"budgetq --concurrency {conc}", med, med / TARGET, med / stock.rate,
                        "met" if med >= TARGET else "missed"])
    summary.append(["rq SimpleWorker", stock.rate, stock.rate / TARGET, 1.0, "-"])
    print(c.md_table(["worker", "prompts/s (median)", "ratio vs target", "ratio vs stock rq", "target >= 1,000/s"],
                     summary))


if __name__ == "__main__":
    main(sys.argv[1:])
