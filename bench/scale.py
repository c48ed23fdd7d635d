"""Scaling: 1, 2, 4 (, 8) worker processes -> throughput, until the simulator saturates.

    python bench/scale.py [--quick | --smoke]

Each worker process holds 64 requests in flight (--concurrency 64); the producer feeds one
dataset whose budget is never reached. Against an SGLang-like simulator (256 running
requests, 20k tok/s peak, sped up) throughput should follow the simulator's model,
peak * B / (B + 32) for B = min(in flight, 256) running, and stop growing once B reaches
256 (the saturation point: more in flight only queues at the server). The full run also
scales against the zero-latency simulator (--instant), where the limit is CPU: this
machine's 2 cores are shared by the workers, Redis, the producer and the simulator.

Throughput is measured over a steady window that opens `warmup` seconds after the
simulator first runs min(in flight, 256) requests (or, --instant, after the first commit):
tok/s from the simulator's generated-token count, prompts/s from Redis's committed count.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass

import _common as c

from budgetq.shared import keys

DS = "S1"
PER_WORKER = 64
SLOTS = 256


@dataclass
class Point:
    processes: int
    prompts_s: float
    tok_s: float
    running: float
    queued: float
    cpu_busy: float          # share of the machine's cores busy during the window


@dataclass
class Scenario:
    name: str
    sim_flags: list[str]
    speedup: float
    processes: tuple[int, ...]
    warmup_s: float
    window_s: float
    prompts: int
    ramp_share: float = 0.9  # of min(in flight, 256) running before the window opens

    @property
    def instant(self) -> bool:
        return "--instant" in self.sim_flags

    def model_tok_s(self, in_flight: int) -> float:
        b = min(in_flight, SLOTS)
        return self.speedup * 20_000 * b / (b + 32)


def committed(conn) -> int:
    return int(conn.hget(keys.stats_key(DS), "committed") or 0)


def wait_ramp(sim: c.Sim, conn, sc: Scenario, in_flight: int, procs: list) -> None:
    """Until the fleet has ramped up: ``ramp_share`` of its slots busy (short requests end while others
    are being claimed, so all of them at once may never be seen on a loaded machine)."""
    deadline = time.monotonic() + 180
    want = max(1, int(min(in_flight, SLOTS) * sc.ramp_share))
    while (committed(conn) == 0) if sc.instant else (sim.stats()["running"] < want):
        if dead := [p for p in procs if p.poll() is not None]:
            raise RuntimeError(f"{sc.name}: a process exited (rc {dead[0].returncode}) while ramping up to {want} "
                               f"running: {dead[0].args}\n{c.log_text(dead[0])[-2000:]}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{sc.name}: never reached {want} running in 180 s")
        time.sleep(0.05)
    time.sleep(sc.warmup_s)


def measure(stack: c.Stack, sim: c.Sim, sc: Scenario, k: int, data: c.Path) -> Point:
    stack.flush()
    cfg = stack.config(sim.url, [c.dataset(DS, data, 10**12, max_tokens=8192, prior=1500)],
                       worker={"concurrency": PER_WORKER, "grace_s": 0},
                       producer={"progress": "off", "high_water": 4 * PER_WORKER * k})
    procs = [stack.worker(cfg, PER_WORKER, f"worker-{sc.name}-{k}-{i}") for i in range(k)]
    procs.append(stack.producer(cfg, f"producer-{sc.name}-{k}"))
    conn = stack.conn()
    try:
        wait_ramp(sim, conn, sc, k * PER_WORKER, procs)
        s0, n0, t0, cpu0 = sim.stats(), committed(conn), time.monotonic(), c.cpu_ticks()
        running, queued = [], []
        while time.monotonic() - t0 < sc.window_s:
            time.sleep(0.25)
            st = sim.stats()
            running.append(st["running"])
            queued.append(st["queued"])
        s1, n1, t1, cpu1 = sim.stats(), committed(conn), time.monotonic(), c.cpu_ticks()
        if any(p.poll() is not None for p in procs):
            raise RuntimeError(f"{sc.name}: a process ended during the window (too few prompts?)")
    finally:
        for p in procs:
            c.stop_process(p)
    sim.wait_idle()
    dt = t1 - t0
    return Point(k, (n1 - n0) / dt, (s1["generated_tokens"] - s0["generated_tokens"]) / dt,
                 sum(running) / len(running), sum(queued) / len(queued), c.busy_share(cpu0, cpu1))


def table(sc: Scenario, points: list[Point]) -> str:
    rows, prev = [], None
    for p in points:
        in_flight = p.processes * PER_WORKER
        model = 0.0 if sc.instant else sc.model_tok_s(in_flight)
        rows.append([p.processes, in_flight, p.running, p.queued, p.prompts_s, p.prompts_s / p.processes, p.tok_s,
                     model or "-", p.tok_s / model if model else "-",
                     p.prompts_s / prev.prompts_s if prev else 1.0, f"{100 * p.cpu_busy:.0f}%",
                     "yes" if saturated(sc, p) else "no"])
        prev = p
    return c.md_table(["processes", "in flight", "sim running (mean)", "sim queued (mean)", "prompts/s",
                       "prompts/s per process", "tok/s", "model tok/s", "ratio to model",
                       "ratio to previous row", "machine CPU busy", "sim saturated"], rows)


def saturated(sc: Scenario, p: Point) -> bool:
    if sc.instant:
        return False
    return p.running >= 0.95 * SLOTS


def scenarios(args: argparse.Namespace) -> list[Scenario]:
    capacity = ["--max-running-requests", str(SLOTS), "--length-mean", "1500", "--length-sigma", "0.8",
                "--keep-records", "0"]
    if args.smoke:
        # Prompts to spare and half the slots busy: on a loaded machine (the suite beside it) the
        # workers keep fewer in flight, and the prompts must outlast a slow ramp.
        return [Scenario("capacity", [*capacity, "--speedup", "20"], 20, (1, 2), 0.5, 1.5, 30000, 0.5)]
    if args.quick:
        return [Scenario("capacity", [*capacity, "--speedup", "10"], 10, (1, 2, 4), 1.0, 4.0, 6000)]
    return [Scenario("capacity", [*capacity, "--speedup", "10"], 10, (1, 2, 4, 8), 3.0, 15.0, 15000),
            Scenario("instant", ["--instant", "--length-mean", "16", "--keep-records", "0"], 1, (1, 2, 4), 2.0,
                     10.0, 60000)]


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="1, 2, 4 processes, short windows (< 60 s)")
    ap.add_argument("--smoke", action="store_true", help="tiny, for the test suite")
    args = ap.parse_args(argv)
    c.print_header("Scaling: worker processes x 64 in flight", ["bench/scale.py", *argv])
    stack = c.Stack.start()
    try:
        for sc in scenarios(args):
            data = stack.dir / f"{sc.name}.jsonl"
            c.write_prompts(data, sc.prompts)
            sim = c.Sim(*sc.sim_flags)
            try:
                points = []
                for k in sc.processes:
                    points.append(measure(stack, sim, sc, k, data))
                    print(f"  {sc.name}, {k} processes: {points[-1].prompts_s:,.0f} prompts/s, "
                          f"{points[-1].tok_s:,.0f} tok/s", flush=True)
            finally:
                sim.close()
            print(f"\nsimulator: budgetq sim {' '.join(sc.sim_flags)}; window {sc.window_s} s after "
                  f"{sc.warmup_s} s warm-up")
            print(table(sc, points))
            sat = next((p.processes for p in points if saturated(sc, p)), None)
            if not sc.instant:
                print(f"saturation point: {SLOTS} running requests (--max-running-requests), reached with "
                      + (f"{sat} processes x {PER_WORKER} in flight" if sat else "none of these process counts"))
            print(flush=True)
    finally:
        stack.close()


if __name__ == "__main__":
    main(sys.argv[1:])
