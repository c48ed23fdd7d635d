"""Data subcommands: ``budgetq export`` (results JSONL -> Parquet or SpecForge), ``budgetq check`` (a dry run)."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

from budgetq.cli.common import OUTPUT_DIR_HELP, discover_context, load, with_config


def cmd_export(args: argparse.Namespace) -> int:
    from budgetq.producer.ops.export import ExportResult, export_parquet, export_specforge, specforge_note
    from budgetq.producer.run.meta import meta_path

    cfg = load(args)
    names = args.dataset or [d.name for d in cfg.datasets]
    for name in names:
        cfg.dataset(name)  # an unknown name is a ConfigError naming it
    dest = Path(args.out) if args.out else cfg.output_dir
    missing = 0
    for name in names:
        if args.format == "specforge-offline":  # hidden states: from the features shards
            from budgetq.hidden_states.collect.export import export_specforge_offline, offline_note
            from budgetq.hidden_states.store.shards import features_root

            off = export_specforge_offline(features_root(cfg), name, dest / f"{name}.specforge-offline")
            print(f"{name}: {off.written} files -> {off.target} ({off.kept} already there){offline_note(off)}")
            continue
        source = cfg.output_dir / f"{name}.jsonl"
        if not source.exists():
            print(f"{name}: no {source}: nothing to export", file=sys.stderr)
            missing += 1
            continue
        res: ExportResult
        if args.format == "specforge":
            res = export_specforge(source, dest / f"{name}.specforge.jsonl")
        else:
            res = export_parquet(source, dest / f"{name}.parquet", meta=meta_path(cfg.output_dir, name))
        note = f", {res.malformed} malformed line(s) skipped" if res.malformed else ""
        note += specforge_note(res)
        print(f"{name}: {res.rows} rows -> {res.target}{note}")
        for msg in res.reports:
            print(f"  {msg}", file=sys.stderr)
        if res.malformed > len(res.reports):
            print(f"  ... and {res.malformed - len(res.reports)} more", file=sys.stderr)
    return 1 if missing else 0


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a number above 0 (got {text!r})")
    return value


def cmd_check(args: argparse.Namespace) -> int:
    from budgetq.producer.ops.check import format_report, run_check
    from budgetq.worker.sglang_client import probe_server

    cfg = load(args)
    discover_context(cfg, args.timeout_s)   # what produce would check prompts against
    report = run_check(cfg, lambda url: asyncio.run(probe_server(cfg.server, url, args.timeout_s)),
                       tok_s=args.tok_s, timeout_s=args.timeout_s, strict=args.strict)
    print(json.dumps(report.as_dict(), indent=2) if args.json else format_report(report))
    return 0 if report.ok else 1


def register(sub: argparse._SubParsersAction) -> None:
    what = ("convert out/<dataset>.jsonl to Parquet (default), SpecForge JSONL (complete rows SpecForge "
            "accepts) or SpecForge's offline hidden-states files")
    sp = with_config(sub.add_parser("export", help=what, description=what), servers=False)
    sp.add_argument("--dataset", action="append", help="dataset name (repeatable); default: every dataset")
    sp.add_argument("--format", choices=("parquet", "specforge", "specforge-offline"), default="parquet",
                    help="specforge: <dataset>.specforge.jsonl, complete rows SpecForge accepts only; "
                         "specforge-offline: the hidden states as SpecForge's offline .ckpt files (needs torch)")
    sp.add_argument("--out", help="directory for <dataset>.parquet / .specforge.jsonl (default: output_dir)")
    sp.add_argument("--output-dir", help="where the results JSONL files are (overrides output_dir)")
    sp.set_defaults(func=cmd_export)
    sp = with_config(sub.add_parser("check", help="read every dataset, ask Redis and the servers, estimate the run; "
                                                  "writes nothing (exit 0 only if every dataset can run; 1 if not)"))
    sp.add_argument("--strict", action="store_true",
                    help="also exit 1 if a dataset has invalid rows (bad JSON, missing prompt, repeated id, ...; "
                         "filtered rows do not count): for CI and scripts that must not run on bad data")
    sp.add_argument("--output-dir", help=OUTPUT_DIR_HELP + "; checked for room as produce would find it")
    sp.add_argument("--tok-s", type=_positive, help="generation rate of all servers together, for time estimates")
    sp.add_argument("--timeout-s", type=_positive, default=3.0, help="for Redis and each server (default 3)")
    sp.add_argument("--json", action="store_true")
    sp.set_defaults(func=cmd_check)
