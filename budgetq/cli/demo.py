"""``budgetq demo``: private Redis, simulator, two workers and the producer on bundled data.

The demo config and datasets ship inside the package (``budgetq/examples``, read through
``importlib.resources``), so the demo works from a wheel or the Docker image as well as from
a checkout, where ``examples/`` is a link to the same files.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
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


def _stop_quietly(procs: list[subprocess.Popen], logs: list[Path]) -> None:
    """SIGTERM the workers (each finishes in a moment: nothing is left to run) and wait; a worker
    that ended badly has its log's tail said, the others stay quiet (their stop lines are in their log)."""
    for p in procs:
        p.terminate()
    for p, log in zip(procs, logs, strict=False):
        try:
            rc = p.wait(10)
        except subprocess.TimeoutExpired:
            p.kill()
            rc = p.wait()
        if rc not in (0, -signal.SIGTERM):
            tail = log.read_text(errors="replace").splitlines()[-20:] if log.exists() else []
            print(f"worker exited with status {rc}; the end of {log}:", *tail, sep="\n", file=sys.stderr)


def run_demo(redis_url: str | None, workers: int = 2, concurrency: int = 32,
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
    logs: list[Path] = []
    try:
        sim = LocalSim(*sim_flags, cli=py, env=env)
        out = Path(tempfile.mkdtemp(prefix="budgetq-demo-out-"))
        cfg_path = write_demo_config(out, url, sim.url)
        # The workers log to files: their lines (and the stop each says at SIGTERM) would otherwise
        # land in the middle of the producer's progress and after its summary.
        for i in range(1, workers + 1):
            logs.append(out / f"worker-{i}.log")
            with open(logs[-1], "w") as log:  # the child keeps its own copy of the descriptor
                procs.append(subprocess.Popen([*py, "worker", "-c", str(cfg_path), "--concurrency", str(concurrency)],
                                              env=env, stdout=log, stderr=subprocess.STDOUT))
        rc = subprocess.call([*py, "produce", "-c", str(cfg_path)], env=env)
        _stop_quietly(procs, logs)
        procs = []
        # The last line ends with the run report `produce` wrote (the run in pictures, one HTML file).
        report = out / "report.html"
        where = f"; the run in pictures: {report}" if report.exists() else ""
        print(f"outputs in {out} (the workers' logs: {', '.join(p.name for p in logs)}){where}")
        return rc
    finally:
        _stop_quietly(procs, logs)
        if sim is not None:
            sim.stop()
        if local is not None:
            local.stop()
