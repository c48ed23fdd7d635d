"""Workers 20 ms (round trip) away from Redis vs. on loopback: latency per request, and output tok/s of the same run.

    python bench/network_rtt.py [--quick | --smoke] [--rtt-ms 20] [--length-mean 2000]
    python bench/network_rtt.py --part per-request [--pairs 3] [--lengths 30,300]   # latency only (~4 min)
    python bench/network_rtt.py --part throughput --quick --length-mean 300 --pairs 3  # tok/s only

Latency per request, first: what the relay adds, measured side by side, in
pairs (direct, relay, direct, relay, ...), each pair's numbers and their min-max printed:

- per Redis round trip: blocks of sequential PINGs, the median of each block, directly and
  through the relay. What the relay adds beyond its RTT is its own cost (an asyncio hop, a
  timer): it should be a small fraction of the RTT it emulates.
- per generation request, with short answers (tens of tokens, where a round trip weighs most)
  and longer ones: one worker with a few requests in flight, few enough that no process is
  short of CPU; a request's cycle is in flight x window / requests completed in the window
  (from the simulator's count), so the added latency per request is cycle(relay) -
  cycle(loopback), and the requests/s ratio is relay / loopback.

Then throughput:

The producer runs beside Redis (loopback) in both runs, as in a deployment where Redis and the
producer share a host and the workers are on GPU nodes; the workers reach Redis either directly
(loopback) or through a relay that holds every chunk for RTT/2 each way (simulator/relay.py:
this kernel has no netem; it emulates propagation delay only, no loss). Throughput is the
simulator's generated-token count over a steady window (bench/pipeline_vs_direct.py's
``measure_window``, opened once half of the requests are at the simulator), runs alternating
loopback, rtt, loopback, rtt; each pair's ratio is printed with the pooled one. Each worker logs the Redis
round trips it made at exit: round trips per job are those over the jobs it processed (a job
that is claimed while the window closes counts towards the next run's stop, so this is per
processed job, all jobs of the run). Target: rtt / loopback >= 0.95.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass

import _common as c
import redis
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
        # The window opens warm-up seconds after the simulator first holds half of them: through the relay, with
        # short requests, each spends a few round trips away from the server and all n are rarely there at once.
        w = asyncio.run(measure_window(sim, max(1, n // 2), s,
                                       alive=lambda: worker.poll() is None and producer.poll() is None))
    finally:
        stop_process(producer)
        stop_process(worker)
    sim.wait_idle()
    ex = c.worker_exit(c.log_text(worker))
    return Run(w, ex.processed, ex.round_trips)


def ping_ms(port: int, pings: int) -> float:
    """The median of ``pings`` sequential PINGs, in ms, on one connection (opened and warmed first)."""
    conn = redis.Redis(port=port, socket_timeout=30)
    try:
        conn.ping()
        times = []
        for _ in range(pings):
            t0 = time.perf_counter()
            conn.ping()
            times.append(time.perf_counter() - t0)
    finally:
        conn.close()
    return 1000 * statistics.median(times)


def spread(values: list[float], fmt: str = "{:.1f}") -> str:
    return f"{fmt.format(min(values))}-{fmt.format(max(values))}" if len(values) > 1 else fmt.format(values[0])


def verdict(each: list[float], target: float) -> str:
    """Met only when every pair is: a pooled ratio whose pairs straddle the target says nothing either way."""
    if min(each) >= target:
        return "met"
    if max(each) < target:
        return "missed"
    return f"unresolved: the pairs straddle {target:g}"


def relay_round_trips(stack: c.Stack, relay_port: int, rtt_ms: float, pairs: int, pings: int) -> None:
    rows, added = [], []
    for rep in range(pairs):
        direct, through = ping_ms(stack.redis.port, pings), ping_ms(relay_port, pings)
        added.append(through - direct)
        rows.append([rep + 1, f"{direct:.2f}", f"{through:.2f}", f"{through - direct:.2f}",
                     f"{through - direct - rtt_ms:.2f}"])
    print(f"Redis round trip, direct vs through the relay ({pings} sequential PINGs per block, median; "
          f"{pairs} pairs)\n")
    print(c.md_table(["pair", "direct ms", "relay ms", "added ms", "added beyond the rtt, ms"], rows))
    print(f"\nadded per round trip: {spread(added, '{:.2f}')} ms for an rtt of {rtt_ms:g} ms\n", flush=True)


@dataclass
class Cycle:
    completed: int
    seconds: float
    tokens: int

    def cycle_ms(self, n: int) -> float:
        return 1000 * n * self.seconds / max(1, self.completed)


def count_window(sim: c.Sim, n: int, warmup_s: float, window_s: float, alive, ramp_share: float = 1.0) -> Cycle:
    """Requests completed and tokens generated at the simulator over a window that opens ``warmup_s``
    after it first has ``ramp_share`` of ``n`` running (--smoke: half; on a loaded machine short requests
    end while the others are being claimed, so all ``n`` at once may never be seen)."""
    want = max(1, int(n * ramp_share))
    deadline = time.monotonic() + 60
    while sim.stats()["running"] < want:
        if not alive():
            raise RuntimeError(f"a process exited before the simulator had {want} requests running")
        if time.monotonic() > deadline:
            raise RuntimeError(f"the simulator never had {want} requests running in 60 s")
        time.sleep(0.02)
    time.sleep(warmup_s)
    s0, t0 = sim.stats(), time.monotonic()
    time.sleep(window_s)
    s1, t1 = sim.stats(), time.monotonic()
    return Cycle(s1["completed"] - s0["completed"], t1 - t0, s1["generated_tokens"] - s0["generated_tokens"])


def one_cycle_run(stack: c.Stack, sim: c.Sim, n: int, worker_url: str, name: str, warmup_s: float,
                  window_s: float, ramp_share: float = 1.0) -> Cycle:
    stack.flush()
    data = stack.dir / f"{DS}.jsonl"
    c.write_prompts(data, 20000)
    cfg = stack.config(sim.url, [c.dataset(DS, data, 10**12, max_tokens=MAX_TOKENS, prior=100)],
                       worker={"concurrency": n, "grace_s": 0}, producer={"progress": "off"})
    worker = stack.worker(cfg, n, f"worker-{name}", "--redis-url", worker_url)
    producer = stack.producer(cfg, f"producer-{name}")
    try:
        return count_window(sim, n, warmup_s, window_s, alive=lambda: worker.poll() is None and producer.poll() is None,
                            ramp_share=ramp_share)
    finally:
        stop_process(producer)
        stop_process(worker)
        sim.wait_idle()


def per_request(stack: c.Stack, rtt_url: str, rtt_ms: float, lengths: list[int], n: int, pairs: int,
                warmup_s: float, window_s: float, speedup: float, ramp_share: float = 1.0) -> None:
    rows, summary = [], []
    for length in lengths:
        sim = c.Sim("--max-running-requests", "256", "--speedup", str(speedup), "--length-mean", str(length),
                    "--length-sigma", "0.3", "--keep-records", "0")
        added, ratio = [], []
        cycles: dict[str, list[float]] = {"loopback": [], "rtt": []}
        try:
            for rep in range(pairs):
                got = {}
                for kind in ("loopback", "rtt"):
                    got[kind] = one_cycle_run(stack, sim, n, stack.url if kind == "loopback" else rtt_url,
                                              f"req-{length}-{kind}-{rep}", warmup_s, window_s, ramp_share)
                    cycles[kind].append(got[kind].cycle_ms(n))
                a = got["rtt"].cycle_ms(n) - got["loopback"].cycle_ms(n)
                r = (got["rtt"].completed / got["rtt"].seconds) / (got["loopback"].completed / got["loopback"].seconds)
                added.append(a)
                ratio.append(r)
                rows.append([length, rep + 1, got["loopback"].completed, f"{got['loopback'].cycle_ms(n):.1f}",
                             got["rtt"].completed, f"{got['rtt'].cycle_ms(n):.1f}", f"{a:.1f}", f"{r:.4f}"])
                print(f"  ~{length} tokens, pair {rep + 1}: {got['loopback'].cycle_ms(n):.1f} ms loopback, "
                      f"{got['rtt'].cycle_ms(n):.1f} ms through the relay per request", flush=True)
        finally:
            sim.close()
        summary.append([length, n, pairs, spread(cycles["loopback"]), spread(cycles["rtt"]), spread(added),
                        f"{statistics.median(ratio):.4f}", spread(ratio, "{:.4f}")])
    print(f"\nPer request, {n} in flight, one worker ({window_s:g} s windows after {warmup_s:g} s; simulator "
          f"--speedup {speedup:g} --length-sigma 0.3)\n")
    print(c.md_table(["tokens (mean)", "pair", "requests loopback", "ms per request loopback", "requests rtt",
                      "ms per request rtt", "added ms", "ratio requests/s rtt / loopback"], rows))
    print()
    print(c.md_table(["tokens (mean)", "in flight", "pairs", "ms per request loopback (min-max)",
                      f"ms per request, {rtt_ms:g} ms rtt (min-max)", "added ms per request (min-max)",
                      "ratio requests/s rtt / loopback (median)", "its min-max"], summary))
    print(flush=True)


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="short windows, one pair")
    ap.add_argument("--smoke", action="store_true", help="tiny, for the test suite")
    ap.add_argument("--rtt-ms", type=float, default=20.0)
    ap.add_argument("--length-mean", type=int, default=2000, help="mean completion tokens (shorter: RTT weighs more)")
    ap.add_argument("--part", choices=("all", "per-request", "throughput"), default="all")
    ap.add_argument("--pairs", type=int, help="pairs of each part (default: 3 for the latency per request, 2 for "
                    "throughput, 1 with --quick or --smoke)")
    ap.add_argument("--lengths", default="30,300", help="mean answer lengths of the latency per request")
    args = ap.parse_args(argv)
    lengths = [int(x) for x in args.lengths.split(",")]
    s = Settings(speedup=4, warmup_s=3, window_s=20, pairs=2, concurrencies=(64,), prompts=6000)
    if args.quick:
        s = Settings(speedup=4, warmup_s=1, window_s=6, pairs=1, concurrencies=(64,), prompts=3000)
    if args.smoke:
        s = Settings(speedup=8, warmup_s=0.5, window_s=1.5, pairs=1, concurrencies=(32,), prompts=800)
    if args.pairs:
        s.pairs = args.pairs
    c.print_header(f"Workers {args.rtt_ms:g} ms RTT from Redis vs. loopback", ["bench/network_rtt.py", *argv])
    stack = c.Stack.start()
    rel, rtt_url = relay(stack.redis.port, args.rtt_ms)
    pairs = args.pairs or (1 if args.smoke else 3)
    try:
        relay_round_trips(stack, int(rtt_url.rsplit(":", 1)[1].split("/")[0]), args.rtt_ms, max(3, pairs),
                          20 if args.smoke else 100)
        if args.part != "throughput":
            per_request(stack, rtt_url, args.rtt_ms, lengths[:1] if args.smoke else lengths, 8, pairs,
                        0.5 if args.smoke else 1.0, 1.0 if args.smoke else 4.0, 4, 0.5 if args.smoke else 1.0)
    except BaseException:
        stop_process(rel)
        stack.close()
        raise
    if args.part == "per-request":
        stop_process(rel)
        stack.close()
        return
    print(f"simulator: --max-running-requests 256 --speedup {s.speedup} --length-mean {args.length_mean} "
          f"--length-sigma 0.8; "
          f"window {s.window_s} s after {s.warmup_s} s of warm-up; relay rtt {args.rtt_ms:g} ms\n", flush=True)
    sim = c.Sim("--max-running-requests", "256", "--speedup", str(s.speedup), "--length-mean", str(args.length_mean),
                "--length-sigma", "0.8", "--keep-records", "0")
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
            each = [r.window.tok_s / lo.window.tok_s for lo, r in zip(got["loopback"], got["rtt"], strict=True)]
            summary.append([n, args.rtt_ms, s.pairs, tok["loopback"], tok["rtt"], f"{trips['loopback']:.2f}",
                            f"{trips['rtt']:.2f}", f"{ratio:.4f}", spread(each, "{:.4f}"),
                            verdict(each, 0.95)])
    finally:
        stop_process(rel)
        stack.close()
        sim.close()
    print(c.md_table(["in flight", "repeat", "redis link", "window s", "tokens", "tok/s", "mean running at the sim",
                      "jobs", "round trips", "round trips per job"], rows))
    print()
    print(c.md_table(["in flight", "rtt ms", "pairs", "loopback tok/s", "rtt tok/s", "round trips per job (loopback)",
                      "round trips per job (rtt)", "ratio rtt / loopback", "each pair's (min-max)", "target >= 0.95"],
                     summary))


if __name__ == "__main__":
    main(sys.argv[1:])
