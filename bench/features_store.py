"""The hidden-states pipeline's own ceiling: features.store against the Redis stream, and the disk's rate.

    python bench/features_store.py [--smoke] [--hidden 4096 7168] [--rows 24] [--answer-words 1000] [--reps 1]

No model: the capture backend is ``synthetic`` (hidden_states/capture/synthetic_backend.py: views of one random
buffer, at memory speed), so what is timed is the pipeline alone. Per hidden size, 4 layers stored (the target
and EAGLE-3's three aux layers), side by side in one run, each a whole `budgetq features` pass (FeaturesPass in
this process, one `budgetq features-worker` subprocess, a private Redis), timed from its start to its end:

- stream: no features.store; bf16 bytes through the Redis stream, the collector writes the shards;
- store bf16: the worker writes one-sample shards in features.store (tmp, fsync, rename), Redis carries only
  index messages;
- store fp8: the same, float8_e4m3fn with a float32 scale per token and layer (hidden_states/store/fp8.py);
- disk: this machine's sequential write rate with fsync, in Python: the store bf16 run's shard sizes written
  the same way (a file each, write, fsync, rename, directory fsync), nothing else. The physical limit.

Targets: store bf16 >= 0.8 of the disk's GB/s, and >= 10x the stream's tok/s.

Then where a store's time goes, one sample at a time in this process: building its shard's tensors (bf16; fp8:
the quantization), and writing it (write, fsync, rename, directory fsync).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import _common as c
import yaml
from _features_common import prepare, run_pass

from budgetq.hidden_states.capture.decode import to_dtype
from budgetq.hidden_states.schema import FeaturesMeta
from budgetq.hidden_states.store.safetensors_io import write_atomic
from budgetq.hidden_states.store.shards import features_dir, sample_tensors

MODES = ("stream", "store bf16", "store fp8")


def write_config(tmp: Path, out: Path, tok: Path, redis_url: str, hidden: int, mode: str, concurrency: int,
                 max_tokens: int) -> Path:
    features: dict = {"backend": "synthetic", "concurrency": concurrency, "high_water": 256, "shard_mb": 64,
                      "synthetic": {"hidden_size": hidden, "aux_layers": 3, "max_tokens": max_tokens},
                      "dtype": "fp8" if mode == "store fp8" else "bfloat16",
                      "worker_max_mb": 4096, "redis_max_mb": 1024}
    if mode != "stream":
        features["store"] = str(tmp / "store")
    cfg = {"redis_url": redis_url, "server": {"urls": ["http://127.0.0.1:9"], "tokenizer": str(tok)},
           "output_dir": str(out), "min_free_mb": 256, "features": features,
           "datasets": [{"name": "H", "path": str(out / "H.jsonl"), "budget": 1000}]}
    path = tmp / f"cfg-{hidden}-{mode.replace(' ', '-')}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def shard_sizes(root: Path) -> list[int]:
    d = features_dir(root, "H")
    return [p.stat().st_size for p in sorted(d.glob("*.safetensors"))]


def disk_rate(d: Path, sizes: list[int]) -> float:
    """Seconds to write files of ``sizes`` as the store does (write, fsync, rename, directory fsync)."""
    d.mkdir(parents=True, exist_ok=True)
    block = os.urandom(1 << 20)
    t0 = time.perf_counter()
    for i, n in enumerate(sizes):
        tmp, final = d / f"{i}.tmp", d / f"{i}.bin"
        with open(tmp, "wb") as fh:
            left = n
            while left > 0:
                k = min(left, len(block))
                fh.write(block[:k])
                left -= k
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, final)
        fd = os.open(d, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    elapsed = time.perf_counter() - t0
    shutil.rmtree(d, ignore_errors=True)
    return elapsed


def where_time_goes(d: Path, hidden: int, tokens: int, reps: int = 4) -> list[list[object]]:
    """ms per sample of building its shard's tensors and of writing the shard, bf16 and fp8."""
    import numpy as np

    d.mkdir(parents=True, exist_ok=True)
    raw = memoryview(to_dtype(np.random.default_rng(0).standard_normal((tokens, 4 * hidden), dtype=np.float32),
                              "bfloat16"))
    data, aux = raw[: tokens * hidden * 2], raw[tokens * hidden * 2:]
    rows: list[list[object]] = []
    for dtype in ("bfloat16", "fp8"):
        meta = FeaturesMeta(id="p", dataset="H", input_ids=list(range(tokens)), loss_start=0, loss_end=tokens,
                            dtype=dtype, shape=[tokens, hidden], aux_shape=[tokens, 3 * hidden])
        build = write = 0.0
        for _ in range(reps):
            t0 = time.perf_counter()
            tensors, _, _ = sample_tensors(meta, data, aux)
            t1 = time.perf_counter()
            size = write_atomic(d / "s.safetensors", tensors, {})
            write += time.perf_counter() - t1
            build += t1 - t0
        mb = len(raw) / 1e6
        rows.append([hidden, dtype, f"{mb:.1f}", f"{build / reps * 1000:.0f}", f"{mb / 1e3 / (build / reps):.2f}",
                     f"{size / 1e6:.1f}", f"{write / reps * 1000:.0f}", f"{size / 1e9 / (write / reps):.2f}"])
    shutil.rmtree(d, ignore_errors=True)
    return rows


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--hidden", type=int, nargs="+", default=[4096, 7168])
    ap.add_argument("--rows", type=int, default=24)
    ap.add_argument("--answer-words", type=int, default=1000)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--reps", type=int, default=1)
    args = ap.parse_args(argv)
    if args.smoke:
        args.hidden, args.rows, args.answer_words = [256], 6, 60
    c.print_header("Hidden states: features.store vs the Redis stream vs the disk (synthetic backend, 4 layers)",
                   ["bench/features_store.py", *argv])
    stack = c.Stack.start()
    tmp = Path(tempfile.mkdtemp(prefix="bq-features-store-"))
    rows = []
    try:
        out, tok, samples, tokens = prepare(args, tmp)
        longest = max(len(s) for s in samples)
        for hidden in args.hidden:
            for rep in range(args.reps):
                got: dict[str, tuple[float, int]] = {}
                sizes: list[int] = []
                for mode in MODES:
                    shutil.rmtree(tmp / "store", ignore_errors=True)
                    cfg = write_config(tmp, out, tok, stack.url, hidden, mode, args.concurrency, longest)
                    elapsed = run_pass(cfg, out, stack.url, args.concurrency)
                    root = out if mode == "stream" else tmp / "store"
                    written = sum(shard_sizes(root))
                    if mode == "store bf16":
                        sizes = shard_sizes(root)
                    got[mode] = (elapsed, written)
                    shutil.rmtree(tmp / "store", ignore_errors=True)
                    shutil.rmtree(out / "H", ignore_errors=True)
                got["disk"] = (disk_rate(tmp / "disk", sizes), sum(sizes))
                disk_gb_s = got["disk"][1] / got["disk"][0] / 1e9
                stream_tok_s = tokens / got["stream"][0]
                for mode, (elapsed, written) in got.items():
                    tok_s = tokens / elapsed
                    gb_s = written / elapsed / 1e9
                    rows.append([hidden, rep + 1, mode, f"{tokens:,}", f"{written / 1e9:.3f}", f"{elapsed:.2f}",
                                 f"{tok_s:,.0f}" if mode != "disk" else f"({tok_s:,.0f})", f"{gb_s:.3f}",
                                 f"{gb_s / disk_gb_s:.3f}", "-" if mode == "disk" else f"{tok_s / stream_tok_s:.2f}"])
        # where one sample's time goes first; the table of the passes last (tests/test_bench_smoke.py reads it)
        where = [r for h in args.hidden for r in where_time_goes(tmp / "where", h, tokens // args.rows)]
        print()
        print(c.md_table(["hidden", "stored as", "bf16 MB in", "ms to build tensors", "GB/s of bf16 in",
                          "MB written", "ms to write + fsync", "GB/s written"], where))
        print()
        print(c.md_table(["hidden", "rep", "path", "tokens", "GB written", "s", "tok/s", "GB/s",
                          "ratio GB/s to disk", "ratio tok/s to stream"], rows))
        print()
        print(f"{args.rows} samples of ~{tokens // args.rows:,} tokens; 4 layers stored (target + 3 aux); one "
              f"features worker, {args.concurrency} in flight; disk: the store bf16 run's shard sizes written with "
              "fsync in Python (the tok/s in brackets: those files' tokens at that rate); the first table: one "
              "sample at a time in this process")
    finally:
        stack.close()
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
