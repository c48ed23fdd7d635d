"""Producer + 2 worker processes + simulator + private Redis, on 3 datasets, all real."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from rq import Queue
from rq.serializers import JSONSerializer

from budgetq.shared import keys
from tests.helpers import check_invariants, live_run, rows, sim_get, write_config, write_dataset


def _run(tmp_path: Path, redis_url: str, sim_url: str, datasets: list[dict], workers: int = 2,
         concurrency: int = 32):
    cfg = write_config(tmp_path, redis_url, sim_url, datasets, worker={"concurrency": concurrency})
    run = live_run(cfg, tmp_path, workers=[["--log-level", "WARNING"]] * workers,
                   producer_args=["--log-level", "WARNING"], timeout_s=240)
    assert run.worker_rcs == [0] * workers, run.worker_logs  # SIGTERM: a clean exit
    return run.producer, run.out


def test_three_datasets_reach_their_budgets_exactly_counted(tmp_path, redis_url, conn, sim_factory):
    means = {"A1": 150, "B2": 400, "C1": 250}
    sim = sim_factory("--speedup", "200", "--seed", "3", "--length-mean", "200",
                      *[f"--length-mean-for={k}-={v}" for k, v in means.items()])
    datasets, ids = [], {}
    for name in means:
        ids[name] = write_dataset(tmp_path / f"{name}.jsonl", 600)
        datasets.append({"name": name, "path": str(tmp_path / f"{name}.jsonl"), "budget": "20k",
                         "id_field": "id", "sampling": {"max_tokens": 2000}, "prior_mean_tokens": means[name],
                         "mode": "strict" if name == "C1" else "soft"})
    prod, out = _run(tmp_path, redis_url, sim, datasets)
    assert prod.returncode == 0, prod.stderr
    assert "budgetq summary" in prod.stdout
    requests = sim_get(sim, "/sim/requests")
    per_ds_requests = Counter(r["rid"].split("-")[0] for r in requests)
    for name in means:
        states = check_invariants(conn, out, name, ids[name])  # I1-I3: counted once, no id twice, one state each
        kept = rows(out / f"{name}.jsonl")
        used = int(conn.get(keys.used_key(name)))
        # soft: crossed by one result, the rest withdrawn; strict: never past the budget
        assert 20_000 <= used < 20_000 + 2000 if name != "C1" else 20_000 - 2000 <= used <= 20_000
        stats = {k.decode(): int(v) for k, v in conn.hgetall(keys.stats_key(name)).items()}
        # every request the server saw had been admitted and ended as a row, or was dropped
        # once the budget was crossed (aborted in flight, or its late result rejected):
        # skipped jobs never reach the server
        # (a rejected result is one of the aborts: each withdrawn admission is counted aborted once)
        assert per_ds_requests[name] == len(kept) + stats.get("aborted", 0)
        row = kept[0]
        assert row["conversations"][0] == {"role": "user", "content": f"question {row['id']}"}  # its own prompt
        assert row["conversations"][-1]["role"] == "assistant"
        assert set(row) >= {"id", "dataset", "prompt_tokens", "completion_tokens", "finish_reason", "model",
                            "endpoint", "latency_s"}
        assert stats["committed"] == len(kept) == states["committed"] and stats.get("skipped", 0) > 0
    # RQ's registries are truthful: jobs end up finished, none failed, none left started
    q = Queue(keys.queue_name("A1"), connection=conn, serializer=JSONSerializer)
    assert q.finished_job_registry.get_job_count(cleanup=False) > 0
    assert q.failed_job_registry.get_job_count(cleanup=False) == 0
    assert q.started_job_registry.get_job_count(cleanup=False) == 0


def test_bad_rows_are_reported_with_line_numbers_and_the_run_goes_on(tmp_path, redis_url, conn, sim_factory):
    sim = sim_factory("--speedup", "500", "--length-mean", "50")
    bad = {3: "{not json", 6: json.dumps({"id": "x1"}), 9: json.dumps({"id": "x2", "prompt": "  "}),
           12: "[1, 2]"}
    path = tmp_path / "D.jsonl"
    ids = write_dataset(path, 30, bad_lines=bad)
    prod, out = _run(tmp_path, redis_url, sim, [{"name": "D", "path": str(path), "budget": "1M",
                                                 "id_field": "id", "sampling": {"max_tokens": 500}}], workers=1)
    assert prod.returncode == 0, prod.stderr
    for line in (3, 6, 9, 12):
        assert f"{path}:{line}: invalid row" in prod.stderr
    assert "missing field 'prompt'" in prod.stderr and "is empty" in prod.stderr
    invalid = rows(out / "D.invalid.jsonl")
    assert [r["line"] for r in invalid] == [3, 6, 9, 12]
    assert check_invariants(conn, out, "D", ids)["committed"] == 30  # every valid row was generated


def test_restarted_producer_generates_nothing_twice(tmp_path, redis_url, conn, sim_factory):
    sim = sim_factory("--speedup", "500", "--length-mean", "50")
    path = tmp_path / "D.jsonl"
    write_dataset(path, 40)
    ds = [{"name": "D", "path": str(path), "budget": "1M", "id_field": "id", "sampling": {"max_tokens": 500}}]
    assert _run(tmp_path, redis_url, sim, ds, workers=1)[0].returncode == 0
    ids = write_dataset(path, 60)  # the file grew: only the 20 new prompts run
    prod, out = _run(tmp_path, redis_url, sim, ds, workers=1)
    assert prod.returncode == 0, prod.stderr
    assert sorted(r["id"] for r in rows(out / "D.jsonl")) == sorted(ids)
    assert len(sim_get(sim, "/sim/requests")) == 60  # 40 + 20: nothing generated twice
    assert check_invariants(conn, out, "D", ids)["committed"] == 60
