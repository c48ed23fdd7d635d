"""Each benchmark runs end to end (--smoke: tiny sizes) and prints tables whose ratios parse.

Never asserts a timing target: the machine is shared and noisy; the numbers belong in
docs/benchmarks.md, not in a test. The timeout only stops a hang: in `make test` these run beside the vLLM
server on 2 cores, where a smoke that takes 20-40 s alone has taken over 240 s.
"""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from _common import number, parse_md_tables  # noqa: E402

# benchmark -> the ratio column that must be positive in its last table
KEY_RATIO = {
    "budget_precision": "used/budget",
    "pipeline_vs_direct": "ratio pipeline / direct",
    "orchestration": "ratio vs stock rq",
    "scale": "ratio to model",
    "producer_memory": "peak RSS ratio to the smallest",
    "check_rate": "peak RSS ratio to the smallest",
    "end_game": "used/budget (worst)",
    "regenerate_cost": "ratio all / last",
    "ceiling": "ratio to goal",
    "prefix_routing": "ratio prefix / least_loaded",
    "concurrency_auto": "ratio auto / best fixed",
    "features": "ratio pass / direct",
    "network_rtt": "ratio rtt / loopback",
    "features_store": "ratio tok/s to stream",
    "fp8_error": "ratio agreeing",
    "stream_cpu": "ratio guard / decode",
    "samples_n": "ratio tok/s n / N requests",
}


@pytest.mark.parametrize("name", sorted(KEY_RATIO))
def test_benchmark_prints_a_table_of_positive_ratios(name):
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / f"{name}.py"), "--smoke"], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "- nproc:" in proc.stdout and "- load average at start:" in proc.stdout
    tables = parse_md_tables(proc.stdout)
    assert tables and all(tables), proc.stdout
    for table in tables:
        for row in table:
            for col, cell in row.items():
                if "ratio" in col and cell != "-":
                    value = number(cell)
                    assert math.isfinite(value) and value >= 0, (col, cell)
    key = [row[KEY_RATIO[name]] for row in tables[-1] if row[KEY_RATIO[name]] != "-"]
    assert key and all(number(v) > 0 for v in key), tables[-1]
