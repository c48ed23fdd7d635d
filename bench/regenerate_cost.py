"""What regenerate: all costs next to regenerate: last, on the same conversations, side by side.

Runs the bundled examples/data/sharegpt.jsonl (12 ShareGPT conversations, 1-3 user turns)
through the producer, a worker and the simulator twice, once per mode, and counts what was
sent and generated: requests, prompt characters and tokens (the simulator's count: about 4
characters a token), generated tokens, and the simulated time from the first request to the
last answer. Lengths are drawn per rid (simulator/lengths.py), so the first turn of a
conversation gets the same length in both modes.

    python bench/regenerate_cost.py            # mean answer 300 tokens
    python bench/regenerate_cost.py --smoke    # shorter answers, same table
"""

from __future__ import annotations

import argparse
import json
import sys

from _common import ROOT, Sim, Stack, md_table, print_header

DATA = ROOT / "examples" / "data" / "sharegpt.jsonl"
SPEEDUP = 20.0


def _sent_chars(row: dict, mode: str) -> int:
    """Characters of every request's messages: last: one request, all turns before the answer;
    all: one request per generated answer, holding every turn before it."""
    conv = row["conversations"]
    if mode == "last":
        return sum(len(c["content"]) for c in conv[:-1])
    return sum(sum(len(c["content"]) for c in conv[:i]) for i, m in enumerate(conv) if m["role"] == "assistant")


def measure(stack: Stack, sim: Sim, mode: str, mean: int) -> dict:
    stack.flush()
    sim.reset()
    cfg = stack.config(sim.url, [{"name": "S", "path": str(DATA), "budget": "10M", "id_field": "id",
                                  "conversations_field": "conversations", "regenerate": mode,
                                  "sampling": {"max_tokens": mean * 8}}], name=f"{mode}.yaml",
                       worker={"concurrency": 16})
    stack.run(cfg, mode, workers=1, per_worker=16)
    rows = [json.loads(line) for line in (stack.dir / "out" / "S.jsonl").read_text().splitlines() if line]
    recs = sim.records()
    return {
        "rows": len(rows),
        "requests": len(recs),
        "prompt chars sent": sum(_sent_chars(r, mode) for r in rows),
        "prompt tokens": sum(r["prompt_tokens"] for r in rows),
        "generated tokens": sum(r["completion_tokens"] for r in rows),
        "simulated s, first request to last answer":
            (max(r["finished"] for r in recs) - min(r["arrived"] for r in recs)) * SPEEDUP,
    }


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--mean", type=int, default=300, help="mean answer length, tokens")
    args = ap.parse_args(argv)
    mean = 60 if args.smoke else args.mean
    print_header("regenerate: last vs all on examples/data/sharegpt.jsonl", ["bench/regenerate_cost.py", *argv])
    stack = Stack.start()
    sim = Sim("--speedup", str(SPEEDUP), "--length-mean", str(mean), "--seed", "11", "--keep-records", "1000")
    try:
        last, every = measure(stack, sim, "last", mean), measure(stack, sim, "all", mean)
    finally:
        sim.close()
        stack.close()
    print(f"simulator: lognormal answers, mean {mean} tokens, speedup {SPEEDUP:g}; one worker, 16 in flight\n")
    print(md_table(["metric", "last", "all", "ratio all / last"],
                   [[k, last[k], every[k], every[k] / last[k] if last[k] else float("nan")] for k in last]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
