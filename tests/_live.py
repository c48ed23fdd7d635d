"""A real budgetq run for the ops tests: worker and producer processes against a simulator.

Shared by test_status, test_monitor and test_secrets (pytest puts tests/ on sys.path).
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
CLI = [sys.executable, "-m", "budgetq.cli"]


def write_dataset(path: Path, n: int) -> None:
    path.write_text("".join(json.dumps({"id": f"p{i}", "prompt": f"question {i}"}) + "\n" for i in range(n)))


def three_datasets(tmp_path: Path) -> list[dict]:
    """A soft dataset that reaches its budget, a strict one, and one that runs out of rows."""
    for name, n in (("A1", 300), ("B2", 300), ("C1", 25)):
        write_dataset(tmp_path / f"{name}.jsonl", n)
    common = {"id_field": "id", "sampling": {"max_tokens": 600}, "prior_mean_tokens": 100}
    return [{"name": "A1", "path": str(tmp_path / "A1.jsonl"), "budget": "6k", **common},
            {"name": "B2", "path": str(tmp_path / "B2.jsonl"), "budget": "5k", "mode": "strict", **common},
            {"name": "C1", "path": str(tmp_path / "C1.jsonl"), "budget": "1M", **common}]


def write_config(tmp_path: Path, redis_url: str, sim_url: str, datasets: list[dict], **extra) -> Path:
    cfg = {"redis_url": redis_url, "server": {"urls": [sim_url]}, "output_dir": str(tmp_path / "out"),
           "worker": {"concurrency": 16}, "producer": {"progress": "log", "progress_interval_s": 0.5},
           "datasets": datasets, **extra}
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@dataclass
class Run:
    producer: subprocess.CompletedProcess
    out: Path
    worker_logs: list[str] = field(default_factory=list)
    during: list = field(default_factory=list)


def run(cfg_path: Path, tmp_path: Path, workers: list[list[str]] | None = None, producer_args: list[str] = (),
        env: dict[str, str] | None = None, during=None, timeout_s: float = 120) -> Run:
    """Start workers (each a list of global CLI flags), run the producer to completion, stop the workers.

    ``during(proc)`` is called repeatedly while the producer runs; its results are kept in order.
    """
    env = dict(os.environ, **(env or {}))
    workers = workers if workers is not None else [["--log-level", "WARNING"]]
    procs, logs = [], []
    for i, flags in enumerate(workers):
        log = open(tmp_path / f"worker{i}.log", "w+")
        logs.append(log)
        procs.append(subprocess.Popen([*CLI, *flags, "worker", "-c", str(cfg_path)], cwd=ROOT, env=env,
                                      stdout=log, stderr=subprocess.STDOUT))
    seen = []
    try:
        prod = subprocess.Popen([*CLI, *producer_args, "produce", "-c", str(cfg_path)], cwd=ROOT, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        if during is not None:
            while prod.poll() is None:
                seen.append(during(prod))
        stdout, stderr = prod.communicate(timeout=timeout_s)
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(30)
    texts = []
    for log in logs:
        log.seek(0)
        texts.append(log.read())
        log.close()
    return Run(subprocess.CompletedProcess(prod.args, prod.returncode, stdout, stderr), tmp_path / "out",
               texts, seen)


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def http_get(url: str, auth: tuple[str, str] | None = None) -> tuple[int, str, str]:
    """(status, content type, body) of a GET, with optional HTTP basic auth; errors are answers too."""
    req = urllib.request.Request(url)
    if auth:
        req.add_header("Authorization", "Basic " + base64.b64encode(f"{auth[0]}:{auth[1]}".encode()).decode())
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, resp.headers.get("Content-Type", ""), resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers.get("Content-Type", ""), exc.read().decode()
