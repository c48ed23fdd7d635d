"""GPU tokens spent per kept token with the degeneration guard and without, at 1% and 3% looping answers.

    python bench/loop_guard.py [--answers N] [--max-tokens 16384] [--mean 2048] [--periods 1 20 150]

The answers are the simulator's (simulator/texts.py ``Script``: words per (seed, key), lognormal
lengths of the given mean, sigma 1.0, capped at max_tokens, half of each answer reasoning); a
looping answer (``shape_of`` with the loop fraction) falls into an exact cycle of P tokens at a
uniform point of the length it would have had, and repeats it until max_tokens. Every answer is
streamed one token per chunk through the real ``LoopGuard`` (default settings), as the worker's
stream reader feeds it; a cut answer spends the tokens generated up to the cut.

Without the guard every looping answer spends max_tokens and is *kept* (a row nobody can train
on): spent / kept is then ~1, and spent / useful (kept minus the looping rows) is the true cost.
With the guard a looping answer is cut and discarded: spent / kept is the cost.

Same answers in every variant (the draws depend on (seed, key) only). Deterministic.

``--e2e N``: instead, N prompts per run through the real pipeline (``budgetq sim --loop-fraction F
--loop-period P``, a producer, one streaming worker), with the guard on and with ``guard: off``:
spent is what the simulator generated, kept the rows' completion tokens (the abort's latency included).
"""

from __future__ import annotations

import argparse
import json
import time

from budgetq.shared.config_quality import GuardConfig
from budgetq.simulator.lengths import LengthModel
from budgetq.simulator.texts import Script, shape_of
from budgetq.worker.degeneration import LoopGuard

SIGMA = 1.0


def stream(script: Script, guard: LoopGuard | None) -> tuple[int, bool]:
    """(tokens generated, cut by the guard) for one answer streamed one token per chunk."""
    if guard is None:
        return script.tokens, False
    for i, word in enumerate(script.words):
        if guard.feed(word + " " if word else "", i + 1, in_reasoning=i < script.think):
            return i + 1, True
    return script.tokens, guard.flush() is not None


def run(answers: int, fraction: float, period: int, max_tokens: int, mean: float, seed: int) -> dict:
    lengths = LengthModel(seed, mean, SIGMA)
    cfg = GuardConfig()
    out = {"fraction": fraction, "period": period, "answers": answers}
    totals = {"off": {"spent": 0, "kept": 0, "useful": 0}, "on": {"spent": 0, "kept": 0, "useful": 0}}
    loops = false_cuts = 0
    onset_to_cut: list[int] = []
    for n in range(answers):
        key = f"bench-{n}"
        natural = min(max_tokens, lengths.draw(key))
        shape = shape_of(seed, key, natural, loop_fraction=fraction)
        looping = shape.kind == "loop"
        tokens = max_tokens if looping else natural
        script = Script(seed, key, tokens, natural // 2, shape, loop_period=period)
        loops += looping
        # Without the guard: the answer runs to its end (a loop to max_tokens) and is kept.
        off = totals["off"]
        off["spent"] += script.tokens
        off["kept"] += script.tokens
        off["useful"] += 0 if looping else script.tokens
        # With it: streamed through the guard; a cut answer is discarded.
        spent, cut = stream(script, LoopGuard(cfg))
        on = totals["on"]
        on["spent"] += spent
        if cut:
            if looping:
                onset_to_cut.append(spent - shape.onset)
            else:
                false_cuts += 1
        else:
            on["kept"] += spent
            on["useful"] += 0 if looping else spent
    for v in totals.values():
        v["spent_per_kept"] = round(v["spent"] / v["kept"], 4) if v["kept"] else None
        v["spent_per_useful"] = round(v["spent"] / v["useful"], 4) if v["useful"] else None
    onset_to_cut.sort()
    out.update(totals, loops=loops, false_cuts=false_cuts,
               onset_to_cut_p50=onset_to_cut[len(onset_to_cut) // 2] if onset_to_cut else None,
               onset_to_cut_max=onset_to_cut[-1] if onset_to_cut else None,
               loops_missed=loops - len(onset_to_cut))
    return out


def e2e(fraction: float, period: int, guard: bool, prompts: int, max_tokens: int, mean: float, speedup: float,
        concurrency: int) -> dict:
    """One run through the simulator's loop mode (``budgetq sim --loop-fraction F --loop-period P``), a
    producer and a worker streaming from it: the simulator's generated tokens (spent) against the
    rows' completion tokens (kept); without the guard the looping rows (a loop at their tail, by the
    guard's own end-of-answer check) are told apart as not useful."""
    import json as _json
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import _common as c

    from budgetq.worker.degeneration import scan

    stack = c.Stack.start()
    sim = c.Sim("--loop-fraction", str(fraction), "--loop-period", str(period), "--length-mean", str(mean),
                "--length-sigma", str(SIGMA), "--speedup", str(speedup), "--max-running-requests", str(concurrency))
    try:
        data = stack.dir / "prompts.jsonl"
        c.write_prompts(data, prompts)
        ds = c.dataset("D", data, 10**12, max_tokens=max_tokens, prior=int(mean))
        ds["guard"] = guard
        cfg = stack.config(sim.url, [ds])
        t0 = time.monotonic()
        stack.run(cfg, "on" if guard else "off", workers=1, per_worker=concurrency)
        wall = time.monotonic() - t0
        spent = sim.stats()["generated_tokens"]
        out = stack.dir / "out"
        rows = [_json.loads(x) for x in (out / "D.jsonl").read_text().splitlines()] if (out / "D.jsonl").exists() \
            else []
        side = out / "D.discarded.jsonl"
        discarded = [_json.loads(x) for x in side.read_text().splitlines()] if side.exists() else []
        kept = sum(r["completion_tokens"] for r in rows)

        def looping(r: dict) -> bool:
            msg = r["conversations"][-1]
            return scan(msg.get("content") or "", r["completion_tokens"], reasoning=msg.get("reasoning_content")
                        or "") is not None

        useful = sum(r["completion_tokens"] for r in rows if not looping(r))
        details = [d["discard"].get("details") or {} for d in discarded]
        to_cut = sorted(x["cut_tokens"] - x["onset_tokens"] for x in details if "onset_tokens" in x)
        # Tokens the engine made after the guard decided (until the abort landed): the row's count minus the cut's.
        late = sorted(d["completion_tokens"] - (d["discard"].get("details") or {}).get("cut_tokens", 0)
                      for d in discarded if "cut_tokens" in (d["discard"].get("details") or {}))
        return {"onset_to_cut_p50": to_cut[len(to_cut) // 2] if to_cut else None,
                "after_cut_p50": late[len(late) // 2] if late else None, "after_cut_max": late[-1] if late else None,
                "reasons": sorted({d["discard"]["reason"] for d in discarded}),
                "fraction": fraction, "period": period, "guard": guard, "prompts": prompts, "rows": len(rows),
                "discarded": len(discarded), "spent": spent, "kept": kept, "useful": useful,
                "spent_per_kept": round(spent / kept, 4) if kept else None,
                "spent_per_useful": round(spent / useful, 4) if useful else None, "wall_s": round(wall, 1)}
    finally:
        sim.close()
        stack.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--answers", type=int, default=4000)
    ap.add_argument("--max-tokens", type=int, default=16384)
    ap.add_argument("--mean", type=float, default=2048)
    ap.add_argument("--fractions", type=float, nargs="+", default=[0.01, 0.03])
    ap.add_argument("--periods", type=int, nargs="+", default=[1, 20, 150])
    ap.add_argument("--seed", type=int, default=37)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--e2e", type=int, metavar="PROMPTS", default=0,
                    help="instead: this many prompts per run through budgetq sim, a producer and a worker")
    ap.add_argument("--speedup", type=float, default=50.0, help="--e2e: the simulator's speedup")
    ap.add_argument("--concurrency", type=int, default=64, help="--e2e: the worker's concurrency")
    args = ap.parse_args()
    results = []
    if args.e2e:
        print(f"end to end: {args.e2e:,} prompts per run, mean {args.mean:,.0f} tokens (sigma {SIGMA}), max_tokens "
              f"{args.max_tokens:,}, budgetq sim --speedup {args.speedup:g}, 1 worker x {args.concurrency}")
        print(f"{'loops':>6} {'period':>6} {'guard':>5} | {'rows':>5} {'discarded':>9} | {'spent':>10} {'kept':>10} "
              f"{'spent/kept':>10} {'spent/useful':>12} | {'onset->cut p50':>14} {'after cut p50/max':>17} | "
              f"{'wall s':>6}")
        for fraction in args.fractions:
            for period in args.periods:
                for guard in (False, True):
                    r = e2e(fraction, period, guard, args.e2e, args.max_tokens, args.mean, args.speedup,
                            args.concurrency)
                    results.append(r)
                    print(f"{fraction:>6.0%} {period:>6} {'on' if guard else 'off':>5} | {r['rows']:>5} "
                          f"{r['discarded']:>9} | {r['spent']:>10,} {r['kept']:>10,} {r['spent_per_kept']!s:>10} "
                          f"{r['spent_per_useful']!s:>12} | {r['onset_to_cut_p50']!s:>14} "
                          f"{r['after_cut_p50']!s:>8} / {r['after_cut_max']!s:<6} | {r['wall_s']:>6}", flush=True)
        if args.json:
            print(json.dumps(results, indent=1))
        return
    print(f"{args.answers:,} answers each, mean {args.mean:,.0f} tokens (sigma {SIGMA}), max_tokens "
          f"{args.max_tokens:,}; guard defaults {GuardConfig().model_dump()}")
    print(f"{'loops':>6} {'period':>6} | {'no guard: spent/kept':>20} {'spent/useful':>12} | "
          f"{'guard: spent/kept':>17} | {'loops':>5} {'missed':>6} {'false cuts':>10} {'onset->cut p50/max':>18}")
    for fraction in args.fractions:
        for period in args.periods:
            t0 = time.perf_counter()
            r = run(args.answers, fraction, period, args.max_tokens, args.mean, args.seed)
            r["seconds"] = round(time.perf_counter() - t0, 1)
            results.append(r)
            print(f"{fraction:>6.0%} {period:>6} | {r['off']['spent_per_kept']:>20.4f} "
                  f"{r['off']['spent_per_useful']:>12.4f} | {r['on']['spent_per_kept']:>17.4f} | "
                  f"{r['loops']:>5} {r['loops_missed']:>6} {r['false_cuts']:>10} "
                  f"{r['onset_to_cut_p50']!s:>8} / {r['onset_to_cut_max']!s:<8}", flush=True)
    if args.json:
        print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
