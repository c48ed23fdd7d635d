"""``budgetq sim``: flags of the SGLang simulator."""

from __future__ import annotations

import argparse
import asyncio
import logging


def cmd_sim(args: argparse.Namespace) -> int:
    from simulator.model import SimSettings
    from simulator.server import start_sim

    means = {}
    for item in args.length_mean_for or []:
        prefix, _, mean = item.partition("=")
        means[prefix] = float(mean)
    settings = SimSettings(max_running_requests=args.max_running_requests, peak_tok_s=args.peak_tok_s,
                           length_mean=args.length_mean, length_sigma=args.length_sigma, length_means=means,
                           speedup=args.speedup, error_rate=args.error_rate, seed=args.seed)

    async def main() -> None:
        runner = await start_sim(settings, args.host, args.port)
        logging.getLogger("budgetq.sim").info("simulator on http://%s:%d (speed-up %gx)",
                                              args.host, args.port, args.speedup)
        try:
            await asyncio.Event().wait()
        finally:
            await runner.cleanup()

    try:
        asyncio.run(main())
    except KeyboardInterrupt:
        pass
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    sp = sub.add_parser("sim", help="run the SGLang simulator")
    sp.add_argument("--host", default="127.0.0.1")
    sp.add_argument("--port", type=int, default=30000)
    sp.add_argument("--max-running-requests", type=int, default=256)
    sp.add_argument("--peak-tok-s", type=float, default=20_000.0)
    sp.add_argument("--length-mean", type=float, default=1500.0)
    sp.add_argument("--length-mean-for", action="append", metavar="RID_PREFIX=MEAN")
    sp.add_argument("--length-sigma", type=float, default=0.8, help="lognormal sigma of lengths")
    sp.add_argument("--speedup", type=float, default=1.0)
    sp.add_argument("--error-rate", type=float, default=0.0)
    sp.add_argument("--seed", type=int, default=0)
    sp.set_defaults(func=cmd_sim)
