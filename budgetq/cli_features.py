"""Hidden-state subcommands: ``budgetq features`` (the pass, where the disk is) and
``budgetq features-worker`` (prefill requests, anywhere with Redis and the servers)."""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys

from budgetq.cli_common import load, open_redis, positive_int, with_config


def cmd_features(args: argparse.Namespace) -> int:
    from producer.features import FeaturesPass
    from producer.features_check import check, fix_done_set

    cfg = load(args)
    conn = open_redis(cfg, "features", cfg.redis_wait_s)
    if conn is None:
        return 1
    if args.check:
        if args.fix:
            print(f"done set: {fix_done_set(cfg, conn, args.dataset)} entries set to what is on disk")
        problems = check(cfg, conn, args.dataset)
        for name, found in problems.items():
            print(f"{name}: {'consistent' if not found else f'{len(found)} problem(s)'}")
            for msg in found:
                print(f"  {msg}")
        return 1 if any(problems.values()) else 0
    fp = FeaturesPass(cfg, conn, args.dataset, follow=args.follow)

    def stop(_signum: int, _frame: object) -> None:
        fp.stop.set()
    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    rep = fp.run()
    if args.json:
        print(json.dumps({"datasets": rep.datasets, "failed": rep.failed, "stopped_by": rep.stopped_by}, indent=2))
    else:
        for name, d in rep.datasets.items():
            print(f"{name}: {d['samples_on_disk']} samples on disk ({d['captured']} new, {d['failed']} failed, "
                  f"{d['invalid']} invalid, {d['duplicates_dropped']} duplicate copies dropped), "
                  f"{d['bytes_on_disk'] / 2**20:.1f} MB, {d['bytes_per_token']} bytes/token")
            for msg in rep.failed.get(name, [])[:10]:
                print(f"  failed: {msg}", file=sys.stderr)
    if rep.stopped_by:
        print(f"budgetq: features: admissions stopped: {rep.stopped_by}", file=sys.stderr)
    return 0 if rep.ok and (args.follow or not fp.stop.is_set()) else 1


def cmd_features_worker(args: argparse.Namespace) -> int:
    from worker.features import FeaturesWorker

    cfg = load(args)
    return asyncio.run(FeaturesWorker(cfg, args.concurrency, burst=args.burst).run())


def register(sub: argparse._SubParsersAction) -> None:
    sp = with_config(sub.add_parser("features", help="capture hidden states of the committed rows (restart-safe)"))
    sp.add_argument("--dataset", action="append", help="dataset name (repeatable); default: every dataset")
    sp.add_argument("--output-dir", help="overrides output_dir")
    sp.add_argument("--follow", action="store_true",
                    help="also capture rows committed while it runs (beside `budgetq produce`); stop with Ctrl-C")
    sp.add_argument("--check", action="store_true", help="verify rows <-> index <-> shards <-> Redis, change nothing")
    sp.add_argument("--fix", action="store_true", help="with --check: set the Redis done set to what is on disk")
    sp.add_argument("--json", action="store_true")
    sp.set_defaults(func=cmd_features)
    sp = with_config(sub.add_parser("features-worker", help="run a features worker (prefill requests)"))
    sp.add_argument("--concurrency", type=positive_int, help="overrides features.concurrency")
    sp.add_argument("--burst", action="store_true", help="exit when no features job is left")
    sp.set_defaults(func=cmd_features_worker)
