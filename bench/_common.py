"""What every benchmark needs: machine facts, a private Redis, the simulator, budgetq processes, tables.

Benchmarks run as ``python bench/NAME.py``: this module puts the repository root first on
sys.path (so the checkout's code runs, not an installed copy) and starts every budgetq process
with ``cwd`` and ``PYTHONPATH`` set to it.
"""

from __future__ import annotations

import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import yaml  # noqa: E402

from budgetq.simulator.local import LocalRedis, LocalSim, stop_process  # noqa: E402

CLI = [sys.executable, "-m", "budgetq.cli"]
# The checkout first; a PYTHONPATH given by the caller stays behind it (e.g. to try an extra package).
ENV = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p),
           PYTHONUNBUFFERED="1")
EXIT_LINE = re.compile(r"exited after (\d+) jobs \((.*); peak (\d+) in flight; (\d+) redis round trips\)")


# --- machine facts and tables -----------------------------------------------------------------------

def _version(cmd: list[str]) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=10).stdout.strip()
    except OSError:
        return "?"


def machine_facts() -> dict[str, str]:
    """What a reader needs to judge the numbers: cores, load, versions."""
    import aiohttp
    import redis
    import rq

    cpu = "?"
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                   if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    server = _version([shutil.which("redis-server") or "redis-server", "--version"]).split()
    return {
        "nproc": str(os.cpu_count()), "cpu": cpu,
        "load average at start": " ".join(f"{x:.2f}" for x in os.getloadavg()),
        "python": platform.python_version(),
        "redis-server": next((w.split("=", 1)[1] for w in server if w.startswith("v=")), "?"),
        "redis-py": redis.__version__, "hiredis parser": "yes" if _has("hiredis") else "no",
        "rq": rq.__version__, "aiohttp": aiohttp.__version__,
    }


def _has(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def print_header(title: str, argv: Sequence[str]) -> None:
    print(f"# {title}")
    print(f"command: python {' '.join(argv)}")
    for k, v in machine_facts().items():
        print(f"- {k}: {v}")
    print(flush=True)


def md_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A Markdown table (docs/benchmarks.md takes it as printed; tests parse it back)."""
    cells = [[_cell(v) for v in r] for r in rows]
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in cells]
    return "\n".join(lines)


def _cell(v: object) -> str:
    if isinstance(v, float):
        if abs(v) >= 1000:
            return f"{v:,.0f}"
        return f"{v:.3f}" if abs(v) < 10 else f"{v:.1f}"
    if isinstance(v, int) and not isinstance(v, bool):
        return f"{v:,}"
    return str(v)


def parse_md_tables(text: str) -> list[list[dict[str, str]]]:
    """Every Markdown table in ``text``, as lists of {header: cell}."""
    tables: list[list[dict[str, str]]] = []
    block: list[str] = []
    for line in [*text.splitlines(), ""]:
        if line.startswith("|"):
            block.append(line)
            continue
        if len(block) >= 3:
            heads = [h.strip() for h in block[0].strip("|").split("|")]
            tables.append([dict(zip(heads, (c.strip() for c in r.strip("|").split("|")), strict=True))
                           for r in block[2:]])
        block = []
    return tables


def number(cell: str) -> float:
    """A table cell back to a number ("1,234" -> 1234.0)."""
    return float(cell.replace(",", "").rstrip("%x"))


# --- processes ----------------------------------------------------------------------------------------

def prometheus_lines(url: str) -> list[tuple[str, str]]:
    """(metric name without its labels, value text) of every sample a server's /metrics exposes."""
    with urllib.request.urlopen(url + "/metrics", timeout=30) as resp:
        text = resp.read().decode()
    return [(line.split("{", 1)[0].split(" ", 1)[0], line.rsplit(" ", 1)[1])
            for line in text.splitlines() if line and not line.startswith("#")]


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of ``pid`` so far (Linux /proc)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_ticks() -> tuple[int, int]:
    """(busy, total) jiffies of the whole machine so far (/proc/stat); busy excludes idle and iowait."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return sum(fields) - fields[3] - fields[4], sum(fields)


def busy_share(before: tuple[int, int], after: tuple[int, int]) -> float:
    """Share of all cores' time spent busy between two ``cpu_ticks()`` readings."""
    return (after[0] - before[0]) / max(1, after[1] - before[1])


class Sim(LocalSim):
    """A ``budgetq sim`` subprocess on a free port (the checkout's code), with the /sim/* helpers."""

    def __init__(self, *flags: str) -> None:
        super().__init__(*flags, cli=[*CLI, "--log-level", "WARNING"], env=ENV, cwd=ROOT)

    def get(self, path: str):
        with urllib.request.urlopen(self.url + path, timeout=60) as resp:
            return json.loads(resp.read())

    def stats(self) -> dict:
        return self.get("/sim/stats")

    def records(self) -> list[dict]:
        return self.get("/sim/requests")

    def reset(self) -> None:
        req = urllib.request.Request(self.url + "/sim/reset", data=b"{}", method="POST")
        urllib.request.urlopen(req, timeout=10).close()

    def wait_idle(self, timeout_s: float = 60) -> None:
        """Until nothing runs or waits (aborted requests leave at once; finished ones were answered)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            s = self.stats()
            if s["running"] == 0 and s["queued"] == 0:
                return
            time.sleep(0.05)
        raise RuntimeError(f"simulator still busy after {timeout_s:.0f} s")

    def close(self) -> None:
        self.stop()


@dataclass
class Stack:
    """A private Redis and a work dir; budgetq processes started from here log into the work dir."""

    redis: LocalRedis
    dir: Path

    @classmethod
    def start(cls) -> Stack:
        return cls(LocalRedis(), Path(tempfile.mkdtemp(prefix="budgetq-bench-")))

    @property
    def url(self) -> str:
        return self.redis.url

    def conn(self):
        import redis

        return redis.Redis.from_url(self.url)

    def flush(self) -> None:
        self.conn().flushall()  # our private server only

    def config(self, sim_url: str, datasets: list[dict], name: str = "cfg.yaml", server_model: str | None = None,
               **extra) -> Path:
        out = self.dir / "out"
        if out.exists():
            shutil.rmtree(out)
        server: dict = {"urls": [sim_url], **({"model": server_model} if server_model else {})}
        cfg = {"redis_url": self.url, "server": server, "output_dir": str(out), "datasets": datasets, **extra}
        path = self.dir / name
        path.write_text(yaml.safe_dump(cfg))
        return path

    def spawn(self, name: str, args: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
        """A process whose stdout and stderr go to <dir>/<name>.log (read back with ``log``)."""
        log = open(self.dir / f"{name}.log", "w")  # noqa: SIM115 - closed with the process's life
        p = subprocess.Popen(args, cwd=ROOT, env=env or ENV, stdout=log, stderr=subprocess.STDOUT)
        p.log_path = log.name  # type: ignore[attr-defined]
        return p

    def worker(self, cfg: Path, concurrency: int, name: str = "worker", *extra: str) -> subprocess.Popen:
        return self.spawn(name, [*CLI, "worker", "-c", str(cfg), "--concurrency", str(concurrency), *extra])

    def producer(self, cfg: Path, name: str = "producer") -> subprocess.Popen:
        return self.spawn(name, [*CLI, "produce", "-c", str(cfg)])

    def run(self, cfg: Path, name: str, workers: int, per_worker: int) -> list[subprocess.Popen]:
        """``workers`` worker processes and a producer on ``cfg`` until the producer exits 0 (every
        dataset complete); everything is stopped after. Returns the workers (their logs hold the
        exit lines)."""
        procs = [self.worker(cfg, per_worker, f"worker-{name}-{i}") for i in range(workers)]
        producer = self.producer(cfg, f"producer-{name}")
        try:
            rc = producer.wait(3600)
            if rc != 0:
                raise RuntimeError(f"producer exited with {rc}:\n{log_text(producer)[-3000:]}")
        finally:
            for p in (producer, *procs):
                stop_process(p)
        return procs

    def close(self) -> None:
        self.redis.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


def log_text(proc: subprocess.Popen) -> str:
    return Path(proc.log_path).read_text()  # type: ignore[attr-defined]


@dataclass(frozen=True)
class WorkerExit:
    processed: int
    outcomes: str
    peak_in_flight: int
    round_trips: int


def worker_exit(text: str) -> WorkerExit:
    """The numbers of a worker's last log line ("exited after N jobs (...; R redis round trips)")."""
    found = EXIT_LINE.findall(text)
    if not found:
        raise RuntimeError(f"no worker exit line in the log:\n{text[-2000:]}")
    n, outcomes, peak, trips = found[-1]
    return WorkerExit(int(n), outcomes, int(peak), int(trips))


def write_prompts(path: Path, n: int, chars: int = 120, start: int = 0) -> None:
    """``n`` JSONL rows {"id": "p<i>", "prompt": ...} of about ``chars`` characters each."""
    filler = ("Explain, step by step and with an example, how a token budget decides which prompts "
              "of a dataset get an answer from the language model. ") * (1 + chars // 100)
    with open(path, "w") as fh:
        for i in range(start, start + n):
            text = f"Question {i}: {filler}"[:chars]
            fh.write(f'{{"id": "p{i}", "prompt": "{text}"}}\n')


def dataset(name: str, path: Path, budget: int | str, mode: str = "soft", max_tokens: int = 8192,
            prior: int | None = None) -> dict:
    d = {"name": name, "path": str(path), "budget": budget, "mode": mode, "id_field": "id",
         "sampling": {"max_tokens": max_tokens}}
    if prior:
        d["prior_mean_tokens"] = prior
    return d


def redis_info(conn) -> dict:
    """Counters of the Redis server: commands and socket reads (~ round trips) so far."""
    info = conn.info("stats")
    return {"commands": int(info["total_commands_processed"]), "reads": int(info["total_reads_processed"])}


__all__ = ["ROOT", "CLI", "ENV", "LocalRedis", "Sim", "Stack"]
