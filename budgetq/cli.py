"""``budgetq`` subcommands. Parses flags, sets up logging, calls library functions."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys

from shared.errors import BudgetqError
from shared.tokens import format_tokens, parse_tokens


def _load(args: argparse.Namespace):
    from shared.config import load_config

    overrides = {("redis_url",): getattr(args, "redis_url", None)}
    if getattr(args, "server_url", None):
        overrides[("server", "urls")] = args.server_url
    if getattr(args, "output_dir", None):
        overrides[("output_dir",)] = args.output_dir
    return load_config(args.config, overrides)


def print_summary(rows: list[dict]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="budgetq summary")
    for col in ("dataset", "budget", "used", "used/budget", "rows", "skipped", "failed", "invalid", "stop"):
        table.add_column(col)
    for r in rows:
        ratio = f"{r['used'] / r['budget']:.4f}" if r["budget"] else "-"
        table.add_row(r["dataset"], format_tokens(r["budget"]), str(r["used"]), ratio, str(r["rows"]),
                      str(r["skipped"]), str(r["failed"]), str(r["invalid"]), r["stop"])
    Console().print(table)


def cmd_produce(args: argparse.Namespace) -> int:
    from producer.run import Producer

    rows = Producer(_load(args)).run()
    print_summary(rows)
    return 0


def cmd_worker(args: argparse.Namespace) -> int:
    from worker.runner import ConcurrentWorker

    cfg = _load(args)
    w = ConcurrentWorker(cfg, args.concurrency or cfg.worker.concurrency, burst=args.burst, grace_s=args.grace_s)
    return asyncio.run(w.run())


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


def cmd_status(args: argparse.Namespace) -> int:
    import redis

    from shared import keys
    from shared.budget import dataset_state

    cfg = _load(args)
    conn = redis.Redis.from_url(cfg.redis_url)
    names = sorted(n.decode() for n in conn.smembers(keys.DATASETS))
    out = []
    for n in names:
        st = dataset_state(conn, n)
        out.append({"dataset": n, "budget": st.limit, "used": st.used, "reserved": st.reserved,
                    "in_flight": st.in_flight, "mode": st.mode, "paused": st.paused, "stats": st.stats})
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        for r in out:
            pct = 100 * r["used"] / r["budget"] if r["budget"] else 0
            print(f"{r['dataset']:<16} {format_tokens(r['used']):>9} / {format_tokens(r['budget']):<9} "
                  f"{pct:6.2f}%  in flight {r['in_flight']:<4} {'PAUSED' if r['paused'] else ''}")
    return 0


def _set_conf(args: argparse.Namespace, field: str, value: str) -> int:
    import redis

    from shared import keys

    cfg = _load(args)
    conn = redis.Redis.from_url(cfg.redis_url)
    if not conn.sismember(keys.DATASETS, args.dataset):
        raise BudgetqError(f"dataset {args.dataset!r} is not registered in {cfg.redis_url.split('@')[-1]}")
    conn.hset(keys.conf_key(args.dataset), field, value)
    print(f"{args.dataset}: {field} = {value}")
    return 0


def cmd_budget_set(args: argparse.Namespace) -> int:
    try:
        tokens = parse_tokens(args.tokens)
    except ValueError as exc:
        raise BudgetqError(f"budget for {args.dataset}: {exc}") from None
    return _set_conf(args, "limit", str(tokens))


def cmd_pause(args: argparse.Namespace) -> int:
    return _set_conf(args, "paused", "1")


def cmd_resume(args: argparse.Namespace) -> int:
    return _set_conf(args, "paused", "0")


def cmd_demo(args: argparse.Namespace) -> int:
    from budgetq.demo import run_demo

    return run_demo(redis_url=args.redis_url, workers=args.workers, concurrency=args.concurrency)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="budgetq", description="Token-budgeted generation on Redis + RQ + SGLang")
    p.add_argument("--log-level", default="INFO")
    sub = p.add_subparsers(dest="cmd", required=True)

    def with_config(sp: argparse.ArgumentParser) -> argparse.ArgumentParser:
        sp.add_argument("-c", "--config", help="YAML config file")
        sp.add_argument("--redis-url")
        sp.add_argument("--server-url", action="append", help="SGLang URL (repeatable)")
        return sp

    sp = with_config(sub.add_parser("produce", help="enqueue prompts and collect results"))
    sp.add_argument("--output-dir")
    sp.set_defaults(func=cmd_produce)
    sp = with_config(sub.add_parser("worker", help="run a concurrent worker"))
    sp.add_argument("--concurrency", type=int)
    sp.add_argument("--burst", action="store_true", help="exit when the queues are empty")
    sp.add_argument("--grace-s", type=float, default=30.0)
    sp.set_defaults(func=cmd_worker)
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
    sp = with_config(sub.add_parser("status", help="per-dataset budget and progress"))
    sp.add_argument("--json", action="store_true")
    sp.set_defaults(func=cmd_status)
    bp = sub.add_parser("budget", help="change a budget live").add_subparsers(dest="bcmd", required=True)
    sp = with_config(bp.add_parser("set"))
    sp.add_argument("dataset")
    sp.add_argument("tokens")
    sp.set_defaults(func=cmd_budget_set)
    for name, fn in (("pause", cmd_pause), ("resume", cmd_resume)):
        sp = with_config(sub.add_parser(name, help=f"{name} a dataset"))
        sp.add_argument("dataset")
        sp.set_defaults(func=fn)
    sp = sub.add_parser("demo", help="the whole pipeline on one machine with bundled data")
    sp.add_argument("--redis-url")
    sp.add_argument("--workers", type=int, default=2)
    sp.add_argument("--concurrency", type=int, default=64)
    sp.set_defaults(func=cmd_demo)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        return args.func(args)
    except (BudgetqError, FileNotFoundError) as exc:
        print(f"budgetq: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
