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

``--backend transformers``: a random Llama (tests/tiny_llama.py, --hidden-size, --layers) in the
features worker. The capture pipeline (`budgetq features` + a features worker with the transformers
backend, its event loop in a thread of the bench process: batches, hooks, the last layer and the
three aux layers as bf16 bytes, Redis, shards + index fsynced) against the bare forward pass of the
same model over the same batches (the worker's passes replayed: the same sample lengths per pass,
no hooks, nothing kept) in this process.
Target: pipeline / bare >= 0.9. Then the http path on the same samples and bytes: the pass with a
main and an aux simulator (JSON, decode), transport-bound (simulated prefill 10^9 tok/s).
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

from budgetq.hidden_states.capture.decode import decode
from budgetq.hidden_states.collect.inputs import committed_rows, conversation_ids
from budgetq.hidden_states.schema import FeaturesMeta
from budgetq.hidden_states.store.shards import FeatureStore
from budgetq.producer.reading.tokenize import load_tokenizer
from budgetq.simulator.hidden import vectors
from budgetq.simulator.local import free_port, wait_http
from budgetq.worker.sglang_wire import prefill_body
from tests.tiny_tokenizer import make_tiny_tokenizer

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

    from budgetq.hidden_states.collect.features_pass import FeaturesPass
    from budgetq.shared.config_load import load_config

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


def wait_worker(redis_url: str, deadline_s: float = 300.0) -> None:
    """Until a features worker registered (the transformers one after loading its model)."""
    import redis as redis_py

    conn = redis_py.Redis.from_url(redis_url)
    t0 = time.monotonic()
    while not conn.scard("rq:workers"):
        if time.monotonic() - t0 > deadline_s:
            raise SystemExit("no features worker registered")
        time.sleep(0.1)


def bare_forward(model_path: str, samples: list[list[int]], batch_lengths: list[list[int]]) -> float:
    """Seconds of the model's forward passes alone (no hooks, nothing kept) over the batches the worker ran:
    the same sample lengths per pass (which tokens they hold does not change the cost)."""
    from budgetq.hidden_states.capture.transformers_backend import load_model
    from budgetq.shared.config_features import FeaturesModelConfig

    hooked = load_model(FeaturesModelConfig(path=model_path), "bfloat16")
    hooked.remove_hooks()
    hooked.forward(samples[:1])  # warm-up, as the worker's first pass is before the clock too
    by_len = {len(s): s for s in samples}
    t0 = time.perf_counter()
    for lengths in batch_lengths:
        hooked.forward([by_len[n] for n in lengths])
    return time.perf_counter() - t0


def run_pipeline(cfg_path: Path, out: Path, redis_url: str, concurrency: int) -> tuple[float, list[list[int]]]:
    """The capture pipeline: a features worker (its event loop in a thread of this process, so its batches
    can be read back) and the pass (`budgetq features`: enqueue, collect, shards + index fsynced), timed
    from the pass's start, the worker loaded and warm before; (seconds, the worker's batches)."""
    import shutil
    import threading

    import redis as redis_py

    from budgetq.hidden_states.capture.features_worker import FeaturesWorker
    from budgetq.hidden_states.capture.transformers_backend import TransformersBackend
    from budgetq.hidden_states.collect.features_pass import FeaturesPass
    from budgetq.shared.config_load import load_config

    shutil.rmtree(out / "H", ignore_errors=True)
    redis_py.Redis.from_url(redis_url).flushall()
    cfg = load_config(cfg_path)
    fw = FeaturesWorker(cfg, concurrency)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=lambda: loop.run_until_complete(fw.run(handle_signals=False)), daemon=True)
    thread.start()
    try:
        wait_worker(redis_url)
        fp = FeaturesPass(cfg, redis_py.Redis.from_url(cfg.redis_url))
        t0 = time.perf_counter()
        rep = fp.run()
        elapsed = time.perf_counter() - t0
    finally:
        loop.call_soon_threadsafe(fw.request_stop, "bench done")
        thread.join(60)
    if not rep.ok or rep.datasets["H"]["captured"] == 0:
        raise SystemExit(f"features pass failed: {rep}")
    assert isinstance(fw.backend, TransformersBackend)
    return elapsed, list(fw.backend.batch_lengths)


def run_hf_pass(cfg_path: Path, out: Path, redis_url: str, concurrency: int, backend_env: dict | None = None) -> float:
    import shutil

    import redis as redis_py

    from budgetq.hidden_states.collect.features_pass import FeaturesPass
    from budgetq.shared.config_load import load_config

    shutil.rmtree(out / "H", ignore_errors=True)
    redis_py.Redis.from_url(redis_url).flushall()
    cfg = load_config(cfg_path)
    worker = subprocess.Popen([*c.CLI, "--log-level", "WARNING", "features-worker", "-c", str(cfg_path),
                               "--concurrency", str(concurrency)], cwd=c.ROOT, env=c.ENV)
    try:
        wait_worker(redis_url)
        fp = FeaturesPass(cfg, redis_py.Redis.from_url(cfg.redis_url))
        t0 = time.perf_counter()
        rep = fp.run()
        elapsed = time.perf_counter() - t0
    finally:
        c.stop_process(worker)
    if not rep.ok or rep.datasets["H"]["captured"] == 0:
        raise SystemExit(f"features pass failed: {rep}")
    return elapsed


def transformers_main(args: argparse.Namespace, tmp: Path) -> None:
    from transformers import AutoTokenizer

    from tests.tiny_llama import make_tiny_llama

    out = tmp / "out"
    out.mkdir()
    write_rows(out / "H.jsonl", args.rows, args.answer_words)
    tok = make_tiny_tokenizer(tmp / "tok", WORDS)
    tokenizer = load_tokenizer(tok)
    samples = [conversation_ids(tokenizer, r, {})[0] for r in committed_rows(out / "H.jsonl")]
    total = sum(len(s) for s in samples)
    model = make_tiny_llama(tmp / "llama", len(AutoTokenizer.from_pretrained(tok)), args.hidden_size, args.layers)
    redis = c.LocalRedis()
    sims: list[subprocess.Popen] = []
    try:
        base = {"redis_url": redis.url, "output_dir": str(out), "server": {"urls": ["http://127.0.0.1:9"],
                                                                           "tokenizer": tok},
                "datasets": [{"name": "H", "path": str(out / "H.jsonl"), "budget": "1M"}]}
        feats = {"concurrency": args.concurrency, "dtype": "bfloat16", "shard_mb": args.shard_mb,
                 "decode_processes": args.decode_processes}
        hf_cfg = tmp / "hf.yaml"
        hf_cfg.write_text(yaml.safe_dump({**base, "features": {**feats, "backend": "transformers", "model": {
            "path": model, "max_batch_tokens": args.max_batch_tokens}}}))
        table = []
        for pair in range(args.pairs):
            pipe, batches = run_pipeline(hf_cfg, out, redis.url, args.concurrency)
            bare = bare_forward(model, samples, batches)
            table.append([pair + 1, f"{args.hidden_size} x {args.layers} layers", len(samples), total, len(batches),
                          round(total / bare), round(total / pipe), round(bare / pipe, 3)])
        print(f"\n## transformers backend: capture pipeline vs bare forward ({args.concurrency} in flight, batches "
              f"of <= {args.max_batch_tokens} tokens, bf16, torch threads {__import__('torch').get_num_threads()})\n")
        print(c.md_table(["pair", "model", "samples", "tokens", "forward passes", "bare forward tok/s",
                          "pipeline tok/s", "ratio pipeline / bare"], table), flush=True)
        urls = []
        for flag in ("--enable-return-hidden-states", "--enable-return-aux-hidden-states"):
            port = free_port()
            sims.append(subprocess.Popen([*c.CLI, "--log-level", "WARNING", "sim", "--port", str(port), flag,
                                          "--hidden-size", str(args.hidden_size), "--prefill-tok-s", "1e9",
                                          "--max-running-requests", "64"], cwd=c.ROOT, env=c.ENV))
            urls.append(f"http://127.0.0.1:{port}")
            wait_http(urls[-1] + "/health")
        http_cfg = tmp / "http.yaml"
        http_cfg.write_text(yaml.safe_dump({**base, "features": {**feats, "server": {"urls": urls[:1],
                                                                                       "aux_urls": urls[1:]}}}))
        http_s = run_hf_pass(http_cfg, out, redis.url, args.concurrency)
        bpt = 2 * args.hidden_size * 4
        print("\n## the same samples and bytes (last layer + 3 aux layers, bf16) on the http path\n")
        print(c.md_table(["path", "tok/s", "bytes/token on the wire", "bytes/token stored"],
                         [["transformers backend (pipeline, best pair)", max(r[6] for r in table),
                           f"{bpt} (bf16 through Redis)", bpt],
                          ["http: main + aux simulator, JSON decoded (prefill ~free)", round(total / http_s),
                           f"~{round(11 * args.hidden_size * 4)} (JSON)", bpt]]))
    finally:
        for s in sims:
            c.stop_process(s)
        redis.stop()


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
    ap.add_argument("--backend", choices=["http", "transformers"], default="http")
    ap.add_argument("--layers", type=int, default=8, help="transformers: decoder layers of the random Llama")
    ap.add_argument("--max-batch-tokens", type=int, default=4096, help="transformers: features.model.max_batch_tokens")
    args = ap.parse_args(argv)
    if args.smoke:
        args.hidden_size, args.rows, args.answer_words, args.pairs = 256, 8, 60, 1
    if args.backend == "transformers":
        if args.smoke:
            args.layers, args.max_batch_tokens = 8, 512
        elif "--hidden-size" not in argv:
            args.hidden_size = 1024
        c.print_header("Hidden states: the transformers capture backend vs the bare forward pass",
                       ["bench/features.py", *argv])
        transformers_main(args, Path(tempfile.mkdtemp(prefix="bq-features-bench-")))
        return 0
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
