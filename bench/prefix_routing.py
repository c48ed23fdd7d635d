"""Prefix-aware routing vs. least in flight: prefill saved by the servers' radix caches.

    python bench/prefix_routing.py [--quick | --smoke]

Four simulators with SGLang's prefix cache modelled (``budgetq sim --radix-cache
--enable-cache-report``, 64 running requests each, a KV pool of 49,152 tokens each, so one
server's cache holds about a third of all shared prefixes) serve one dataset whose prompts
share long system prompts: G = 256 groups, a system prompt of about 600 tokens each. Two
workloads: **uniform** (each prompt's group drawn uniformly: many prefixes, each reused a
few dozen times, e.g. per-task few-shot templates) and **zipf** (s = 1: the hottest group
takes ~16% of all prompts, more than half of one server's share, so it must spill over; the
hot groups fit every server's cache, so least-loaded caches them too). One ``budgetq
worker`` process (--concurrency 256 = all the servers' slots) and the producer run the same
prompts under ``server.routing: least_loaded`` and ``server.routing: prefix``, each in
fresh simulators.

Prefill saved: the prompt tokens the servers found cached (the sum of their cached_tokens),
as a share of all prompt tokens. Load balance: each server's requests held (running + waiting,
sampled from /sim/stats every 0.25 s over the steady part of the run), max / min; also the
requests each served in all. Goal: prefix saves >= 1.5x the prefill least-loaded saves, with
max/min held per server <= 1.25.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import threading
import time
from dataclasses import dataclass

import _common as c

DS = "P1"
SERVERS = 4
GOAL_SAVED = 1.5
GOAL_BALANCE = 1.25
SIM_FLAGS = ("--radix-cache", "--enable-cache-report", "--max-running-requests", "64", "--max-total-num-tokens",
             "49152", "--length-mean", "200", "--length-sigma", "0.5", "--keep-records", "0")


@dataclass
class Run:
    workload: str
    routing: str
    prompts: int
    seconds: float
    prompt_tokens: int
    cached_tokens: int
    requests: list[int]
    cached_by_server: list[int]
    held: list[float]        # mean running + waiting requests per server over the steady part

    @property
    def held_balance(self) -> float:
        return max(self.held) / max(1e-9, min(self.held))

    @property
    def saved(self) -> float:
        return self.cached_tokens / self.prompt_tokens

    @property
    def balance(self) -> float:
        return max(self.requests) / max(1, min(self.requests))


def write_workload(path: c.Path, n: int, groups: int, zipf_s: float, seed: int = 7) -> None:
    rng = random.Random(seed)
    weights = [1 / (k + 1) ** zipf_s for k in range(groups)]
    systems = [f"You are assistant number {g}. " + f"Rule {g}: answer in full sentences, cite the step. " * 40
               for g in range(groups)]
    with open(path, "w") as fh:
        for i in range(n):
            g = rng.choices(range(groups), weights)[0]
            fh.write(json.dumps({"id": f"q{i}", "messages": [
                {"role": "system", "content": systems[g]},
                {"role": "user", "content": f"Question {i}: how many tokens does a budget of {i} words need?"}]})
                + "\n")


def one_run(stack: c.Stack, data: c.Path, n: int, workload: str, routing: str) -> Run:
    sims = [c.Sim(*SIM_FLAGS) for _ in range(SERVERS)]
    try:
        stack.flush()
        ds = {"name": DS, "path": str(data), "budget": 10**12, "mode": "soft", "id_field": "id",
              "messages_field": "messages", "sampling": {"max_tokens": 1024}, "prior_mean_tokens": 200}
        cfg = stack.config(sims[0].url, [ds], server={"urls": [s.url for s in sims], "routing": routing},
                           producer={"progress": "off"}, worker={"concurrency": 256})
        samples: list[list[int]] = []
        stop = threading.Event()

        def sample() -> None:
            while not stop.wait(0.25):
                try:
                    samples.append([(st := s.stats())["running"] + st["queued"] for s in sims])
                except OSError:
                    return

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        t0 = time.monotonic()
        try:
            stack.run(cfg, routing, 1, 256)
        finally:
            stop.set()
            sampler.join()
        seconds = time.monotonic() - t0
        stats = [s.stats() for s in sims]
    finally:
        for s in sims:
            s.close()
    done = sum(s["completed"] for s in stats)
    if done < n:
        raise RuntimeError(f"{routing}: {done} of {n} requests completed")
    # The steady part: samples with at least half of the worker's 256 requests on the servers.
    steady = [x for x in samples if sum(x) >= 128] or samples or [[0] * SERVERS]
    held = [sum(x[i] for x in steady) / len(steady) for i in range(SERVERS)]
    return Run(workload, routing, n, seconds, sum(s["prompt_tokens"] for s in stats),
               sum(s["cached_tokens"] for s in stats), [s["requests"] for s in stats],
               [s["cached_tokens"] for s in stats], held)


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer prompts (< 1 min)")
    ap.add_argument("--smoke", action="store_true", help="tiny, for the test suite")
    args = ap.parse_args(argv)
    n, groups = 8000, 256
    workloads = (("uniform", 0.0), ("zipf", 1.0))
    if args.quick:
        n = 2500
    if args.smoke:  # one workload: each run starts 4 simulators, a worker and a producer
        n, groups, workloads = 300, 32, workloads[:1]
    c.print_header("Prefix-aware routing vs. least in flight: prefill saved on 4 servers",
                   ["bench/prefix_routing.py", *argv])
    stack = c.Stack.start()
    try:
        runs = []
        for workload, zipf_s in workloads:
            data = stack.dir / f"{DS}-{workload}.jsonl"
            write_workload(data, n, groups, zipf_s)
            for routing in ("least_loaded", "prefix"):
                runs.append(one_run(stack, data, n, workload, routing))
                r = runs[-1]
                print(f"  {workload} {routing}: {r.saved:.1%} of prompt tokens cached, requests per server "
                      f"{r.requests}", flush=True)
    finally:
        stack.close()
    print(c.md_table(
        ["workload", "routing", "prompts", "wall s", "prompt tokens", "cached tokens", "prefill saved %",
         "requests per server", "cached tokens per server", "max/min requests", "mean held per server",
         "max/min held"],
        [[r.workload, r.routing, r.prompts, r.seconds, r.prompt_tokens, r.cached_tokens, f"{100 * r.saved:.1f}%",
          " / ".join(map(str, r.requests)), " / ".join(map(str, r.cached_by_server)), r.balance,
          " / ".join(f"{h:.1f}" for h in r.held), r.held_balance] for r in runs]))
    print()
    table = []
    for k in range(0, len(runs), 2):
        ll, px = runs[k], runs[k + 1]
        ratio = px.cached_tokens / max(1, ll.cached_tokens)
        computed = (ll.prompt_tokens - ll.cached_tokens) / max(1, px.prompt_tokens - px.cached_tokens)
        table += [
            [ll.workload, "prefill saved (cached tokens)", ll.cached_tokens, px.cached_tokens, ratio,
             f">= {GOAL_SAVED}: " + ("met" if ratio >= GOAL_SAVED else "missed")],
            [ll.workload, "prefill computed (uncached tokens)", ll.prompt_tokens - ll.cached_tokens,
             px.prompt_tokens - px.cached_tokens, 1 / computed, "-"],
            [ll.workload, "max/min requests held per server (running + waiting)", ll.held_balance,
             px.held_balance, px.held_balance / ll.held_balance,
             f"prefix <= {GOAL_BALANCE}: " + ("met" if px.held_balance <= GOAL_BALANCE else "missed")],
            [ll.workload, "max/min requests served per server", ll.balance, px.balance, px.balance / ll.balance,
             "-"],
            [ll.workload, "wall s", ll.seconds, px.seconds, px.seconds / ll.seconds, "-"]]
    print(c.md_table(["workload", "measure", "least_loaded", "prefix", "ratio prefix / least_loaded", "goal"],
                     table))


if __name__ == "__main__":
    main(sys.argv[1:])
