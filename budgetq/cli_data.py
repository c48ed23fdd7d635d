"""Data subcommands: ``budgetq export`` (results JSONL -> Parquet)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from budgetq.cli_common import load, with_config


def cmd_export(args: argparse.Namespace) -> int:
    from producer.export import export_parquet
    from producer.meta import meta_path

    cfg = load(args)
    names = args.dataset or [d.name for d in cfg.datasets]
    for name in names:
        cfg.dataset(name)  # an unknown name is a ConfigError naming it
    dest = Path(args.out) if args.out else cfg.output_dir
    missing = 0
    for name in names:
        source = cfg.output_dir / f"{name}.jsonl"
        if not source.exists():
            print(f"{name}: no {source}: nothing to export", file=sys.stderr)
            missing += 1
            continue
        res = export_parquet(source, dest / f"{name}.parquet", meta=meta_path(cfg.output_dir, name))
        note = f", {res.malformed} malformed line(s) skipped" if res.malformed else ""
        print(f"{name}: {res.rows} rows -> {res.target}{note}")
        for msg in res.reports:
            print(f"  {msg}", file=sys.stderr)
        if res.malformed > len(res.reports):
            print(f"  ... and {res.malformed - len(res.reports)} more", file=sys.stderr)
    return 1 if missing else 0


def register(sub: argparse._SubParsersAction) -> None:
    sp = with_config(sub.add_parser("export", help="convert out/<dataset>.jsonl to Parquet"))
    sp.add_argument("--dataset", action="append", help="dataset name (repeatable); default: every dataset")
    sp.add_argument("--format", choices=("parquet",), default="parquet")
    sp.add_argument("--out", help="directory for <dataset>.parquet (default: output_dir)")
    sp.add_argument("--output-dir", help="where the results JSONL files are (overrides output_dir)")
    sp.set_defaults(func=cmd_export)
