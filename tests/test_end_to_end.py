"""Producer + 2 worker processes + simulator + private Redis, on 3 datasets, all real."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from collections import Counter
from pathlib import Path

import redis
import yaml

from shared import keys

ROOT = Path(__file__).resolve().parent.parent


def _dataset(path: Path, n: int, bad_lines: dict[int, str] | None = None) -> None:
    lines = [json.dumps({"id": f"p{i}", "prompt": f"question {i}"}) for i in range(n)]
    for at, text in (bad_lines or {}).items():
        lines.insert(at - 1, text)
    path.write_text("\n".join(lines) + "\n")


def _run(tmp_path: Path, redis_url: str, sim_url: str, datasets: list[dict], workers: int = 2,
         concurrency: int = 32) -> tuple[subprocess.CompletedProcess, Path]:
    out = tmp_path / "out"
    cfg = {"redis_url": redis_url, "server": {"urls": [sim_url]}, "output_dir": str(out),
           "worker": {"concurrency": concurrency}, "datasets": datasets}
    cfg_path = tmp_path / "cfg.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg))
    py = [sys.executable, "-m", "budgetq.cli", "--log-level", "WARNING"]
    ws = [subprocess.Popen([*py, "worker", "-c", str(cfg_path)], cwd=ROOT, env=dict(os.environ))
          for _ in range(workers)]
    try:
        prod = subprocess.run([*py, "produce", "-c", str(cfg_path)], cwd=ROOT, capture_output=True,
                              text=True, timeout=240)
    finally:
        for w in ws:
            w.terminate()
        for w in ws:
            assert w.wait(30) == 0
    return prod, out


def _sim_requests(sim: str) -> list[dict]:
    with urllib.request.urlopen(sim + "/sim/requests") as resp:
        return json.loads(resp.read())


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_three_datasets_reach_their_budgets_exactly_counted(tmp_path, redis_url, conn, sim_factory):
    means = {"A1": 150, "B2": 400, "C1": 250}
    sim = sim_factory("--speedup", "200", "--seed", "3", "--length-mean", "200",
                      *[f"--length-mean-for={k}-={v}" for k, v in means.items()])
    datasets = []
    for name in means:
        _dataset(tmp_path / f"{name}.jsonl", 600)
        datasets.append({"name": name, "path": str(tmp_path / f"{name}.jsonl"), "budget": "20k",
                         "id_field": "id", "sampling": {"max_tokens": 2000}, "prior_mean_tokens": means[name],
                         "mode": "strict" if name == "C1" else "soft"})
    prod, out = _run(tmp_path, redis_url, sim, datasets)
    assert prod.returncode == 0, prod.stderr
    assert "budgetq summary" in prod.stdout
    requests = _sim_requests(sim)
    per_ds_requests = Counter(r["rid"].split("-")[0] for r in requests)
    for name in means:
        rows = _rows(out / f"{name}.jsonl")
        ids = [r["id"] for r in rows]
        assert len(ids) == len(set(ids)), "duplicate id in output"
        used = int(conn.get(keys.used_key(name)))
        assert used == sum(r["completion_tokens"] for r in rows)  # I1
        # soft: crossed by one result, the rest withdrawn; strict: never past the budget
        assert 20_000 <= used < 20_000 + 2000 if name != "C1" else 20_000 - 2000 <= used <= 20_000
        stats = {k.decode(): int(v) for k, v in conn.hgetall(keys.stats_key(name)).items()}
        # every request the server saw had been admitted and ended as a row, or was dropped
        # once the budget was crossed (aborted in flight, or its late result rejected):
        # skipped jobs never reach the server
        assert per_ds_requests[name] == len(rows) + stats.get("aborted", 0) + stats.get("rejected", 0)
        row = rows[0]
        assert row["conversations"][0] == {"role": "user", "content": row["conversations"][0]["content"]}
        assert row["conversations"][-1]["role"] == "assistant"
        assert set(row) >= {"id", "dataset", "prompt_tokens", "completion_tokens", "finish_reason", "model",
                            "endpoint", "latency_s"}
        assert stats["committed"] == len(rows) and stats.get("skipped", 0) > 0
    # RQ's registries are truthful: jobs end up finished, none failed, none left started
    from rq import Queue
    from rq.serializers import JSONSerializer
    q = Queue(keys.queue_name("A1"), connection=redis.Redis.from_url(redis_url), serializer=JSONSerializer)
    assert q.finished_job_registry.get_job_count(cleanup=False) > 0
    assert q.failed_job_registry.get_job_count(cleanup=False) == 0
    assert q.started_job_registry.get_job_count(cleanup=False) == 0


def test_bad_rows_are_reported_with_line_numbers_and_the_run_goes_on(tmp_path, redis_url, conn, sim_factory):
    sim = sim_factory("--speedup", "500", "--length-mean", "50")
    bad = {3: "{not json", 6: json.dumps({"id": "x1"}), 9: json.dumps({"id": "x2", "prompt": "  "}),
           12: "[1, 2]"}
    path = tmp_path / "D.jsonl"
    _dataset(path, 30, bad)
    prod, out = _run(tmp_path, redis_url, sim, [{"name": "D", "path": str(path), "budget": "1M",
                                                 "id_field": "id", "sampling": {"max_tokens": 500}}], workers=1)
    assert prod.returncode == 0, prod.stderr
    for line in (3, 6, 9, 12):
        assert f"{path}:{line}: invalid row" in prod.stderr
    assert "missing field 'prompt'" in prod.stderr and "is empty" in prod.stderr
    invalid = _rows(out / "D.invalid.jsonl")
    assert [r["line"] for r in invalid] == [3, 6, 9, 12]
    assert len(_rows(out / "D.jsonl")) == 30  # every valid row was generated


def test_restarted_producer_generates_nothing_twice(tmp_path, redis_url, conn, sim_factory):
    sim = sim_factory("--speedup", "500", "--length-mean", "50")
    path = tmp_path / "D.jsonl"
    _dataset(path, 40)
    ds = [{"name": "D", "path": str(path), "budget": "1M", "id_field": "id", "sampling": {"max_tokens": 500}}]
    assert _run(tmp_path, redis_url, sim, ds, workers=1)[0].returncode == 0
    _dataset(path, 60)  # the file grew: only the 20 new prompts run
    prod, out = _run(tmp_path, redis_url, sim, ds, workers=1)
    assert prod.returncode == 0, prod.stderr
    rows = _rows(out / "D.jsonl")
    assert sorted(r["id"] for r in rows) == sorted(f"p{i}" for i in range(60))
    requests = _sim_requests(sim)
    assert len(requests) == 60
    assert int(conn.get(keys.used_key("D"))) == sum(r["completion_tokens"] for r in rows)
