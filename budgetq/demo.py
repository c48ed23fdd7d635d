"""``budgetq demo``: private Redis, simulator, two workers and the producer on bundled data."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

from budgetq.localhost import LocalRedis, free_port, wait_http

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
# Mean response lengths per dataset, like the seed's (the simulator keys them on the job id).
MEANS = {"A1": 1577, "B2": 3793, "C1": 2000}



def run_demo(redis_url: str | None, workers: int = 2, concurrency: int = 64) -> int:
    local = None if redis_url else LocalRedis()
    url = redis_url or local.url
    port = free_port()
    out = Path(tempfile.mkdtemp(prefix="budgetq-demo-out-"))
    cfg = yaml.safe_load((EXAMPLES / "demo.yaml").read_text())
    cfg["redis_url"] = url
    cfg["server"]["urls"] = [f"http://127.0.0.1:{port}"]
    cfg["output_dir"] = str(out)
    for ds in cfg["datasets"]:
        ds["path"] = str(EXAMPLES / ds["path"])
    cfg_path = out / "demo.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg))
    py = [sys.executable, "-m", "budgetq.cli"]
    sim_args = [*py, "sim", "--port", str(port), "--speedup", "25", "--seed", "1"]
    for name, mean in MEANS.items():
        sim_args += ["--length-mean-for", f"{name}-={mean}"]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    procs = [subprocess.Popen(sim_args, env=env)]
    try:
        wait_http(f"http://127.0.0.1:{port}/health")
        procs += [subprocess.Popen([*py, "worker", "-c", str(cfg_path), "--concurrency", str(concurrency)], env=env)
                  for _ in range(workers)]
        rc = subprocess.call([*py, "produce", "-c", str(cfg_path)], env=env)
        print(f"outputs in {out}")
        return rc
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
        if local is not None:
            local.stop()
