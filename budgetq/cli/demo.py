"""``budgetq demo``: private Redis, simulator, two workers and the producer on bundled data.

The demo config and datasets ship inside the package (``budgetq/examples``, read through
``importlib.resources``), so the demo works from a wheel or the Docker image as well as from
a checkout, where ``examples/`` is a link to the same files.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path

import yaml

from budgetq.simulator.local import LocalRedis, LocalSim, cli_command

# Mean response lengths per dataset, like the seed's (the simulator keys them on the job id).
MEANS = {"A1": 1577, "B2": 3793, "C1": 2000}


def examples() -> Traversable:
    """The bundled examples: demo.yaml, budgetq.yaml (every field) and data/*.jsonl."""
    return resources.files("budgetq") / "examples"


def _copy_tree(src: Traversable, dest: Path) -> None:
    # Copied, not referenced in place: a Traversable need not be a real directory (zip imports).
    dest.mkdir(parents=True, exist_ok=True)
    for entry in src.iterdir():
        if entry.is_dir():
            _copy_tree(entry, dest / entry.name)
        else:
            with entry.open("rb") as fin, open(dest / entry.name, "wb") as fout:
                shutil.copyfileobj(fin, fout)


def write_demo_config(out: Path, redis_url: str, server_url: str) -> Path:
    """The bundled demo config with its data copied under ``out``; returns the config's path."""
    _copy_tree(examples() / "data", out / "data")
    cfg = yaml.safe_load((examples() / "demo.yaml").read_text())
    cfg["redis_url"] = redis_url
    cfg["server"]["urls"] = [server_url]
    cfg["output_dir"] = str(out)
    for ds in cfg["datasets"]:
        ds["path"] = str(out / ds["path"])
    cfg_path = out / "demo.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg))
    return cfg_path


def run_demo(redis_url: str | None, workers: int = 2, concurrency: int = 64,
             log_level: str = "INFO", log_format: str = "text") -> int:
    local = None if redis_url else LocalRedis()
    url = redis_url or local.url  # type: ignore[union-attr]
    # Every child gets the demo's own --log-level/--log-format: `budgetq --log-level WARNING
    # demo` must be quiet all the way down, not only in this process.
    py = cli_command(log_level, log_format)
    sim_flags = ["--speedup", "25", "--seed", "1"]
    for name, mean in MEANS.items():
        sim_flags += ["--length-mean-for", f"{name}-={mean}"]
    # The children read only the demo's config: a BUDGETQ_SERVER_URLS or BUDGETQ_REDIS_URL left
    # in the user's shell would otherwise override it and send demo traffic to a real server.
    env = {k: v for k, v in os.environ.items() if not k.startswith("BUDGETQ_")}
    env["PYTHONUNBUFFERED"] = "1"
    sim: LocalSim | None = None
    procs: list[subprocess.Popen] = []
    try:
        sim = LocalSim(*sim_flags, cli=py, env=env)
        out = Path(tempfile.mkdtemp(prefix="budgetq-demo-out-"))
        cfg_path = write_demo_config(out, url, sim.url)
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
        if sim is not None:
            sim.stop()
        if local is not None:
            local.stop()
