"""bench/features.py --backend transformers: the capture pipeline as deployed vs the bare forward pass
over the same batches (bench/features.py's docstring says what is measured and why)."""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import _common as c
import orjson
import yaml
from _features_common import json_bytes_per_token, prepare, run_pass, wait_worker

from budgetq.simulator.local import free_port, wait_http

FEATURES_BENCH = Path(__file__).with_name("features.py")  # runs --bare-replay in a process of its own

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
    proc = subprocess.run([sys.executable, str(FEATURES_BENCH), "--bare-replay", str(job)], cwd=c.ROOT, env=env,
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



def transformers_main(args: argparse.Namespace, tmp: Path) -> None:
    from transformers import AutoTokenizer

    from tests.tiny_llama import make_tiny_llama

    out, tok, samples, total = prepare(args, tmp)
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
        http_s = run_pass(http_cfg, out, redis.url, args.concurrency)
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


