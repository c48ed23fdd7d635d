"""Workers 20 ms (round trip) away from Redis vs. on loopback: output tok/s of the same run.

    python bench/network_rtt.py [--quick | --smoke] [--rtt-ms 20] [--length-mean 2000]

The producer runs beside Redis (loopback) in both runs, as in a deployment where Redis and the
producer share a host and the workers are on GPU nodes; the workers reach Redis either directly
(loopback) or through a relay that holds every chunk for RTT/2 each way (simulator/relay.py:
this kernel has no netem; it emulates propagation delay only, no loss). Throughput is the
simulator's generated-token count over a steady window (bench/pipeline_vs_direct.py's
``measure_window``), runs alternating loopback, rtt, loopback, rtt. Each worker logs the Redis
round trips it made at exit: round trips per job are those over the jobs it processed (a job
that is claimed while the window closes counts towards the next run's stop, so this is per
processed job, all jobs of the run). Target: rtt / loopback >= 0.95.
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
from dataclasses import dataclass

import _common as c
from pipeline_vs_direct import Settings, Window, measure_window

from budgetq.simulator.local import free_port, stop_process

DS = "N1"
MAX_TOKENS = 8192


@dataclass
class Run:
    window: Window
    jobs: int
    round_trips: int


def relay(to_port: int, rtt_ms: float) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([*c.CLI[:1], "-m", "budgetq.simulator.relay", "--listen", f"127.0.0.1:{port}",
                             "--to", f"127.0.0.1:{to_port}", "--rtt-ms", str(rtt_ms)], cwd=c.ROOT, env=c.ENV,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    proc.stdout.readline()  # its "relay ..." line: listening
    return proc, f"redis://127.0.0.1:{port}/0"


def one_run(stack: c.Stack, sim: c.Sim, n: int, s: Settings, worker_url: str, name: str) -> Run:
    stack.flush()
    data = stack.dir / f"{DS}.jsonl"
    c.write_prompts(data, s.prompts)
    cfg = stack.config(sim.url, [c.dataset(DS, data, 10**12, max_tokens=MAX_TOKENS, prior=2000)],
                       worker={"concurrency": n, "grace_s": 0}, producer={"progress": "off"})
    worker = stack.worker(cfg, n, f"worker-{name}", "--redis-url", worker_url)
    producer = stack.producer(cfg, f"producer-{name}")
    try:
        w = asyncio.run(measure_window(sim, n, s, alive=lambda: worker.poll() is None and producer.poll() is None))
    finally:
        stop_process(producer)
        stop_process(worker)
    sim.wait_idle()
    ex = c.worker_exit(c.log_text(worker))
    return Run(w, ex.processed, ex.round_trips)


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="short windows, one pair")
    ap.add_argument("--smoke", action="store_true", help="tiny, for the test suite")
    ap.add_argument("--rtt-ms", type=float, default=20.0)
    ap.add_argument("--length-mean", type=int, default=2000, help="mean completion tokens (shorter: RTT weighs more)")
    args = ap.parse_args(argv)
    s = Settings(speedup=4, warmup_s=3, window_s=20, pairs=2, concurrencies=(64,), prompts=6000)
    if args.quick:
        s = Settings(speedup=4, warmup_s=1, window_s=6, pairs=1, concurrencies=(64,), prompts=3000)
    if args.smoke:
        s = Settings(speedup=8, warmup_s=0.5, window_s=1.5, pairs=1, concurrencies=(32,), prompts=800)
    c.print_header(f"Workers {args.rtt_ms:g} ms RTT from Redis vs. loopback", ["bench/network_rtt.py", *argv])
    print(f"simulator: --max-running-requests 256 --speedup {s.speedup} --length-mean {args.length_mean} "
          f"--length-sigma 0.8; "
          f"window {s.window_s} s after {s.warmup_s} s of warm-up; relay rtt {args.rtt_ms:g} ms\n", flush=True)
    sim = c.Sim("--max-running-requests", "256", "--speedup", str(s.speedup), "--length-mean", str(args.length_mean),
                "--length-sigma", "0.8", "--keep-records", "0")
    stack = c.Stack.start()
    rel, rtt_url = relay(stack.redis.port, args.rtt_ms)
    rows, summary = [], []
    try:
        for n in s.concurrencies:
            got: dict[str, list[Run]] = {"loopback": [], "rtt": []}
            for rep in range(s.pairs):
                for kind in ("loopback", "rtt"):
                    r = one_run(stack, sim, n, s, stack.url if kind == "loopback" else rtt_url, f"{kind}-{n}-{rep}")
                    got[kind].append(r)
                    per_job = r.round_trips / max(1, r.jobs)
                    rows.append([n, rep + 1, kind, r.window.seconds, r.window.tokens, r.window.tok_s,
                                 r.window.mean_running, r.jobs, r.round_trips, f"{per_job:.2f}"])
                    print(f"  {n} in flight, {kind}: {r.window.tok_s:,.0f} tok/s, {per_job:.2f} round trips per job",
                          flush=True)
            tok = {k: sum(r.window.tokens for r in rs) / sum(r.window.seconds for r in rs) for k, rs in got.items()}
            trips = {k: sum(r.round_trips for r in rs) / max(1, sum(r.jobs for r in rs)) for k, rs in got.items()}
            ratio = tok["rtt"] / tok["loopback"]
            summary.append([n, args.rtt_ms, tok["loopback"], tok["rtt"], f"{trips['loopback']:.2f}",
                            f"{trips['rtt']:.2f}", f"{ratio:.4f}", "met" if ratio >= 0.95 else "missed"])
    finally:
        stop_process(rel)
        stack.close()
        sim.close()
    print(c.md_table(["in flight", "repeat", "redis link", "window s", "tokens", "tok/s", "mean running at the sim",
                      "jobs", "round trips", "round trips per job"], rows))
    print()
    print(c.md_table(["in flight", "rtt ms", "loopback tok/s", "rtt tok/s", "round trips per job (loopback)",
                      "round trips per job (rtt)", "ratio rtt / loopback", "target >= 0.95"], summary))


if __name__ == "__main__":
    main(sys.argv[1:])
