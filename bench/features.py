"""Hidden states (issue 17): decode/write MB/s per process, and the features pass against a direct client.

    python bench/features.py [--smoke] [--hidden-size 4096] [--rows 48] [--concurrency 8]

1. Per worker process: MB/s of hidden states decoded (SGLang's JSON -> bfloat16 bytes,
   worker/hidden_decode.py) and written (safetensors shards, producer/feature_store.py).
2. Prefill tok/s of the whole features pass (`budgetq features` + one `budgetq features-worker`,
   Redis in between, shards + index on disk) over a direct client: asyncio + aiohttp in one
   process, the same request bodies and the same number in flight, the same decode in a process
   pool of the same size, each sample's bytes written to a file. Both against one simulator
   (`--enable-return-hidden-states`, the chosen hidden size, its prefill capacity model).
   Runs alternate direct, pass, direct, pass. Target: pass / direct >= 0.95.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

import _common as c
import aiohttp
import numpy as np
import orjson
import yaml

from producer.feature_store import FeatureStore
from producer.features_inputs import committed_rows, conversation_ids
from producer.tokenize import load_tokenizer
from shared.features_schema import FeaturesMeta
from simulator.hidden import vectors
from simulator.local import free_port, wait_http
from tests.tiny_tokenizer import make_tiny_tokenizer
from worker.hidden_decode import decode
from worker.sglang_wire import prefill_body

WORDS = ["hello", "what", "is", "the", "answer", "question", "explain", "write", "about", "of", "and"]


def write_rows(path: Path, n: int, answer_words: int) -> None:
    rng = np.random.default_rng(1)
    with open(path, "w") as fh:
        for i in range(n):
            q = " ".join(rng.choice(WORDS, 20))
            a = " ".join(rng.choice(WORDS, answer_words))
            fh.write(orjson.dumps({"id": f"r{i}", "dataset": "H", "prompt_tokens": 1, "completion_tokens": 1,
                                   "conversations": [{"role": "user", "content": q},
                                                     {"role": "assistant", "content": a}],
                                   "finish_reason": "stop", "model": "sim", "endpoint": "x",
                                   "latency_s": 0.1}).decode() + "\n")


def per_process(hidden: int, tokens: int, repeat: int, tmp: Path) -> list[list[object]]:
    ids = np.arange(tokens) % 1000
    arr = vectors(ids, np.arange(tokens), hidden)
    body = orjson.dumps({"meta_info": {"hidden_states": [arr]}}, option=orjson.OPT_SERIALIZE_NUMPY)
    t0 = time.perf_counter()
    for _ in range(repeat):
        blob, shape = decode(body, tokens, "bfloat16")
    dec_s = (time.perf_counter() - t0) / repeat
    store = FeatureStore(tmp, "W", shard_bytes=10**12)
    meta = FeaturesMeta(id="x", dataset="W", input_ids=ids.tolist(), loss_start=0, loss_end=tokens, shape=shape)
    t0 = time.perf_counter()
    for i in range(repeat):
        store.add(meta.model_copy(update={"id": f"x{i}"}), blob)
    store.flush()
    wr_s = (time.perf_counter() - t0) / repeat
    mb = len(blob) / 2**20
    return [["decode (JSON -> bfloat16)", f"{tokens} x {hidden}", round(len(body) / 2**20, 1), round(mb, 1),
             round(mb / dec_s, 1), round(tokens / dec_s)],
            ["write (shard + index, fsync)", f"{tokens} x {hidden}", "-", round(mb, 1), round(mb / wr_s, 1),
             round(tokens / wr_s)]]


async def direct(url: str, samples: list[list[int]], concurrency: int, procs: int, out: Path) -> float:
    out.mkdir(parents=True, exist_ok=True)
    pool = ProcessPoolExecutor(procs, mp_context=get_context("spawn"))
    loop = asyncio.get_running_loop()
    await asyncio.gather(*[loop.run_in_executor(pool, int, 0) for _ in range(procs)])  # warm, like the worker's
    queue = list(enumerate(samples))
    t0 = time.perf_counter()

    async def one(session: aiohttp.ClientSession) -> None:
        while queue:
            i, ids = queue.pop()
            async with session.post(url + "/generate", json=prefill_body(ids, f"d{i}.{time.time_ns()}")) as r:
                body = await r.read()
            blob, _ = await loop.run_in_executor(pool, decode, body, len(ids), "bfloat16")
            (out / f"{i}.bin").write_bytes(blob)

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        await asyncio.gather(*[one(session) for _ in range(concurrency)])
    elapsed = time.perf_counter() - t0
    pool.shutdown()
    return elapsed


def run_pass(cfg_path: Path, out: Path, concurrency: int) -> float:
    """The pass in this process (its start-up, imports and Redis connection, is not timed, as direct's
    is not); the worker is a `budgetq features-worker` subprocess, started and warm before the clock."""
    import shutil

    import redis as redis_py

    from producer.features import FeaturesPass
    from shared.config import load_config

    shutil.rmtree(out / "H", ignore_errors=True)
    cfg = load_config(cfg_path)
    worker = subprocess.Popen([*c.CLI, "--log-level", "WARNING", "features-worker", "-c", str(cfg_path),
                               "--concurrency", str(concurrency)], cwd=c.ROOT, env=c.ENV)
    time.sleep(3.0)  # its decode processes start (spawn) before the clock runs, as direct's pool
    fp = FeaturesPass(cfg, redis_py.Redis.from_url(cfg.redis_url))
    t0 = time.perf_counter()
    rep = fp.run()
    elapsed = time.perf_counter() - t0
    c.stop_process(worker)
    if not rep.ok or rep.datasets["H"]["captured"] == 0:
        raise SystemExit(f"features pass failed: {rep}")
    return elapsed


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--hidden-size", type=int, default=4096)
    ap.add_argument("--rows", type=int, default=48)
    ap.add_argument("--answer-words", type=int, default=500)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--decode-processes", type=int, default=2)
    ap.add_argument("--prefill-tok-s", type=float, default=20_000.0)
    ap.add_argument("--pairs", type=int, default=2)
    # Shards close during the run, as in a real one (hours at 512 MB a shard); the pass's last write
    # (one shard) is its tail, which a short run would otherwise weigh far more than a real one does.
    ap.add_argument("--shard-mb", type=float, default=16.0)
    args = ap.parse_args(argv)
    if args.smoke:
        args.hidden_size, args.rows, args.answer_words, args.pairs = 256, 8, 60, 1
    c.print_header("Hidden states: decode/write per process, features pass vs direct client", ["bench/features.py",
                                                                                                  *argv])
    tmp = Path(tempfile.mkdtemp(prefix="bq-features-bench-"))
    print("\n## per worker process\n")
    rows = per_process(args.hidden_size, 512 if args.smoke else 4096, 2 if args.smoke else 3, tmp / "pp")
    print(c.md_table(["step", "tokens x hidden", "JSON MB", "bfloat16 MB", "MB/s (bfloat16)", "tok/s"], rows))

    redis = c.LocalRedis()
    port = free_port()
    sim = subprocess.Popen([*c.CLI, "--log-level", "WARNING", "sim", "--port", str(port),
                            "--enable-return-hidden-states", "--hidden-size", str(args.hidden_size),
                            "--prefill-tok-s", str(args.prefill_tok_s),
                            "--max-running-requests", "64"], cwd=c.ROOT, env=c.ENV)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(url + "/health")
        out = tmp / "out"
        out.mkdir()
        write_rows(out / "H.jsonl", args.rows, args.answer_words)
        tok = make_tiny_tokenizer(tmp / "tok", WORDS)
        tokenizer = load_tokenizer(tok)
        samples = [conversation_ids(tokenizer, r, {})[0] for r in committed_rows(out / "H.jsonl")]
        total = sum(len(s) for s in samples)
        cfg = tmp / "cfg.yaml"
        cfg.write_text(yaml.safe_dump({
            "redis_url": redis.url, "output_dir": str(out), "server": {"urls": [url], "tokenizer": tok},
            "features": {"concurrency": args.concurrency, "decode_processes": args.decode_processes,
                         "dtype": "bfloat16", "shard_mb": args.shard_mb},
            "datasets": [{"name": "H", "path": str(out / "H.jsonl"), "budget": "1M"}]}))
        table = []
        for pair in range(args.pairs):
            import redis as redis_py

            redis_py.Redis.from_url(redis.url).flushall()
            d = asyncio.run(direct(url, samples, args.concurrency, args.decode_processes, tmp / f"direct{pair}"))
            p = run_pass(cfg, out, args.concurrency)
            table.append([pair + 1, args.hidden_size, len(samples), total, round(total / d), round(total / p),
                          round(d / p, 3)])
        print(f"\n## features pass vs direct client ({args.concurrency} in flight, {args.decode_processes} decode "
              f"processes, simulator prefill {args.prefill_tok_s:.0f} tok/s, shards of {args.shard_mb:g} MB)\n")
        print(c.md_table(["pair", "hidden", "samples", "tokens", "direct tok/s", "pass tok/s",
                          "ratio pass / direct"], table))
    finally:
        c.stop_process(sim)
        redis.stop()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main(sys.argv[1:]))
