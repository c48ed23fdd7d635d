"""Where one worker process spends its CPU on the orchestration benchmark's workload (a py-spy profile).

    pip install py-spy    # a tool, not a project dependency
    python bench/profile_worker.py [--jobs 20000] [--concurrency 256] [--raw /tmp/worker.raw]

Enqueues the jobs with the real producer (as bench/orchestration.py does), runs
`budgetq worker --burst` under `py-spy record --gil` against the --instant simulator, and
prints the functions with the most samples: "self" (the function itself was running) and
"inclusive" (it was on the stack). With --gil only the thread holding the GIL is sampled,
so the shares add up to the worker's Python CPU time (sampling slows the worker down).
"""

from __future__ import annotations

import argparse
import collections
import re
import shutil
import subprocess
import sys
from pathlib import Path

import _common as c
from orchestration import enqueue

# Frames every sample passes through (interpreter, event loop, thread start): not informative.
_BORING = re.compile(r"<frozen |asyncio/(runners|base_events)\.py|threading\.py|concurrent/futures/thread\.py|"
                     r"budgetq/cli\.py|asyncio/events\.py")


def summarise(raw: Path, top: int) -> str:
    own: collections.Counter[str] = collections.Counter()
    incl: collections.Counter[str] = collections.Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        n = int(count)
        total += n
        frames = [re.sub(r":\d+\)$", ")", f) for f in stack.split(";") if f]
        if not frames:
            continue
        own[frames[-1]] += n
        for f in set(frames):
            if not _BORING.search(f):
                incl[f] += n
    rows = [f"{total} samples (GIL held)", "", "self:"]
    rows += [f"  {100 * n / total:5.1f}%  {f}" for f, n in own.most_common(top)]
    rows += ["", "inclusive:"]
    rows += [f"  {100 * n / total:5.1f}%  {f}" for f, n in incl.most_common(2 * top)]
    return "\n".join(rows)


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--jobs", type=int, default=20_000)
    ap.add_argument("--concurrency", type=int, default=256)
    ap.add_argument("--raw", type=Path, default=Path("/tmp/budgetq-worker.raw"), help="py-spy's collapsed stacks")
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args(argv)
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(spy).exists():
        sys.exit("py-spy not found: pip install py-spy")
    c.print_header("Worker CPU profile (py-spy --gil)", ["bench/profile_worker.py", *argv])
    sim = c.Sim("--instant", "--length-mean", "16", "--keep-records", "0")
    stack = c.Stack.start()
    try:
        cfg = enqueue(stack, sim, args.jobs)
        subprocess.run([spy, "record", "--gil", "--rate", "250", "--format", "raw", "-o", str(args.raw), "--",
                        *c.CLI, "worker", "-c", str(cfg), "--concurrency", str(args.concurrency), "--burst"],
                       cwd=c.ROOT, env=c.ENV, check=True, capture_output=True)
    finally:
        stack.close()
        sim.close()
    print(summarise(args.raw, args.top))


if __name__ == "__main__":
    main(sys.argv[1:])
