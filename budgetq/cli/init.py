"""``budgetq init [DIR]``: a commented example config and sample data to start from.

Both come from the package (``budgetq/examples``, package data), so a pip install has them:
DIR/budgetq.yaml is the example that documents every field, DIR/data/ the sample datasets it
and docs/datasets.md point at. Commands run in DIR find budgetq.yaml without ``-c``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from budgetq.cli.common import DEFAULT_CONFIG
from budgetq.shared.errors import BudgetqError

EXAMPLE = "budgetq.yaml"   # in budgetq/examples: every field, commented


def write_example(dest: Path, force: bool = False) -> list[Path]:
    """Copy the example config (as DEST/budgetq.yaml) and data/ into ``dest``; the files written.

    Never overwrites a file without ``force``: an existing config is someone's work.
    """
    from budgetq.cli.demo import examples

    src = examples()
    targets = [(src / EXAMPLE, dest / DEFAULT_CONFIG)]
    targets += [(f, dest / "data" / f.name) for f in sorted((src / "data").iterdir(), key=lambda f: f.name)
                if f.is_file()]
    existing = [t for _s, t in targets if t.exists()]
    if existing and not force:
        raise BudgetqError(f"{existing[0]} exists; not overwriting it (--force replaces the example files)")
    try:
        (dest / "data").mkdir(parents=True, exist_ok=True)
        for source, target in targets:
            target.write_bytes(source.read_bytes())
    except OSError as exc:
        raise BudgetqError(f"cannot write the example into {dest}: {exc.strerror or exc}") from None
    return [t for _s, t in targets]


def cmd_init(args: argparse.Namespace) -> int:
    dest = Path(args.dir)
    written = write_example(dest, force=args.force)
    print(f"wrote {written[0]} (every setting, commented) and {len(written) - 1} sample datasets in {dest / 'data'}")
    where = "" if dest.resolve() == Path.cwd().resolve() else f"cd {dest} && "
    print(f"next: {where}budgetq check; then budgetq worker & and budgetq produce (commands there find "
          f"{DEFAULT_CONFIG} without -c)")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    sp = sub.add_parser("init", help=f"write a commented example config ({DEFAULT_CONFIG}) and sample data")
    sp.add_argument("dir", nargs="?", default=".", help="where to write them (default: the current directory)")
    sp.add_argument("--force", action="store_true", help="overwrite example files already there")
    sp.set_defaults(func=cmd_init)
