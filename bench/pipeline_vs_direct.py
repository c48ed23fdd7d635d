"""Pipeline vs. direct client: output tok/s of a full budgetq run over a plain aiohttp client.

    python bench/pipeline_vs_direct.py [--quick | --smoke] [--stream both|on|off]

Both hold the same number of requests in flight against the same capacity-limited simulator
(SGLang-like: 256 running requests, 20k tok/s peak, sped up so a request lasts seconds).
"pipeline" is producer + one `budgetq worker --concurrency N` + Redis; "direct" is N asyncio
tasks in this process, each sending the worker's exact request body (worker.sglang_client.
build_request) for the next prompt as soon as its last answer arrived, with the same rids, so
both see the same response lengths. Throughput is the simulator's own generated-token count
(it includes tokens of requests still running) over a steady window: the window opens `warmup`
seconds after the simulator first reports N requests running (start-up and ramp-up excluded)
and closes before anything is stopped (the tail is excluded). Runs alternate direct,
pipeline, direct, pipeline to cancel drift. Target: pipeline / direct >= 0.99 at 64 and 256.

``--stream both`` (the default) runs the pipeline twice per pair, its worker streaming answers
(``server.stream: true``, the default: SSE, tokens so far, the loop guard on every
chunk) and not (``false``: one JSON answer per request); the direct client stays the plain
non-streaming one. Also printed: the worker process's CPU seconds per 1,000 generated tokens over
the window (/proc: user + system), the cost of reading and guarding the streams.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import sys
import time
from dataclasses import dataclass

import _common as c
import aiohttp

from budgetq.shared.config import ServerConfig
from budgetq.shared.schema import JobPayload, Message, SamplingParams
from budgetq.worker.sglang_wire import build_request

DS = "P1"
MAX_TOKENS = 8192
PROMPT = "Explain, step by step and with an example, how a token budget decides which prompts get an answer."


@dataclass
class Window:
    tokens: int
    seconds: float
    running: list[int]
    cpu_s: float = 0.0   # the worker's CPU seconds over the window (pipeline only)

    @property
    def cpu_per_1k(self) -> float:
        return 1000 * self.cpu_s / max(1, self.tokens)

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds

    @property
    def mean_running(self) -> float:
        return sum(self.running) / max(1, len(self.running))


@dataclass
class Settings:
    speedup: float
    warmup_s: float
    window_s: float
    pairs: int
    concurrencies: tuple[int, ...]
    prompts: int


async def _stats(session: aiohttp.ClientSession, sim: c.Sim) -> dict:
    async with session.get(sim.url + "/sim/stats") as r:
        return await r.json()


async def measure_window(sim: c.Sim, n: int, s: Settings, alive=lambda: True, pid: int | None = None) -> Window:
    """Wait for n running, then warm up, then count generated tokens (and ``pid``'s CPU) over the window."""
    async with aiohttp.ClientSession() as session:
        deadline = time.monotonic() + 60
        while (await _stats(session, sim))["running"] < n:
            if time.monotonic() > deadline or not alive():
                raise RuntimeError(f"the simulator never had {n} requests running")
            await asyncio.sleep(0.05)
        await asyncio.sleep(s.warmup_s)
        s0, t0 = await _stats(session, sim), time.monotonic()
        cpu0 = c.cpu_s(pid) if pid is not None else 0.0
        running = []
        while time.monotonic() - t0 < s.window_s:
            await asyncio.sleep(0.2)
            running.append((await _stats(session, sim))["running"])
        s1, t1 = await _stats(session, sim), time.monotonic()
        cpu1 = c.cpu_s(pid) if pid is not None else 0.0
    return Window(s1["generated_tokens"] - s0["generated_tokens"], t1 - t0, running, cpu1 - cpu0)


async def _direct(sim: c.Sim, n: int, s: Settings) -> Window:
    server = ServerConfig(urls=[sim.url])
    ids = itertools.count()

    async def client(session: aiohttp.ClientSession) -> None:
        while True:
            i = next(ids)
            payload = JobPayload(id=f"p{i}", dataset=DS, messages=[Message(role="user", content=f"{i}: {PROMPT}")],
                                 sampling=SamplingParams(max_tokens=MAX_TOKENS))
            path, body = build_request(server, payload, f"{DS}-p{i}")
            async with session.post(sim.url + path, json=body) as r:
                await r.json()

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        tasks = [asyncio.create_task(client(session)) for _ in range(n)]
        try:
            return await measure_window(sim, n, s)
        finally:
            for t in tasks:
                t.cancel()  # disconnects: the simulator aborts what was running
            await asyncio.gather(*tasks, return_exceptions=True)


def direct(sim: c.Sim, n: int, s: Settings) -> Window:
    w = asyncio.run(_direct(sim, n, s))
    sim.wait_idle()
    return w


def pipeline(stack: c.Stack, sim: c.Sim, n: int, s: Settings, stream: bool = False) -> Window:
    stack.flush()
    data = stack.dir / f"{DS}.jsonl"
    c.write_prompts(data, s.prompts)
    cfg = stack.config(sim.url, [c.dataset(DS, data, 10**12, max_tokens=MAX_TOKENS, prior=2000)],
                       server={"urls": [sim.url], "stream": stream},
                       worker={"concurrency": n, "grace_s": 0}, producer={"progress": "off"})
    worker = stack.worker(cfg, n, f"worker-{n}")
    producer = stack.producer(cfg, f"producer-{n}")
    try:
        w = asyncio.run(measure_window(sim, n, s, alive=lambda: worker.poll() is None and producer.poll() is None,
                                       pid=worker.pid))
    finally:
        c.stop_process(producer)
        c.stop_process(worker)
    sim.wait_idle()
    return w


def expected_tok_s(n: int, speedup: float, peak: float = 20_000, half: float = 32, slots: int = 256) -> float:
    """The simulator's model: peak * B / (B + half_batch), B = min(n, slots), times the speed-up."""
    b = min(n, slots)
    return speedup * peak * b / (b + half)


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="short windows, one pair (< 60 s)")
    ap.add_argument("--smoke", action="store_true", help="tiny, for the test suite")
    ap.add_argument("--stream", choices=("both", "on", "off"), default="both",
                    help="the pipeline's worker streams answers (on), does not (off), or both in turn")
    args = ap.parse_args(argv)
    kinds = {"both": ["direct", "pipeline (stream)", "pipeline (no stream)"], "on": ["direct", "pipeline (stream)"],
             "off": ["direct", "pipeline (no stream)"]}[args.stream]
    s = Settings(speedup=4, warmup_s=3, window_s=20, pairs=2, concurrencies=(64, 256), prompts=6000)
    if args.quick:
        s = Settings(speedup=4, warmup_s=1, window_s=4, pairs=1, concurrencies=(64, 256), prompts=3000)
    if args.smoke:
        s = Settings(speedup=8, warmup_s=0.5, window_s=1.5, pairs=1, concurrencies=(64,), prompts=1000)
    c.print_header("Pipeline (producer + worker + Redis) vs. a direct aiohttp client",
                   ["bench/pipeline_vs_direct.py", *argv])
    print(f"simulator: --max-running-requests 256 --speedup {s.speedup} --length-mean 2000 --length-sigma 0.8; "
          f"window {s.window_s} s after {s.warmup_s} s of warm-up\n", flush=True)
    sim = c.Sim("--max-running-requests", "256", "--speedup", str(s.speedup), "--length-mean", "2000",
                "--length-sigma", "0.8", "--keep-records", "0")
    stack = c.Stack.start()
    rows, summary = [], []
    try:
        for n in s.concurrencies:
            got: dict[str, list[Window]] = {k: [] for k in kinds}
            for rep in range(s.pairs):
                for kind in kinds:
                    if kind == "direct":
                        w = direct(sim, n, s)
                    else:
                        w = pipeline(stack, sim, n, s, stream=kind == "pipeline (stream)")
                    got[kind].append(w)
                    rows.append([n, rep + 1, kind, w.seconds, w.tokens, w.tok_s, w.mean_running,
                                 w.tok_s / expected_tok_s(n, s.speedup),
                                 f"{w.cpu_per_1k * 1000:.2f}" if kind != "direct" else "-"])
                    print(f"  {n} in flight, {kind}: {w.tok_s:,.0f} tok/s, {w.mean_running:.1f} running", flush=True)
            tok = {k: sum(w.tokens for w in ws) / sum(w.seconds for w in ws) for k, ws in got.items()}
            for kind in kinds[1:]:
                ratio = tok[kind] / tok["direct"]
                cpu = 1e6 * sum(w.cpu_s for w in got[kind]) / max(1, sum(w.tokens for w in got[kind]))
                summary.append([n, kind, tok["direct"], tok[kind], f"{ratio:.4f}", f"{cpu:.2f}",
                                "met" if ratio >= 0.99 else ("met 0.97" if ratio >= 0.97 else "missed")])
    finally:
        stack.close()
        sim.close()
    print(c.md_table(["in flight", "repeat", "client", "window s", "tokens", "tok/s", "mean running at the sim",
                      "ratio to the sim's model", "worker CPU ms / 1k tokens"], rows))
    print()
    print(c.md_table(["in flight", "pipeline", "direct tok/s", "pipeline tok/s", "ratio pipeline / direct",
                      "worker CPU ms / 1k tokens", "target >= 0.99 (0.97 streamed)"], summary))


if __name__ == "__main__":
    main(sys.argv[1:])
