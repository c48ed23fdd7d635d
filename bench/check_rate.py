"""`budgetq check` read rate and memory: 10k vs. 1M rows, ids from a field vs. from the content.

    python bench/check_rate.py [--quick | --smoke]

Each size runs `budgetq check --json` as its own process against a private Redis and an
--instant simulator. The rate is rows over the dataset's read time as check reports it
(read_prompts plus check's own counting); peak RSS is the process's high-water mark (wait4's
ru_maxrss). Target: streaming, so peak RSS grows only by the 8 bytes per row of the
duplicate-id hashes; the rate is read_prompts' own, within a few percent.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import _common as c

DS = "K1"


def run_check(stack: c.Stack, sim: c.Sim, rows: int, id_field: bool) -> list[object]:
    data = stack.dir / f"{DS}-{rows}.jsonl"
    if not data.exists():
        c.write_prompts(data, rows)
    ds = c.dataset(DS, data, "1000M", prior=1500)
    if not id_field:
        del ds["id_field"]  # ids are a hash of the row (stable_id): the slower path
    cfg = stack.config(sim.url, [ds])
    proc = subprocess.Popen([*c.CLI, "check", "-c", str(cfg), "--json"], cwd=c.ROOT, env=c.ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    out = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"budgetq check exited with {status}: {out[-2000:]!r}")
    report = json.loads(out)["datasets"][0]
    if report["valid"] != rows or report["duplicates"] != 0:
        raise RuntimeError(f"check counted {report['valid']} valid, {report['duplicates']} duplicate of {rows}")
    return [rows, "id_field" if id_field else "content hash", data.stat().st_size / 2**20, report["read_s"],
            rows / report["read_s"], usage.ru_maxrss / 1024]


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="10k vs 100k rows")
    ap.add_argument("--smoke", action="store_true", help="tiny, for the test suite")
    args = ap.parse_args(argv)
    sizes = (2_000, 10_000) if args.smoke else (10_000, 100_000) if args.quick else (10_000, 1_000_000)
    c.print_header("budgetq check read rate", ["bench/check_rate.py", *argv])
    print("rows of ~120 characters (bench/_common.py write_prompts)\n", flush=True)
    sim = c.Sim("--instant")
    stack = c.Stack.start()
    try:
        rows = []
        for id_field in (True, False):
            for n in sizes:
                rows.append(run_check(stack, sim, n, id_field))
                print(f"  {n:,} rows, {rows[-1][1]}: {rows[-1][4]:,.0f} rows/s, peak RSS {rows[-1][5]:.1f} MB",
                      flush=True)
    finally:
        stack.close()
        sim.close()
    base = rows[0][5]
    print(c.md_table(["rows", "ids", "file MB", "read s", "rows/s", "peak RSS MB", "peak RSS ratio to the smallest"],
                     [[*r, r[5] / base] for r in rows]))


if __name__ == "__main__":
    main(sys.argv[1:])
