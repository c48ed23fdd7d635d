"""The ceiling of one Redis and one collector: what one core of each can carry.

    python bench/ceiling.py [--quick | --smoke] [--workers 1 2 4] [--virtual-workers 4 16 64]

Redis, mostly idle. The whole pipeline -- the real producer (enqueue, collect, monitor) and
N = 1, 2, 4 ``budgetq worker`` processes -- runs a dataset to the end against ``budgetq sim
--instant`` on a private redis-server, once with ``producer.result_ttl_s`` 500 (RQ's default:
finished jobs kept for rq-dashboard) and once with 0 (deleted as they finish, as RQ does). Before
and after, the benchmark reads that server's INFO: ``cpu`` (used_cpu_user + used_cpu_sys:
everything the server spent, event loop and cron included), ``commandstats`` (usec inside
commands only), ``stats`` (total_reads_processed ~ round trips, total_net_input_bytes /
total_net_output_bytes), per prompt. Here the worker processes (~1 ms of Python per prompt)
share two cores with the producer, the simulator and Redis, so Redis runs 12-15% busy: it sleeps
between nearly every round trip and pays a wake-up, a read and a write for each, and the
workers' calls merge little. 1e6 / (us per prompt) of such a run understates what one core
carries when busy.

Redis, busy. The same Redis calls, made as fast as Python can make them: ``--virtual-workers``
asyncio tasks in two processes, each task a worker's claim -> reserve -> commit -> finish through
its own connection and its own ``shared.scripts.Batcher``, the real ``Collector`` in a thread,
no HTTP and none of the worker's per-job Python; the producer's enqueue (``jobs.LeanQueue``,
batches of 256, the look-up before it included) measured before, on its own. Prompts/s through
Redis is measured; the busy fraction is Redis CPU seconds per second; 1e6 / (us per prompt) is
the projected prompts/s of one Redis core (Redis executes commands on one thread: that is its
ceiling whatever the number of workers; a busier Redis spends less per prompt, so the
projection from 40-55% busy is still low). Goal: >= 20,000 prompts/s.

Steps. The same Redis work without the processes: one prompt's script calls and commands,
driven from here in pipelines of 256 (producer's enqueue through ``jobs.LeanQueue``, claim,
reserve, commit, finish, the collector's read and delete), each step's Redis CPU per prompt on
its own, with one EVALSHA per call and with a pipeline's calls merged (what the Batcher does).

Collector. ``producer.collector.Collector`` is driven directly: a results stream is filled
with M entries of 4 KB rows (the fields commit.lua writes: id, kind, row), then one
``drain()`` writes them all to out/<dataset>.jsonl (fsynced). Rows/s and MB/s by wall time
and by the collector's own CPU time (one core). Goal: >= 10,000 rows/s of 4 KB rows.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from dataclasses import dataclass

import _common as c
from ceiling_busy import DS, enqueue_prompts, saturate

from budgetq.shared import keys
from budgetq.shared.identity import job_id

REDIS_GOAL = 20_000.0
COLLECTOR_GOAL = 10_000.0
ROW_BYTES = 4096
TOP = 24  # commands shown in the commandstats table
# producer.result_ttl_s of the runs: RQ's default (finished jobs kept, shown by rq-dashboard) and
# 0 (finished jobs deleted as they finish, as RQ's worker does with result_ttl=0: the fleet setting)
TTLS = (500, 0)


def _command(stat: str) -> str:
    """A commandstats name for a Markdown cell: Redis 7 names subcommands ``client|setinfo``."""
    return stat.removeprefix("cmdstat_").replace("|", " ")


@dataclass
class RedisRun:
    workers: int
    result_ttl: int      # producer.result_ttl_s: 500 (RQ's default) keeps finished jobs, 0 deletes them
    prompts: int
    seconds: float
    cpu_us: float        # per prompt, INFO cpu
    sys_us: float        # the part of it in the kernel (used_cpu_sys: socket reads and writes)
    top: list[tuple[str, float, float]]   # (command, calls/prompt, usec/prompt), by usec
    commands: float      # per prompt
    reads: float         # per prompt: socket reads, ~ round trips
    bytes_in: float      # per prompt
    bytes_out: float     # per prompt

    @property
    def projected(self) -> float:
        return 1e6 / self.cpu_us


def redis_counters(conn) -> dict[str, float]:
    cpu = conn.info("cpu")
    stats = conn.info("stats")
    cmd = conn.info("commandstats")
    return {"cpu_s": float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"]), "sys_s": float(cpu["used_cpu_sys"]),
            **{f"usec:{_command(k)}": float(v["usec"]) for k, v in cmd.items()},
            **{f"calls:{_command(k)}": float(v["calls"]) for k, v in cmd.items()},
            # Commands run by a script or inside MULTI count here as well as in EVALSHA/EXEC.
            "commands": float(sum(v["calls"] for v in cmd.values())),
            "reads": float(stats["total_reads_processed"]),
            "in": float(stats["total_net_input_bytes"]), "out": float(stats["total_net_output_bytes"])}


def redis_run(stack: c.Stack, sim: c.Sim, n: int, workers: int, per_worker: int, result_ttl: int) -> RedisRun:
    stack.flush()
    conn = stack.conn()
    conn.config_resetstat()
    data = stack.dir / f"{DS}.jsonl"
    c.write_prompts(data, n)
    cfg = stack.config(sim.url, [c.dataset(DS, data, 10**12, max_tokens=64, prior=16)],
                       producer={"progress": "off", "result_ttl_s": result_ttl}, worker={"concurrency": per_worker})
    before = redis_counters(conn)
    t0 = time.monotonic()
    stack.run(cfg, f"w{workers}", workers, per_worker)
    seconds = time.monotonic() - t0
    after = redis_counters(conn)
    committed = int(conn.hget(keys.stats_key(DS), "committed") or 0)
    if committed != n:
        raise RuntimeError(f"{workers} workers: {committed} of {n} prompts committed")
    d = {k: after[k] - before.get(k, 0.0) for k in after}
    names = [k.split(":", 1)[1] for k in d if k.startswith("usec:")]
    top = sorted(((m, d[f"calls:{m}"] / n, d[f"usec:{m}"] / n) for m in names), key=lambda t: -t[2])[:TOP]
    return RedisRun(workers, result_ttl, n, seconds, 1e6 * d["cpu_s"] / n, 1e6 * d["sys_s"] / n, top, d["commands"] / n,
                    d["reads"] / n, d["in"] / n, d["out"] / n)


def step_costs(stack: c.Stack, n: int, merge: bool, result_ttl: int, batch: int = 256) -> list[tuple[str, float]]:
    """Redis CPU us per prompt of each step of a prompt's way, the real calls in pipelines of ``batch``:
    one EVALSHA per call (``merge`` False), or a pipeline's calls of the dataset merged into one
    (what the worker's Batcher does; how many merge depends on the load)."""
    from budgetq.producer.run.collector import Collector
    from budgetq.shared import budget, jobs
    from budgetq.shared.config import DatasetConfig
    from budgetq.shared.scripts import run_many

    stack.flush()
    conn = stack.conn()
    budget.register_dataset(conn, DatasetConfig(name=DS, path="-", budget=10**12, max_tokens=64))
    cpu = lambda: sum(float(conn.info("cpu")[k]) for k in ("used_cpu_user", "used_cpu_sys"))  # noqa: E731
    out: list[tuple[str, float]] = []

    def step(name: str, fn) -> None:
        c0 = cpu()
        fn()
        out.append((name, 1e6 * (cpu() - c0) / n))

    def calls(make) -> None:
        made = [make(i) for i in range(n)]
        for i in range(0, n, batch):
            for r in run_many(conn, made[i:i + batch], merge=merge):
                if isinstance(r, Exception):
                    raise r

    claimed: list[jobs.Claimed] = []

    def claim() -> None:
        while len(claimed) < n:
            claimed.extend(run_many(conn, [jobs.claim(DS, 64, time.time() + 60, "w")])[0])

    row = json.dumps({"id": "p", "dataset": DS, "messages": [{"role": "user", "content": "q" * 120}],
                      "completion": "a" * 80, "finish_reason": "stop", "completion_tokens": 16})
    done = jobs.JobEnd.done(jobs.ResultStatus.COMMITTED, 16)
    step("producer: look up + enqueue", lambda: enqueue_prompts(conn, n, result_ttl, batch))
    step("worker: claim", claim)
    step("worker: reserve", lambda: calls(lambda i: budget.reserve(DS, claimed[i].job_id, 64, 30)))
    step("worker: commit", lambda: calls(lambda i: budget.commit(DS, claimed[i].job_id, 30, 16, "stop", row)))
    step("worker: finish", lambda: calls(lambda i: jobs.finish(DS, claimed[i], done, time.time(), "w")))
    step("collector: read + delete", lambda: Collector(conn, stack.dir / "steps-out", [DS]).drain())
    return out


# The step tables' columns: (merged?, producer.result_ttl_s)
STEP_LAYOUTS = [(False, TTLS[0]), (True, TTLS[0]), (True, TTLS[1])]



@dataclass
class CollectorRun:
    rows: int
    row_bytes: int
    wall_s: float
    cpu_s: float

    @property
    def rows_per_cpu_s(self) -> float:
        return self.rows / self.cpu_s


def fill_results(conn, n: int, row_bytes: int) -> None:
    """n entries shaped like commit.lua's XADD: id (job id), kind, row (the JSON line)."""
    pad = "x" * row_bytes
    pipe = conn.pipeline(transaction=False)
    for i in range(n):
        pid = f"p{i}"
        row = {"id": pid, "dataset": DS, "messages": [{"role": "user", "content": "q"}],
               "completion": pad, "finish_reason": "stop", "completion_tokens": 900}
        line = json.dumps(row)
        # Trim the padding so every line is row_bytes long (the test of "4 KB rows").
        row["completion"] = pad[: max(0, row_bytes - (len(line) - row_bytes))]
        pipe.xadd(keys.results_key(DS), {"id": job_id(DS, pid), "kind": "row", "row": json.dumps(row)})
        if i % 1000 == 999:
            pipe.execute()
    pipe.execute()


def collector_run(stack: c.Stack, n: int) -> CollectorRun:
    from budgetq.producer.run.collector import Collector

    stack.flush()
    conn = stack.conn()
    fill_results(conn, n, ROW_BYTES)
    out = stack.dir / "collected"
    shutil.rmtree(out, ignore_errors=True)
    col = Collector(conn, out, [DS])
    t0, p0 = time.perf_counter(), time.process_time()
    wrote = col.drain()
    wall, cpu = time.perf_counter() - t0, time.process_time() - p0
    if wrote != n:
        raise RuntimeError(f"collector wrote {wrote} of {n} rows")
    size = (out / f"{DS}.jsonl").stat().st_size
    return CollectorRun(n, size // n, wall, cpu)


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer prompts (< 1 min)")
    ap.add_argument("--smoke", action="store_true", help="tiny, for the test suite")
    ap.add_argument("--workers", type=int, nargs="+", default=None, help="worker counts to run (1 2 4; --smoke: 1)")
    ap.add_argument("--virtual-workers", type=int, nargs="+", default=None,
                    help="virtual worker counts of the busy-Redis runs (4 16 64; --smoke: 4)")
    args = ap.parse_args(argv)
    if args.workers is None:
        args.workers = [1] if args.smoke else [1, 2, 4]
    if args.virtual_workers is None:
        args.virtual_workers = [4] if args.smoke else [4, 16, 64]
    n, rows = (20_000, 50_000)
    if args.quick:
        n, rows = 4000, 20_000
    if args.smoke:
        n, rows = 300, 1000
    c.print_header("Ceiling: Redis CPU per prompt and collector rows/s on one core", ["bench/ceiling.py", *argv])
    sim = c.Sim("--instant", "--length-mean", "16", "--keep-records", "0")
    stack = c.Stack.start()
    try:
        runs = []
        for workers in args.workers:
            for ttl in TTLS:
                runs.append(redis_run(stack, sim, n, workers, 128, ttl))
                r = runs[-1]
                print(f"  {workers} workers, result_ttl_s {ttl}: {r.cpu_us:.1f} redis CPU us/prompt "
                      f"({r.sys_us:.1f} sys), {r.commands:.1f} commands/prompt", flush=True)
        steps = [step_costs(stack, n, merge, ttl) for merge, ttl in STEP_LAYOUTS]
        sat = []
        busy_n = n if args.smoke else 3 * n  # these go fast: more prompts, a steadier measure
        for vw in args.virtual_workers:
            for ttl in TTLS:
                sat.append((ttl, saturate(stack, busy_n, vw, ttl)))
                print(f"  {vw} virtual workers, result_ttl_s {ttl}: {sat[-1][1].cpu_us:.1f} redis CPU us/prompt, "
                      f"Redis {sat[-1][1].busy:.0%} busy", flush=True)
        col = collector_run(stack, rows)
        print(f"  collector: {col.rows / col.wall_s:,.0f} rows/s", flush=True)
    finally:
        stack.close()
        sim.close()
    print(c.md_table(
        ["workers", "result_ttl_s", "prompts", "wall s", "redis CPU us/prompt", "of which sys", "commands/prompt",
         "round trips/prompt (socket reads)", "bytes in/prompt", "bytes out/prompt",
         "projected prompts/s of one Redis core", "ratio to 20,000/s goal"],
        [[r.workers, r.result_ttl, r.prompts, r.seconds, r.cpu_us, r.sys_us, r.commands, r.reads, r.bytes_in,
          r.bytes_out, r.projected, r.projected / REDIS_GOAL] for r in runs]))
    print()
    last = runs[-1]
    print(f"Where Redis spends it ({last.workers} workers, result_ttl_s {last.result_ttl}; INFO commandstats usec is "
          "wall time, and a script's or a MULTI's commands count both on their own and inside EVALSHA/EXEC):")
    print(c.md_table(["command", "calls/prompt", "usec/prompt"], last.top))
    print()
    print(f"Redis CPU per prompt by step, without the processes ({n:,} prompts, pipelines of 256, quiet server; "
          "us per prompt):")
    heads = [f"{'merged' if merge else 'one call each'}, result_ttl_s {ttl}" for merge, ttl in STEP_LAYOUTS]
    totals = [sum(us for _, us in col_) for col_ in steps]
    print(c.md_table(["step", *heads],
                     [*[[name, *(col_[i][1] for col_ in steps)] for i, (name, _) in enumerate(steps[0])],
                      ["all", *totals]]))
    print()
    mb = col.rows * col.row_bytes / 1e6
    print(c.md_table(
        ["rows", "bytes/row", "wall s", "collector CPU s", "rows/s (wall)", "MB/s (wall)", "rows/s per CPU s",
         "ratio to 10,000/s goal (wall)"],
        [[col.rows, col.row_bytes, col.wall_s, col.cpu_s, col.rows / col.wall_s, mb / col.wall_s,
          col.rows_per_cpu_s, col.rows / col.wall_s / COLLECTOR_GOAL]]))
    print()
    print(f"Redis busy: the workers' Redis calls made by virtual workers in two processes (no HTTP, no per-job "
          f"Python bookkeeping), {sat[0][1].prompts:,} prompts, the enqueue measured before on its own:")
    print(c.md_table(
        ["virtual workers", "result_ttl_s", "prompts/s through Redis", "Redis busy (CPU s per s)", "enqueue us/prompt",
         "workers + collector us/prompt", "redis CPU us/prompt", "script runs/prompt",
         "projected prompts/s of one Redis core", "ratio to 20,000/s goal"],
        [[r.virtual_workers, r_ttl, r.prompts / r.seconds, r.busy, r.enqueue_us, r.worker_us, r.cpu_us,
          r.evalsha_per_prompt, r.projected, r.projected / REDIS_GOAL] for r_ttl, r in sat]))
    print()
    goal_rows = []
    for ttl in TTLS:
        # the run that pushed the most prompts/s through Redis: the closest to the ceiling's regime
        r = max((x for t, x in sat if t == ttl), key=lambda x: x.prompts / x.seconds)
        worst = max((x for x in runs if x.result_ttl == ttl), key=lambda x: x.cpu_us)
        goal_rows.append([f"one Redis core, prompts/s, result_ttl_s {ttl}: Redis {r.busy:.0%} busy", r.projected,
                          REDIS_GOAL,
                          r.projected / REDIS_GOAL, "met" if r.projected >= REDIS_GOAL else "missed"])
        goal_rows.append([f"  (the same at {worst.workers} worker processes, Redis mostly idle)", worst.projected,
                          REDIS_GOAL, worst.projected / REDIS_GOAL, "-"])
    print(c.md_table(
        ["component", "measured", "goal", "ratio to goal", "goal"],
        [*goal_rows,
         ["one collector, 4 KB rows/s", col.rows / col.wall_s, COLLECTOR_GOAL, col.rows / col.wall_s / COLLECTOR_GOAL,
          "met" if col.rows / col.wall_s >= COLLECTOR_GOAL else "missed"]]))


if __name__ == "__main__":
    main(sys.argv[1:])
