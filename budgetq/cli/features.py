"""Hidden-state subcommands: ``budgetq features`` (the pass, where the disk is) and
``budgetq features-worker`` (prefill requests, anywhere with Redis and the servers)."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
import sys
from pathlib import Path
from typing import Any

from budgetq.cli.common import load, open_redis, positive_int, with_config
from budgetq.shared.config import Config
from budgetq.shared.retry import REDIS_DOWN

log = logging.getLogger("budgetq.features")
# After the generation worker has stopped, how long the features loop beside it may take to requeue what
# it holds and deregister (its jobs' leases bring them back anyway).
FEATURES_STOP_S = 15.0


def cmd_features(args: argparse.Namespace) -> int:
    from budgetq.hidden_states.collect.check import check, fix_done_set
    from budgetq.hidden_states.collect.features_pass import FeaturesPass

    cfg = load(args)
    if args.server_flags:
        return print_server_flags(cfg)
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


def print_server_flags(cfg: Config) -> int:
    """``budgetq features --server-flags``: the ``vllm serve`` flags for features.backend vllm (layer ids from
    features.model.path's config.json, files under features.store)."""
    from budgetq.hidden_states.capture.vllm_layout import flags_line, server_flags

    f = cfg.features
    if f.model is None or f.store is None:
        print("budgetq: features --server-flags needs features.model.path (the served model's directory) and "
              "features.store (where the engine writes)", file=sys.stderr)
        return 2
    print(flags_line(server_flags(Path(f.model.path), f.model.aux_layers, f.store)))
    return 0


def cmd_features_worker(args: argparse.Namespace) -> int:
    from budgetq.hidden_states.capture.features_worker import FeaturesWorker

    cfg = load(args)
    return asyncio.run(FeaturesWorker(cfg, args.concurrency, burst=args.burst).run())


def print_capture(capture: Any, finished: bool) -> int:
    """`budgetq produce`'s hidden-states lines for capture: features datasets
    (hidden_states/collect/inline.py); the exit
    status: 1 when a run that finished left rows without hidden states (failed jobs, the disk guard, an error)."""
    if not capture.active:
        return 0
    for name, d in capture.summary().items():
        print(f"hidden states {name}: {d['samples_on_disk']} samples on disk ({d['captured']} captured this run, "
              f"{d['failed']} failed, {d['invalid']} invalid), {d['bytes_on_disk'] / 2**20:.1f} MB")
    problems = capture.problems
    for msg in problems:
        print(f"budgetq: capture: {msg}", file=sys.stderr)
    if problems and finished:
        print("budgetq: capture: generation is complete, some rows have no hidden states: `budgetq features` "
              "captures them once the cause is fixed (`budgetq features --check` lists what is on disk)",
              file=sys.stderr)
        return 1
    return 0


def capture_datasets(cfg: Config) -> list[str]:
    return [ds.name for ds in cfg.datasets if ds.capture == "features"]


def features_table(cfg: Config, conn: Any, snap: dict) -> Any:
    """`budgetq status`'s hidden-states table for the config's capture: features datasets (None without
    one): samples on disk (the pass's done set) next to the rows generation committed, jobs queued and
    running, bytes waiting in Redis for the collector."""
    import redis
    from rich.table import Table

    names = capture_datasets(cfg)
    names += [n for n in snap.get("features") or {} if n not in names]  # a `budgetq features` pass's too
    if not names:
        return None
    from budgetq.shared import keys
    from budgetq.shared.features_bytes import STOP, format_bytes

    pipe = conn.pipeline(transaction=False)
    for name in names:
        pipe.scard(keys.features_done_key(name))
        pipe.llen(keys.rq_queue_key(keys.features_name(name)))
        pipe.zcard(keys.rq_wip_key(keys.features_name(name)))
        pipe.get(keys.features_pending_key(name))
    try:
        got = pipe.execute()
    except redis.RedisError:
        return None  # Redis away: the snapshot's own error line says so (status --watch keeps going)
    committed = {d["dataset"]: d["counts"]["committed"] for d in snap["datasets"]}
    disk = snap.get("features") or {}
    t = Table(title="hidden states (capture: features)", title_justify="left")
    for col in ("dataset", "on disk / committed", "queued", "running", "in Redis", "bytes / disk budget", "stop"):
        t.add_column(col, justify="left" if col in ("dataset", "stop") else "right", no_wrap=True)
    for i, name in enumerate(names):
        done, queued, running, pending = got[4 * i: 4 * i + 4]
        f = disk.get(name) or {"bytes_written": 0, "max_bytes": None, "stop": None}
        t.add_row(name, f"{done:,} / {committed.get(name, 0):,}", f"{queued:,}", f"{running:,}",
                  f"{int(pending or 0) / 2**20:.1f} MB",
                  f"{format_bytes(f['bytes_written'])} / {format_bytes(f['max_bytes']) if f['max_bytes'] else 'none'}",
                  STOP if f["stop"] else "capturing")
    return t


async def run_worker_with_features(w: Any, cfg: Config, burst: bool) -> int:
    """``budgetq worker`` with a capture: features dataset: the generation worker ``w`` (worker/runner.py)
    and a features worker (hidden_states/capture/features_worker.py) in one event loop. The generation
    worker owns the signals;
    its stop stops the features loop too. With --burst each ends when its own queues are empty."""
    from budgetq.hidden_states.capture.features_worker import FeaturesWorker

    fw = FeaturesWorker(cfg, burst=burst)

    async def features_loop() -> int:
        # Redis may not answer yet (the generation worker waits redis_wait_s for it): the features loop waits too.
        waiting = False
        while True:
            try:
                return await fw.run(handle_signals=False)
            except REDIS_DOWN as exc:
                if fw.stopping.is_set() or w.stopping.is_set():
                    return 0
                if not waiting:
                    log.warning("features loop: redis unreachable (%s); retrying", exc)
                    waiting = True
                await asyncio.sleep(1.0)

    features = asyncio.create_task(features_loop())
    features.add_done_callback(_report_crash)

    async def forward_stop() -> None:
        await w.stopping.wait()
        fw.request_stop("the worker is stopping")

    forward = asyncio.create_task(forward_stop())
    try:
        rc = await w.run()
    finally:
        if not burst or w.stopping.is_set():
            fw.request_stop("the worker stopped")
        done, _ = await asyncio.wait({features}, timeout=None if burst and not w.stopping.is_set()
                                     else FEATURES_STOP_S)
        forward.cancel()
    frc = features.result() if features in done and not features.cancelled() and not features.exception() else 1
    return rc or frc


def _report_crash(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("the features loop of this worker stopped: %s: %s (generation goes on; run `budgetq "
                  "features-worker` to serve capture: features datasets)", type(task.exception()).__name__,
                  task.exception())


def register(sub: argparse._SubParsersAction) -> None:
    sp = with_config(sub.add_parser("features", help="capture hidden states of the committed rows (restart-safe)"))
    sp.add_argument("--dataset", action="append", help="dataset name (repeatable); default: every dataset")
    sp.add_argument("--output-dir", help="overrides output_dir")
    sp.add_argument("--follow", action="store_true",
                    help="also capture rows committed while it runs (beside `budgetq produce`); stop with Ctrl-C")
    sp.add_argument("--check", action="store_true", help="verify rows <-> index <-> shards <-> Redis, change nothing")
    sp.add_argument("--fix", action="store_true", help="with --check: set the Redis done set to what is on disk")
    sp.add_argument("--json", action="store_true")
    sp.add_argument("--server-flags", action="store_true",
                    help="print the `vllm serve` flags for features.backend vllm (layers from features.model.path, "
                         "files under features.store) and exit")
    sp.set_defaults(func=cmd_features)
    sp = with_config(sub.add_parser("features-worker", help="run a features worker (prefill requests)"))
    sp.add_argument("--concurrency", type=positive_int, help="overrides features.concurrency")
    sp.add_argument("--burst", action="store_true", help="exit when no features job is left")
    sp.set_defaults(func=cmd_features_worker)
