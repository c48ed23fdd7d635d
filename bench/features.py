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
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
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


def wait_worker(redis_url: str, proc: subprocess.Popen | None = None, deadline_s: float = 300.0) -> None:
    """Until a features worker registered (the transformers one after loading its model and its warm-up pass)."""
    import redis as redis_py

    conn = redis_py.Redis.from_url(redis_url)
    t0 = time.monotonic()
    while not conn.scard("rq:workers"):
        if proc is not None and proc.poll() is not None:
            raise SystemExit(f"the features worker exited with {proc.returncode} before registering")
        if time.monotonic() - t0 > deadline_s:
            raise SystemExit("no features worker registered")
        time.sleep(0.1)


@dataclass
class PipelineRun:
    """One timed run of the capture pipeline and what the worker's pass log says about it."""

    start: float                  # time.time() when the pass started
    end: float                    # ... and when it ended (every shard and index row fsynced)
    passes: list[dict]            # the worker's forward passes (transformers_backend.PASS_LOG_ENV)
    cpu_s: dict[str, float]       # CPU seconds each process spent in the run
    bytes_per_token_stored: float

    @property
    def seconds(self) -> float:
        return self.end - self.start

    @property
    def batches(self) -> list[list[int]]:
        return [p["lengths"] for p in self.passes]

    def breakdown(self) -> dict[str, float]:
        """Where the pipeline's wall time went, from the worker's own timestamps (one clock: one machine)."""
        forward = sum(p["forward_s"] for p in self.passes)
        first, last = self.passes[0], self.passes[-1]
        start = first["start"] - self.start
        tail = self.end - (last["start"] + last["forward_s"])
        return {"forward": forward, "start": start, "tail": tail,
                "between": self.seconds - forward - start - tail}


def run_pipeline(cfg_path: Path, out: Path, redis: c.LocalRedis, concurrency: int, threads: int,
                 pass_log: Path) -> PipelineRun:
    """The capture pipeline as deployed: `budgetq features-worker` in a process of its own (torch intra-op
    threads fixed by OMP_NUM_THREADS) and the pass (`budgetq features`: enqueue, collect, shards + index
    fsynced) in this process, which does nothing else meanwhile. Timed from the pass's start to its end;
    the worker has loaded its model and run its warm-up pass before (it registers only then)."""
    import shutil

    import redis as redis_py

    from budgetq.hidden_states.capture.transformers_backend import PASS_LOG_ENV
    from budgetq.hidden_states.collect.features_pass import FeaturesPass
    from budgetq.shared.config_load import load_config

    shutil.rmtree(out / "H", ignore_errors=True)
    redis_py.Redis.from_url(redis.url).flushall()
    pass_log.unlink(missing_ok=True)
    cfg = load_config(cfg_path)
    env = dict(c.ENV, OMP_NUM_THREADS=str(threads), **{PASS_LOG_ENV: str(pass_log)})
    worker = subprocess.Popen([*c.CLI, "--log-level", "WARNING", "features-worker", "-c", str(cfg_path),
                               "--concurrency", str(concurrency)], cwd=c.ROOT, env=env)
    try:
        wait_worker(redis.url, worker)
        fp = FeaturesPass(cfg, redis_py.Redis.from_url(cfg.redis_url))
        assert redis.proc is not None
        pids = {"worker": worker.pid, "redis": redis.proc.pid}
        cpu0 = {k: c.cpu_s(pid) for k, pid in pids.items()} | {"collector": time.process_time()}
        t0 = time.time()
        rep = fp.run()
        t1 = time.time()
        cpu1 = {k: c.cpu_s(pid) for k, pid in pids.items()} | {"collector": time.process_time()}
    finally:
        c.stop_process(worker)
    if not rep.ok or rep.datasets["H"]["captured"] == 0:
        raise SystemExit(f"features pass failed: {rep}")
    passes = [orjson.loads(line) for line in pass_log.read_text().splitlines()]
    return PipelineRun(t0, t1, passes, {k: cpu1[k] - cpu0[k] for k in cpu0},
                       float(rep.datasets["H"]["bytes_per_token"]))


def bare_forward(model_path: str, samples: list[list[int]], batches: list[list[int]], threads: int,
                 tmp: Path) -> tuple[float, int]:
    """(seconds, torch threads) of the model's forward passes alone over the batches the worker ran: a process
    of its own with the same OMP_NUM_THREADS, the model loaded as the worker loads it (load_model: same dtype,
    same attention), its hooks removed, nothing kept; a warm-up pass first, as the worker's. Each pass holds
    samples of the same lengths as the worker's pass (which token ids they hold does not change the cost)."""
    job = tmp / "bare.json"
    by_len = {len(s): s for s in samples}
    job.write_bytes(orjson.dumps({"model": model_path, "batches": [[by_len[n] for n in b] for b in batches]}))
    env = dict(c.ENV, OMP_NUM_THREADS=str(threads))
    proc = subprocess.run([sys.executable, str(Path(__file__)), "--bare-replay", str(job)], cwd=c.ROOT, env=env,
                          capture_output=True, text=True, timeout=3600)
    if proc.returncode:
        raise SystemExit(f"bare replay failed: {proc.stderr[-2000:]}")
    got = orjson.loads(proc.stdout.strip().splitlines()[-1])
    return float(got["seconds"]), int(got["threads"])


def bare_replay(job_path: str) -> None:
    """--bare-replay: the bare passes of bare_forward, in this process; prints {"seconds", "threads"}."""
    import torch

    from budgetq.hidden_states.capture.transformers_backend import load_model
    from budgetq.shared.config_features import FeaturesModelConfig

    job = orjson.loads(Path(job_path).read_bytes())
    hooked = load_model(FeaturesModelConfig(path=job["model"]), "bfloat16")
    hooked.remove_hooks()
    hooked.forward([[0] * 8])  # the worker's warm-up pass, before its clock too
    t0 = time.perf_counter()
    for batch in job["batches"]:
        hooked.forward(batch)
    print(orjson.dumps({"seconds": time.perf_counter() - t0, "threads": torch.get_num_threads()}).decode())


def run_hf_pass(cfg_path: Path, out: Path, redis_url: str, concurrency: int) -> float:
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
        wait_worker(redis_url, worker)  # registered once its decode processes run
        fp = FeaturesPass(cfg, redis_py.Redis.from_url(cfg.redis_url))
        t0 = time.perf_counter()
        rep = fp.run()
        elapsed = time.perf_counter() - t0
    finally:
        c.stop_process(worker)
    if not rep.ok or rep.datasets["H"]["captured"] == 0:
        raise SystemExit(f"features pass failed: {rep}")
    return elapsed


def json_bytes_per_token(url: str, ids: list[int]) -> float:
    """What one sample's prefill answer weighs as JSON, per token (measured, not estimated)."""
    import urllib.request

    req = urllib.request.Request(url + "/generate", data=orjson.dumps(prefill_body(ids, "measure")),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return len(r.read()) / len(ids)


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
        runs: list[tuple[PipelineRun, float]] = []
        for _ in range(args.pairs):
            # Side by side: a pipeline run, then the bare passes over its batches, rep after rep.
            run = run_pipeline(hf_cfg, out, redis, args.concurrency, args.threads, tmp / "passes.jsonl")
            bare, threads = bare_forward(model, samples, run.batches, args.threads, tmp)
            if {p["threads"] for p in run.passes} != {threads}:
                raise SystemExit(f"torch threads differ: worker {({p['threads'] for p in run.passes})}, "
                                 f"bare {threads}")
            runs.append((run, bare))
        print_transformers_tables(args, runs, len(samples), total)
        urls = []
        for flag in ("--enable-return-hidden-states", "--enable-return-aux-hidden-states"):
            port = free_port()
            sims.append(subprocess.Popen([*c.CLI, "--log-level", "WARNING", "sim", "--port", str(port), flag,
                                          "--hidden-size", str(args.hidden_size), "--prefill-tok-s", "1e9",
                                          "--max-running-requests", "64"], cwd=c.ROOT, env=c.ENV))
            urls.append(f"http://127.0.0.1:{port}")
            wait_http(urls[-1] + "/health")
        json_bpt = sum(json_bytes_per_token(u, samples[0]) for u in urls)
        http_cfg = tmp / "http.yaml"
        http_cfg.write_text(yaml.safe_dump({**base, "features": {**feats, "server": {"urls": urls[:1],
                                                                                       "aux_urls": urls[1:]}}}))
        http_s = run_hf_pass(http_cfg, out, redis.url, args.concurrency)
        pipe_s = sum(r.seconds for r, _ in runs)
        bpt = 2 * args.hidden_size * 4
        print("\n## the same samples and bytes (last layer + 3 aux layers, bf16) on the http path\n")
        print(c.md_table(["path", "tok/s", "bytes/token moved", "bytes/token stored"],
                         [["transformers backend (pipeline, all reps)", round(total * len(runs) / pipe_s),
                           f"{bpt} (bf16 through Redis)", round(runs[-1][0].bytes_per_token_stored)],
                          ["http: main + aux simulator, JSON decoded (prefill ~free)", round(total / http_s),
                           f"{round(json_bpt)} (JSON)", bpt]]))
    finally:
        for s in sims:
            c.stop_process(s)
        redis.stop()


def print_transformers_tables(args: argparse.Namespace, runs: list[tuple[PipelineRun, float]], samples: int,
                              tokens: int) -> None:
    rows: list[list[object]] = []
    for i, (run, bare) in enumerate(runs):
        n = len(run.passes)
        rows.append([i + 1, f"{args.hidden_size} x {args.layers} layers", samples, tokens, n, round(samples / n, 1),
                     round(tokens / bare), round(tokens / run.seconds), round(bare / run.seconds, 3)])
    bare_all, pipe_all = sum(b for _, b in runs), sum(r.seconds for r, _ in runs)
    passes = sum(len(r.passes) for r, _ in runs)
    rows.append(["all", "", samples * len(runs), tokens * len(runs), passes, round(samples * len(runs) / passes, 1),
                 round(tokens * len(runs) / bare_all), round(tokens * len(runs) / pipe_all),
                 round(bare_all / pipe_all, 3)])
    med = [statistics.median(float(r[col]) for r in rows[:-1]) for col in range(2, 9)]  # type: ignore[arg-type]
    rows.append(["median", "", *[round(v) for v in med[:3]], round(med[3], 1), *[round(v) for v in med[4:6]],
                 round(med[6], 3)])
    print(f"\n## transformers backend: capture pipeline vs bare forward ({args.concurrency} in flight, batches "
          f"of <= {args.max_batch_tokens} tokens, bf16, torch intra-op threads {args.threads} in both)\n")
    print(c.md_table(["rep", "model", "samples", "tokens", "forward passes", "samples / pass",
                      "bare forward tok/s", "pipeline tok/s", "ratio pipeline / bare"], rows), flush=True)
    where = []
    for i, (run, bare) in enumerate(runs):
        b = run.breakdown()
        where.append([i + 1, round(run.seconds, 2), round(b["forward"], 2), round(b["forward"] / run.seconds, 3),
                      round(bare, 2), round(b["start"], 3), round(b["between"], 3), round(b["tail"], 3)])
    print("\n## where the pipeline's wall time went (seconds, from the worker's own pass log)\n")
    print(c.md_table(["rep", "pipeline", "forward passes in the worker", "ratio forward busy / pipeline",
                      "bare forward passes", "start (to the 1st pass)", "between passes", "tail (after the last pass)"],
                     where), flush=True)
    cpu = []
    for i, (run, _) in enumerate(runs):
        forward = sum(p["forward_cpu_s"] for p in run.passes)
        unpack = sum(p["unpack_cpu_s"] for p in run.passes)
        per_token = {"unpack": unpack, "event loop": run.cpu_s["worker"] - forward - unpack,
                     "collector": run.cpu_s["collector"], "redis": run.cpu_s["redis"]}
        us = {k: 1e6 * v / tokens for k, v in per_token.items()}
        # The forward thread's CPU is its own thread's (time.thread_time): torch's other intra-op threads
        # land in the worker's total, so the event loop's share is known with one thread only.
        single = args.threads == 1
        busiest = max(("event loop", "collector", "redis") if single else ("collector", "redis"), key=lambda k: us[k])
        cpu.append([i + 1, round(us["unpack"], 1), round(us["event loop"], 1) if single else "-",
                    round(us["collector"], 1), round(us["redis"], 1), round(run.bytes_per_token_stored),
                    f"{busiest}: {round(1e6 / max(us[busiest], 1e-9)):,}"])
    print("\n## CPU outside the forward pass, microseconds per token (what a GPU box still spends on its CPUs)\n")
    print(c.md_table(["rep", "worker: unpack thread", "worker: event loop + rest", "collector (budgetq features)",
                      "redis-server", "bytes/token stored", "busiest one-core process: its ceiling tok/s"], cpu),
          flush=True)


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
        bare_replay(args.bare_replay)
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
            transformers_main(args, tmp)
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


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main(sys.argv[1:]))
