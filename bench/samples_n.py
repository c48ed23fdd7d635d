"""Several answers per prompt: N requests (what budgetq sends for ``samples: N``) vs one request with the engine's
``n``, on the simulator (SGLang's /generate, its radix cache) and on vLLM's CPU build (/v1/completions).

    python bench/samples_n.py [--engine sim|vllm|both] [--pairs K] [--chunked-prefill] [--quick | --smoke]

Both clients send the same prompts (long, so prefill matters), N answers each, every answer to max_tokens
(the simulator's lengths are drawn far above it; vLLM gets ``ignore_eos``), with the same number of sequences
in flight: C one-answer requests, or C / N requests of n = N. The N requests of a prompt are sent one after
another, as budgetq's queue holds them (answer k of a prompt right after answer k-1), so they overlap at the
engine as budgetq's workers make them. Measured per run: wall time for every answer, output tok/s, and the
prompt tokens the engine computed (prefill) against those its prefix cache served: the simulator's
``prompt_tokens`` / ``cached_tokens`` on /sim/stats, vLLM's ``vllm:request_prompt_tokens`` /
``vllm:request_prefill_kv_computed_tokens`` sums on /metrics. Runs alternate N requests, n, N requests, n
(the machine drifts); each pair's tok/s ratio and their min-max are printed. docs/benchmarks.md holds the
numbers and the decision (N requests) they back.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import sys
import time
import urllib.request
from dataclasses import dataclass

import _common as c
import aiohttp

# Unique from its first token (story {i}), so one prompt's prefix cache never serves another.
PROMPT = ("Story {i}. You are a careful writer. Here is the background you must use. " * 30
          + "Now write the story, with a beginning, a middle and an end.")


@dataclass
class Settings:
    prompts: int
    answers: int
    in_flight: int     # sequences at the engine at once, in both modes
    max_tokens: int


@dataclass
class Run:
    mode: str
    wall_s: float
    answers: int
    generated: int
    prefill: int       # prompt tokens the engine computed
    cached: int        # prompt tokens its prefix cache served

    @property
    def tok_s(self) -> float:
        return self.generated / self.wall_s


def counters(engine: str, url: str) -> dict[str, float]:
    """Prompt tokens the engine was asked to prefill ("queries") and those its prefix cache served ("hits"),
    every request counted, the warm-up prefills that SGLang's ``n`` sends included."""
    if engine == "sim":
        with urllib.request.urlopen(url + "/sim/stats", timeout=30) as resp:
            stats = json.loads(resp.read())
        return {"queries": stats["prompt_tokens"], "hits": stats["cached_tokens"]}
    return vllm_counters(url)


def vllm_counters(url: str) -> dict[str, float]:
    """vLLM's prompt tokens of finished requests ("queries": ``vllm:request_prompt_tokens``' sum) and the new KV
    tokens their prefill computed (``vllm:request_prefill_kv_computed_tokens``' sum): hits = the difference. (Its
    ``prefix_cache_hits`` counter is counted at admission, per scheduling attempt of a waiting request.)"""
    names = {"vllm:request_prompt_tokens_sum": "queries", "vllm:request_prefill_kv_computed_tokens_sum": "computed"}
    out = dict.fromkeys(names.values(), 0.0)
    for name, value in c.prometheus_lines(url):
        if name in names:
            out[names[name]] += float(value)
    return {"queries": out["queries"], "hits": out["queries"] - out["computed"]}


def _body(engine: str, prompt: str, n: int, seed: int, s: Settings) -> tuple[str, dict]:
    if engine == "sim":
        return "/generate", {"text": prompt, "sampling_params": {"max_new_tokens": s.max_tokens, "temperature": 0.8,
                                                                 "sampling_seed": seed, "n": n}}
    from tests.vllm_server import MODEL_NAME
    return "/v1/completions", {"model": MODEL_NAME, "prompt": prompt, "max_tokens": s.max_tokens, "n": n,
                               "temperature": 0.8, "seed": seed, "ignore_eos": True}


def _answers(engine: str, body: dict | list) -> list[int]:
    """Completion tokens of each answer of one response (the prompt side is read from the engine's counters)."""
    if engine == "sim":
        return [o["meta_info"]["completion_tokens"] for o in (body if isinstance(body, list) else [body])]
    assert isinstance(body, dict)
    return [body["usage"]["completion_tokens"] // len(body["choices"])] * len(body["choices"])


async def _run(engine: str, url: str, s: Settings, mode: str, offset: int) -> Run:
    """Every answer of ``s.prompts`` prompts, ``mode`` "N requests" or "n"; prompts numbered from ``offset`` (a
    run's prompts are new to the engine: no run is served from an earlier one's cache)."""
    n = s.answers if mode == "n" else 1
    work = iter([(i, k) for i in range(offset, offset + s.prompts) for k in range(s.answers // n)])
    got: list[int] = []
    before = counters(engine, url)

    async def client(session: aiohttp.ClientSession) -> None:
        for i, k in work:
            path, body = _body(engine, PROMPT.format(i=i), n, 1000 * i + k, s)
            async with session.post(url + path, json=body) as resp:
                payload = await resp.json(content_type=None)
                if resp.status != 200:
                    raise SystemExit(f"{engine} answered {resp.status}: {str(payload)[:300]}")
            got.extend(_answers(engine, payload))

    t0 = time.monotonic()
    timeout = aiohttp.ClientTimeout(total=None, sock_read=1800)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        await asyncio.gather(*(client(session) for _ in range(max(1, s.in_flight // n))))
    wall = time.monotonic() - t0
    after = counters(engine, url)
    queries, hits = after["queries"] - before["queries"], after["hits"] - before["hits"]
    return Run(mode, wall, len(got), sum(got), int(queries - hits), int(hits))


def measure(engine: str, url: str, s: Settings, pairs: int, offset: itertools.count) -> list[tuple[Run, Run]]:
    out = []
    for rep in range(pairs):
        pair = []
        for mode in ("N requests", "n"):
            run = asyncio.run(_run(engine, url, s, mode, next(offset) * s.prompts))
            pair.append(run)
            print(f"  {engine} {rep + 1} {mode}: {run.answers} answers, {run.generated:,} tokens in {run.wall_s:.1f} s"
                  f" ({run.tok_s:,.1f} tok/s), prefill {run.prefill:,} computed / {run.cached:,} cached, load "
                  f"{os.getloadavg()[0]:.1f}", flush=True)
        out.append((pair[0], pair[1]))
    return out


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--engine", choices=["sim", "vllm", "both"], default="both")
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="one pair, simulator only (under a minute)")
    ap.add_argument("--smoke", action="store_true", help="tiny, simulator only, for the test suite")
    ap.add_argument("--chunked-prefill", action="store_true",
                    help="serve vLLM with chunked prefill on (its default): its CPU build's engine dies on the "
                         "first seeded burst, which this shows (docs/vllm.md)")
    args = ap.parse_args(argv)
    c.print_header("N requests vs one request with n, several answers per prompt", ["bench/samples_n.py", *argv])
    quick = args.smoke or args.quick
    engines = ["sim"] if quick or args.engine == "sim" else ["vllm"] if args.engine == "vllm" else ["sim", "vllm"]
    pairs = 1 if quick else args.pairs
    settings = {"sim": Settings(prompts=8 if args.smoke else 64, answers=4, in_flight=32, max_tokens=256),
                "vllm": Settings(prompts=8, answers=4, in_flight=16, max_tokens=48)}
    results: dict[str, list[tuple[Run, Run]]] = {}
    for engine in engines:
        s = settings[engine]
        print(f"\n{engine}: {s.prompts} prompts of ~{len(PROMPT) // 4} tokens, {s.answers} answers each, "
              f"{s.max_tokens} tokens an answer, {s.in_flight} sequences in flight", flush=True)
        offset = itertools.count()
        if engine == "sim":
            # SGLang's speed at scale: 256 running, prefill 50k tok/s; speedup so a run takes seconds.
            speedup = "50" if args.smoke else "2"
            with c.Sim("--radix-cache", "--speedup", speedup, "--length-mean", "100000", "--length-sigma", "0.01",
                       "--seed", "5") as sim:
                results[engine] = measure(engine, sim.url, s, pairs, offset)
        else:
            from tests.vllm_server import VllmServer, smollm2_hf_dir
            # Seeded requests (both modes are seeded, as budgetq's answers are) kill vLLM's CPU build when a
            # prompt is prefilled in chunks ("CPU Generator does not use offset", docs/vllm.md): prefill whole.
            flags = () if args.chunked_prefill else ("--no-enable-chunked-prefill",)
            server = VllmServer(smollm2_hf_dir(), "--max-model-len", "2048", *flags)
            try:
                asyncio.run(_run(engine, server.url, Settings(2, 2, 4, 4), "n", 10_000))   # warm-up, not measured
                results[engine] = measure(engine, server.url, s, pairs, offset)
            except BaseException:
                print(server.log()[-6000:], file=sys.stderr)   # the engine's own account of a failure
                raise
            finally:
                server.stop()
    rows = []
    for engine, runs in results.items():
        for i, (many, one) in enumerate(runs):
            for r in (many, one):
                rows.append([engine, i + 1, r.mode, r.answers, r.generated, f"{r.wall_s:.2f}", f"{r.tok_s:.1f}",
                             r.prefill, r.cached, f"{r.prefill / r.answers:.1f}"])
    print()
    print(c.md_table(["engine", "pair", "mode", "answers", "tokens", "wall s", "tok/s", "prefill computed",
                      "prefill cached", "computed per answer"], rows))
    print()
    summary = []
    for engine, runs in results.items():
        ratios = [one.tok_s / many.tok_s for many, one in runs]
        pre = [one.prefill / max(1, many.prefill) for many, one in runs]
        summary.append([engine, len(runs), f"{sum(ratios) / len(ratios):.4f}",
                        f"{min(ratios):.4f}-{max(ratios):.4f}", f"{min(pre):.3f}-{max(pre):.3f}"])
    print(c.md_table(["engine", "pairs", "ratio tok/s n / N requests", "pairs min-max",
                      "prefill computed, n / N requests (min-max)"], summary))


if __name__ == "__main__":
    main(sys.argv[1:])
