"""Hidden states: decode/write MB/s per process, and the features pass against a direct client.

    python bench/features.py [--smoke] [--hidden-size 4096] [--rows 48] [--concurrency 8]
    python bench/features.py --backend transformers [--smoke] [--hidden-size 1024] [--layers 8]

1. Per worker process: MB/s of hidden states decoded (SGLang's JSON -> bfloat16 bytes,
   hidden_states/capture/decode.py) and written (safetensors shards, hidden_states/store/shards.py).
2. Prefill tok/s of the whole features pass (`budgetq features` + one `budgetq features-worker`,
   Redis in between, shards + index on disk) over a direct client: asyncio + aiohttp in one
   process, the same request bodies and the same number in flight, the same decode in a process
   pool of the same size, each sample's bytes written to a file. Both against one simulator
   (`--enable-return-hidden-states`, the chosen hidden size, its prefill capacity model).
   Runs alternate direct, pass, direct, pass. Target: pass / direct >= 0.95.

``--backend transformers``: a random Llama (tests/tiny_llama.py, --hidden-size, --layers), bf16.
Each rep, side by side:
- the capture pipeline as deployed: `budgetq features-worker` (transformers backend) in a process of its
  own, `budgetq features` (FeaturesPass) in this one, Redis between them; batches, hooks, the last layer
  and the three aux layers as bf16 bytes, XADD, shards + index fsynced; timed from the pass's start to
  its end, the model loaded and warm before (the worker registers only then);
- the bare forward pass over the same batches: the worker's passes (from its pass log) replayed in a
  process of its own, the model loaded the same way (same dtype, same attention), no hooks, nothing kept.
torch's intra-op threads are the same in both (--threads, default 1, through OMP_NUM_THREADS): on the
2-core test machine that leaves a core to the pipeline's own CPU work (Redis, the collector, the event
loop), as a GPU box does, where the forward pass runs on the device and not on the CPUs the pipeline
needs. Target: pipeline / bare >= 0.9, per rep, over all reps and as the median. The worker's pass log
also says where the pipeline's time went (start, between passes, tail) and what it costs in CPU per
token outside the forward pass. Then the http path on the same samples and bytes: the pass with a main
and an aux simulator (JSON, decode), transport-bound (simulated prefill 10^9 tok/s).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

import _common as c
import aiohttp
import features_hf
import numpy as np
import orjson
import yaml
from _features_common import prepare, run_pass

from budgetq.hidden_states.capture.decode import decode
from budgetq.hidden_states.schema import FeaturesMeta
from budgetq.hidden_states.store.shards import FeatureStore
from budgetq.simulator.hidden import vectors
from budgetq.simulator.local import free_port, wait_http
from budgetq.worker.sglang_wire import prefill_body


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



def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--hidden-size", type=int, default=4096)
    ap.add_argument("--rows", type=int, default=48)
    ap.add_argument("--answer-words", type=int, default=500)
    ap.add_argument("--concurrency", type=int, default=None,
                    help="in flight per worker (default 8; transformers 16: a full batch waits while one runs)")
    ap.add_argument("--decode-processes", type=int, default=2)
    ap.add_argument("--prefill-tok-s", type=float, default=20_000.0)
    ap.add_argument("--pairs", type=int, default=2)
    # Shards close during the run, as in a real one (hours at 512 MB a shard); the pass's last write
    # (one shard) is its tail, which a short run would otherwise weigh far more than a real one does.
    ap.add_argument("--shard-mb", type=float, default=16.0)
    ap.add_argument("--backend", choices=["http", "transformers"], default="http")
    ap.add_argument("--layers", type=int, default=8, help="transformers: decoder layers of the random Llama")
    ap.add_argument("--max-batch-tokens", type=int, default=4096, help="transformers: features.model.max_batch_tokens")
    ap.add_argument("--threads", type=int, default=1,
                    help="transformers: torch intra-op threads, the same in the worker and the bare passes")
    ap.add_argument("--bare-replay", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.bare_replay:
        features_hf.bare_replay(args.bare_replay)
        return 0
    if args.smoke:
        args.hidden_size, args.rows, args.answer_words, args.pairs = 256, 8, 60, 1
    if args.concurrency is None:
        args.concurrency = 16 if args.backend == "transformers" else 8
    if args.backend == "transformers":
        if args.smoke:
            args.layers, args.max_batch_tokens = 8, 512
        elif "--hidden-size" not in argv:
            args.hidden_size = 1024
    tmp = Path(tempfile.mkdtemp(prefix="bq-features-bench-"))
    try:
        if args.backend == "transformers":
            c.print_header("Hidden states: the transformers capture backend vs the bare forward pass",
                           ["bench/features.py", *argv])
            features_hf.transformers_main(args, tmp)
        else:
            c.print_header("Hidden states: decode/write per process, features pass vs direct client",
                           ["bench/features.py", *argv])
            http_main(args, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # a model, shards and their copies: hundreds of MB a run
    return 0


def http_main(args: argparse.Namespace, tmp: Path) -> None:
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
        out, tok, samples, total = prepare(args, tmp)
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
            p = run_pass(cfg, out, redis.url, args.concurrency)
            table.append([pair + 1, args.hidden_size, len(samples), total, round(total / d), round(total / p),
                          round(d / p, 3)])
        print(f"\n## features pass vs direct client ({args.concurrency} in flight, {args.decode_processes} decode "
              f"processes, simulator prefill {args.prefill_tok_s:.0f} tok/s, shards of {args.shard_mb:g} MB)\n")
        print(c.md_table(["pair", "hidden", "samples", "tokens", "direct tok/s", "pass tok/s",
                          "ratio pass / direct"], table))
    finally:
        c.stop_process(sim)
        redis.stop()


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main(sys.argv[1:]))
