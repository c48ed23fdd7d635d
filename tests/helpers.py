"""The one helper module of the integration tests: datasets, configs, budgetq processes, HTTP, and
the invariants I1-I3 of docs/architecture.md (``check_invariants``). Import it as ``tests.helpers``.

Fixtures (private Redis, simulators) are in conftest.py; ``LocalSim``/``LocalRedis`` in simulator/local.py.
"""

from __future__ import annotations

import base64
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import redis
import yaml
from rq.registry import CanceledJobRegistry, FailedJobRegistry
from rq.serializers import JSONSerializer

from budgetq.shared import keys, presence
from budgetq.shared.identity import job_id
from budgetq.simulator.local import free_port

ROOT = Path(__file__).resolve().parent.parent
CLI = [sys.executable, "-m", "budgetq.cli"]
PY = [*CLI, "--log-level", "WARNING"]
# What the ops tests (status, monitor, secrets) add to a config: progress as log lines they can read.
LIVE = {"worker": {"concurrency": 16}, "producer": {"progress": "log", "progress_interval_s": 0.5}}


def write_dataset(path: Path, n: int, start: int = 0, bad_lines: dict[int, str] | None = None) -> list[str]:
    """n prompt rows with ids p<i>; returns the ids."""
    ids = [f"p{i}" for i in range(start, start + n)]
    lines = [json.dumps({"id": i, "prompt": f"question {i}"}) for i in ids]
    for at, text in (bad_lines or {}).items():
        lines.insert(at - 1, text)
    path.write_text("\n".join(lines) + "\n")
    return ids


def three_datasets(tmp_path: Path) -> list[dict]:
    """A soft dataset that reaches its budget, a strict one, and one that runs out of rows."""
    for name, n in (("A1", 300), ("B2", 300), ("C1", 25)):
        write_dataset(tmp_path / f"{name}.jsonl", n)
    common = {"id_field": "id", "sampling": {"max_tokens": 600}, "prior_mean_tokens": 100}
    return [{"name": "A1", "path": str(tmp_path / "A1.jsonl"), "budget": "6k", **common},
            {"name": "B2", "path": str(tmp_path / "B2.jsonl"), "budget": "5k", "mode": "strict", **common},
            {"name": "C1", "path": str(tmp_path / "C1.jsonl"), "budget": "1M", **common}]


def write_config(tmp_path: Path, redis_url: str, sims: str | list[str], datasets: list[dict], **extra) -> Path:
    """``tmp_path/cfg.yaml``; ``sims`` is one simulator URL or several; ``extra`` adds top-level sections."""
    sims = [sims] if isinstance(sims, str) else sims
    # The run report takes seconds to draw at each produce's end: only the tests that read it ask for it.
    extra["producer"] = {"report": False, **extra.get("producer", {})}
    cfg = {"redis_url": redis_url, "server": {"urls": sims, **extra.pop("server", {})},
           "output_dir": str(tmp_path / "out"), "datasets": datasets, **extra}
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


class Procs:
    """budgetq worker/producer subprocesses of one test, all stopped at the end."""

    def __init__(self, cfg: Path, log_dir: Path) -> None:
        self.cfg = cfg
        self.log_dir = log_dir
        self.procs: list[subprocess.Popen] = []
        self._n = 0

    def start(self, *args: str, on: Sequence[str] = ()) -> subprocess.Popen:
        """``budgetq ARGS -c cfg``; ``on``: a command prefix that runs it elsewhere (a host of tests/netns.py)."""
        self._n += 1
        with open(self.log_dir / f"{args[0]}-{self._n}.log", "w") as log:  # the child keeps its own copy
            p = subprocess.Popen([*on, *PY, *args, "-c", str(self.cfg)], cwd=ROOT, env=dict(os.environ),
                                 stdout=log, stderr=subprocess.STDOUT)
        p.log_path = log.name  # type: ignore[attr-defined]
        self.procs.append(p)
        return p

    def worker(self, *extra: str, on: Sequence[str] = ()) -> subprocess.Popen:
        return self.start("worker", *extra, on=on)

    def producer(self, on: Sequence[str] = ()) -> subprocess.Popen:
        return self.start("produce", on=on)

    def stop_all(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGINT)
        deadline = time.monotonic() + 40
        for p in self.procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    @staticmethod
    def log(p: subprocess.Popen) -> str:
        return Path(p.log_path).read_text()  # type: ignore[attr-defined]


def cli_out(cfg: Path, *args: str) -> str:
    """What ``budgetq ARGS -c cfg`` printed on stdout; it must exit 0."""
    out = subprocess.run([*PY, *args, "-c", str(cfg)], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout


def producer_running(conn: redis.Redis) -> None:
    """A running producer's presence key (shared/presence.py): the datasets a test seeds read as a
    producer's, not as stopped before their end (``interrupted``, with no ETA)."""
    presence.Presence(conn).beat()


def dataset_status(cfg: Path, ds: str) -> dict:
    """``ds``'s entry of ``budgetq status --json``."""
    return next(d for d in json.loads(cli_out(cfg, "status", "--json"))["datasets"] if d["dataset"] == ds)


def wait_for(cond, timeout_s: float, what: str, every_s: float = 0.1):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(every_s)
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")


def sim_get(sim: str, path: str):
    with urllib.request.urlopen(sim + path, timeout=10) as resp:
        return json.loads(resp.read())


def http_get(url: str, auth: tuple[str, str] | None = None, timeout_s: float = 10) -> tuple[int, str, str]:
    """(status, content type, body) of a GET, with optional HTTP basic auth; errors are answers too."""
    req = urllib.request.Request(url)
    if auth:
        req.add_header("Authorization", "Basic " + base64.b64encode(f"{auth[0]}:{auth[1]}".encode()).decode())
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            return resp.status, resp.headers.get("Content-Type", ""), resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers.get("Content-Type", ""), exc.read().decode()


def rows(path: Path) -> list[dict]:
    """The JSON lines of ``path``: split on "\n" only (splitlines() also splits inside a row whose
    text holds U+0085 or U+2028, which JSON writes raw)."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").split("\n") if line.strip()]


def check_invariants(conn: redis.Redis, out: Path, ds: str, valid_ids: list[str], count: str = "completion") -> dict:
    """I1 (used == sum of counted tokens on disk), I2 (no id twice), I3 (every valid row in one state)."""
    kept = rows(out / f"{ds}.jsonl")
    truncated = rows(out / f"{ds}.truncated.jsonl")
    ids = [r["id"] for r in kept + truncated]
    assert len(ids) == len(set(ids)), f"{ds}: an id appears twice in the output"
    counted = sum(r["completion_tokens"] + (r["prompt_tokens"] if count == "total" else 0) for r in kept)
    used = int(conn.get(keys.used_key(ds)) or 0)
    assert used == counted, f"{ds}: used {used} != {counted} counted on disk"
    name = keys.queue_name(ds)
    skipped = set(CanceledJobRegistry(name, connection=conn, serializer=JSONSerializer).get_job_ids(cleanup=False))
    failed = set(FailedJobRegistry(name, connection=conn, serializer=JSONSerializer).get_job_ids(cleanup=False))
    states = {"committed": 0, "skipped": 0, "failed": 0, "never_enqueued": 0}
    on_disk = set(ids)
    for pid in valid_ids:
        jid = job_id(ds, pid)
        where = [s for s, hit in (("committed", pid in on_disk), ("skipped", jid in skipped),
                                  ("failed", jid in failed)) if hit]
        if not where:
            status = conn.hget(keys.rq_job_key(jid), "status")
            assert status is None, f"{ds}: {pid} is neither committed, skipped nor failed (RQ status {status})"
            where = ["never_enqueued"]
        assert len(where) == 1, f"{ds}: {pid} is in several states: {where}"
        states[where[0]] += 1
    assert conn.llen(keys.rq_queue_key(ds)) == 0 and conn.zcard(keys.rq_wip_key(ds)) == 0
    assert conn.hlen(keys.resv_key(ds)) == 0 and int(conn.get(keys.reserved_key(ds)) or 0) == 0
    return {"used": used, "rows": len(kept), **states}


def holders(conn: redis.Redis, ds: str, pid: int) -> set[str]:
    """Job ids a worker process (by pid) holds in the started registry right now."""
    held = set()
    for m in conn.zrange(keys.rq_wip_key(ds), 0, -1):
        job_id = m.decode().rsplit(":", 1)[0]
        name = conn.hget(keys.rq_job_key(job_id), "worker_name") or b""
        if f"-{pid}-" in name.decode():
            held.add(job_id)
    return held


def run_to_completion(cfg: Path, log_dir: Path, workers: int = 1, timeout_s: float = 120) -> Procs:
    """Workers and a producer on ``cfg`` until the producer exits 0; everything stopped after."""
    procs = Procs(cfg, log_dir)
    for _ in range(workers):
        procs.worker()
    try:
        producer = procs.producer()
        assert producer.wait(timeout_s) == 0, Procs.log(producer)
    finally:
        procs.stop_all()
    return procs


@dataclass
class Run:
    producer: subprocess.CompletedProcess
    out: Path
    worker_logs: list[str] = field(default_factory=list)
    during: list = field(default_factory=list)
    worker_rcs: list[int] = field(default_factory=list)


def live_run(cfg_path: Path, tmp_path: Path, workers: list[list[str]] | None = None, producer_args: Sequence[str] = (),
             env: dict[str, str] | None = None, during=None, timeout_s: float = 120) -> Run:
    """Start workers (each a list of global CLI flags), run the producer to completion (its output
    captured), stop the workers (SIGTERM) and keep their logs and exit codes.

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
        try:
            stdout, stderr = prod.communicate(timeout=timeout_s)
        except BaseException:
            prod.kill()  # a run that timed out must not leave its producer polling after the test
            prod.communicate()
            raise
    finally:
        for p in procs:
            p.terminate()
        # the documented bound: SIGTERM stops a worker within worker.grace_s (30 s) + 10 s
        rcs = [p.wait(45) for p in procs]
    texts = []
    for log in logs:
        log.seek(0)
        texts.append(log.read())
        log.close()
    return Run(subprocess.CompletedProcess(prod.args, prod.returncode, stdout, stderr), tmp_path / "out",
               texts, seen, rcs)


def stock_rq_worker(redis_url: str, queue: str, config: Path, log: Path, *extra: str, timeout_s: float = 180) -> str:
    """A stock ``rq worker --burst`` (JSON serializer) on ``queue``, BUDGETQ_CONFIG=config; returns what it logged.

    Once it has logged RQ's "done, quitting" it gets 5 s to exit, then is stopped: RQ's burst worker
    can linger up to a minute after its last job (its pubsub thread waits 60 s in a read that the
    unsubscribe does not always wake: rq/rq#1613, #2172), which is RQ's and not what these tests are
    about; everything the jobs did is in Redis by then. An exit of its own must be 0."""
    cmd = [str(Path(sys.executable).parent / "rq"), "worker", "--burst", "-u", redis_url, "--serializer",
           "rq.serializers.JSONSerializer", *extra, queue]
    with open(log, "wb") as out:  # a file, not a pipe: what it printed is there whatever happens
        proc = subprocess.Popen(cmd, cwd=ROOT, env=dict(os.environ, BUDGETQ_CONFIG=str(config)), stdout=out,
                                stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: proc.poll() is not None or b"done, quitting" in log.read_bytes(), timeout_s,
                 "the rq worker to finish its jobs")
        try:
            assert proc.wait(5) == 0, log.read_text()[-4000:]
        except subprocess.TimeoutExpired:
            proc.kill()  # not SIGTERM: RQ takes that for a stop request in the middle of its teardown
            proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = log.read_text()
    assert "Traceback" not in text and "done, quitting" in text, text[-4000:]
    return text


async def serve_routes(routes: list, body) -> None:
    """An aiohttp app with ``routes`` on a free loopback port while ``await body(base_url)`` runs (a fake server)."""
    from aiohttp import web

    app = web.Application()
    app.add_routes(routes)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        await body(f"http://127.0.0.1:{port}")
    finally:
        await runner.cleanup()


def prometheus_samples(text: str) -> dict[tuple[str, tuple], float]:
    """Every sample of a Prometheus exposition, parsed by prometheus-client's own parser:
    (name, sorted label items) -> value."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out
