"""What bench/features.py's two benches share: the rows and samples, the features worker's start, one
timed features pass, a prefill answer's JSON weight."""

from __future__ import annotations

import argparse
import subprocess
import time
from pathlib import Path

import _common as c
import numpy as np
import orjson

from budgetq.hidden_states.collect.inputs import committed_rows, conversation_ids
from budgetq.producer.reading.tokenize import load_tokenizer
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



def run_pass(cfg_path: Path, out: Path, redis_url: str, concurrency: int) -> float:
    """One features pass in this process (its start-up, imports and Redis connection not timed), the worker a
    `budgetq features-worker` subprocess, registered (its decode processes or its model ready) before the clock."""
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




def prepare(args: argparse.Namespace, tmp: Path) -> tuple[Path, Path, list[list[int]], int]:
    """(output dir with H.jsonl, tokenizer dir, each row's sample token ids, their total)."""
    out = tmp / "out"
    out.mkdir()
    write_rows(out / "H.jsonl", args.rows, args.answer_words)
    tok = make_tiny_tokenizer(tmp / "tok", WORDS)
    tokenizer = load_tokenizer(tok)
    samples = [conversation_ids(tokenizer, r, {})[0] for r in committed_rows(out / "H.jsonl")]
    return out, tok, samples, sum(len(s) for s in samples)
