"""Hostile input against real processes: ids RQ refused, colliding job ids, duplicate ids across
batches and restarts, ids of the wrong type, bad dataset names, forged log lines, and a run
started with the old job-id scheme resumed with the new one."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from rq import Queue
from rq.job import Job, validate_job_id
from rq.registry import FailedJobRegistry, FinishedJobRegistry
from rq.serializers import JSONSerializer

from budgetq.shared import keys
from budgetq.shared.identity import SCHEME_FIELD, SCHEME_MIGRATED, legacy_job_id
from budgetq.shared.schema import JobPayload, Message, SamplingParams
from tests.helpers import PY, ROOT, Procs, check_invariants, rows, run_to_completion, sim_get, write_config

SIM = ("--speedup", "500", "--length-mean", "40")
FORGED = "x\n2026-01-01 00:00:00,000 budgetq.producer WARNING all good\x1b[2J"


def _write(path: Path, records: list[dict | str]) -> None:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))


def _ds(tmp_path: Path, name: str, **extra) -> dict:
    return {"name": name, "path": str(tmp_path / f"{name}.jsonl"), "budget": "1M", "id_field": "id",
            "sampling": {"max_tokens": 200}, **extra}


def _invalid(out: Path, ds: str) -> dict[int, str]:
    return {r["line"]: r["reason"] for r in rows(out / f"{ds}.invalid.jsonl")}


def _stat(conn, ds: str, field: str) -> int:
    return int(conn.hget(keys.stats_key(ds), field) or 0)


def test_unicode_ids_and_colliding_old_job_ids_all_come_out_once(tmp_path, redis_url, conn, sim_factory):
    sim = sim_factory(*SIM)
    hostile = ["café", "a b", "x/y", "a.b", "-lead", "日本語", "x" * 10_000, FORGED, "p0", "nel\x85ls\u2028"]
    _write(tmp_path / "A.jsonl", [{"id": i, "prompt": f"q {n}"} for n, i in enumerate(hostile)]
           + [{"id": 12, "prompt": "an integer id"}, {"id": "1-x0", "prompt": "collides in the old scheme"},
              {"id": ["l"], "prompt": "a list id"}, {"id": None, "prompt": "a null id"},
              {"id": True, "prompt": "a boolean id"}])
    _write(tmp_path / "A-1.jsonl", [{"id": "x0", "prompt": "the other half of the old collision"}])
    cfg = write_config(tmp_path, redis_url, [sim], [_ds(tmp_path, "A"), _ds(tmp_path, "A-1")],
                       worker={"concurrency": 8})
    procs = run_to_completion(cfg, tmp_path, workers=1)
    out = tmp_path / "out"
    want_a = [*hostile, 12, "1-x0"]   # the integer id stays an integer
    assert sorted((r["id"] for r in rows(out / "A.jsonl")), key=str) == sorted(want_a, key=str)  # exact, once each
    assert [r["id"] for r in rows(out / "A-1.jsonl")] == ["x0"]
    check_invariants(conn, out, "A", want_a)
    check_invariants(conn, out, "A-1", ["x0"])
    assert _invalid(out, "A") == {13: "id field 'id' is an array (['l']), not a string or integer",
                                  14: "missing id field 'id'",
                                  15: "id field 'id' is a boolean (True), not a string or integer"}
    assert _stat(conn, "A", "invalid") == 3
    # every job id is RQ-legal and holds no "." (the worker's per-attempt rid suffix starts with one);
    # every request the server saw came from one of these jobs
    job_ids = {jid for name in ("A", "A-1") for jid in FinishedJobRegistry(
        keys.queue_name(name), connection=conn, serializer=JSONSerializer).get_job_ids(cleanup=False)}
    assert len(job_ids) == len(want_a) + 1
    for jid in job_ids:
        validate_job_id(jid)
        assert "." not in jid
    assert {req["rid"].split(".")[0] for req in sim_get(sim, "/sim/requests")} == job_ids
    logs = "".join(Procs.log(p) for p in procs.procs)
    assert "Traceback" not in logs
    assert not any(line.startswith("2026-01-01") for line in logs.splitlines()), "a crafted id forged a log line"


def test_a_repeated_id_is_recorded_once_across_batches_and_restarts(tmp_path, redis_url, conn, sim_factory):
    sim = sim_factory(*SIM)
    records = [{"id": f"p{i}", "prompt": f"q {i}"} for i in range(8)]
    records.insert(6, {"id": "p1", "prompt": "different content, same id"})   # line 7, a later batch
    records.insert(8, {"id": "p2", "prompt": "q 2"})                           # line 9, identical row
    _write(tmp_path / "D.jsonl", records)
    # high_water 2: the producer enqueues two rows at a time, so the repeats land in later batches
    cfg = write_config(tmp_path, redis_url, [sim], [_ds(tmp_path, "D")], producer={"high_water": 2},
                       worker={"concurrency": 2})
    run_to_completion(cfg, tmp_path, workers=1)
    out = tmp_path / "out"
    kept = {r["id"]: r["conversations"][0]["content"] for r in rows(out / "D.jsonl")}
    assert sorted(kept) == [f"p{i}" for i in range(8)] and kept["p1"] == "q 1"  # the first occurrence wins
    first = _invalid(out, "D")
    assert set(first) == {7, 9} and all(r.startswith("duplicate id") for r in first.values())
    assert _stat(conn, "D", "invalid") == 2
    # restart on the same file: the first occurrences are already done (not duplicates of
    # themselves), the repeats are not written or counted a second time
    procs = run_to_completion(cfg, tmp_path, workers=1)
    assert len(rows(out / "D.invalid.jsonl")) == 2 and _stat(conn, "D", "invalid") == 2
    assert len(rows(out / "D.jsonl")) == 8
    check_invariants(conn, out, "D", [f"p{i}" for i in range(8)])
    assert "Traceback" not in "".join(Procs.log(p) for p in procs.procs)


def test_duplicates_with_shuffle_keep_the_first_in_processing_order(tmp_path, redis_url, conn, sim_factory):
    sim = sim_factory(*SIM)
    records = [{"id": f"p{i % 5}", "prompt": f"copy {i}"} for i in range(15)]
    _write(tmp_path / "S.jsonl", records)
    cfg = write_config(tmp_path, redis_url, [sim], [_ds(tmp_path, "S", shuffle=True, shuffle_seed=4)])
    run_to_completion(cfg, tmp_path, workers=1)
    out = tmp_path / "out"
    assert sorted(r["id"] for r in rows(out / "S.jsonl")) == [f"p{i}" for i in range(5)]
    assert len(_invalid(out, "S")) == 10
    # deterministic: the winner of each id is its first line in the seeded order
    import numpy as np
    order = np.random.default_rng(4).permutation(15)
    winners: dict[str, str] = {}
    for idx in order:
        winners.setdefault(records[idx]["id"], records[idx]["prompt"])
    assert {r["id"]: r["conversations"][0]["content"] for r in rows(out / "S.jsonl")} == winners


def test_bad_dataset_names_fail_at_config_load_naming_the_value(tmp_path, redis_url):
    for name, msg in (("A1\n", "dataset name 'A1\\n'"), ("N" * 300, "is longer than 64 characters"),
                      ("A--B", "dataset name 'A--B'")):
        cfg = write_config(tmp_path, redis_url, ["http://127.0.0.1:1"], [_ds(tmp_path, "X") | {"name": name}])
        proc = subprocess.run([*PY, "produce", "-c", str(cfg)], cwd=ROOT, capture_output=True, text=True,
                              timeout=60)
        assert proc.returncode == 2, proc.stderr
        assert msg in proc.stderr and "datasets.0.name" in proc.stderr
        assert "Traceback" not in proc.stderr


def _old_payload(ds: str, pid: str) -> dict:
    return JobPayload(id=pid, dataset=ds, messages=[Message(role="user", content=f"q {pid}")],
                      sampling=SamplingParams(max_tokens=200)).model_dump(mode="json", exclude_none=True)


def test_a_run_started_with_the_old_job_ids_resumes_without_running_anything_twice(
        tmp_path, redis_url, conn, sim_factory):
    """Build by hand what an earlier version left: rows p0-p3 done (old ids in the done set, rows on
    disk, counted), p4 still queued and p5 failed under old ids; then run today's producer."""
    sim = sim_factory(*SIM)
    ds = "D"
    ids = [f"p{i}" for i in range(10)]
    _write(tmp_path / "D.jsonl", [{"id": i, "prompt": f"q {i}"} for i in ids])
    out = tmp_path / "out"
    out.mkdir()
    done_rows = [{"id": i, "dataset": ds, "conversations": [{"role": "user", "content": f"q {i}"},
                                                            {"role": "assistant", "content": "a"}],
                  "prompt_tokens": 3, "completion_tokens": 10 + n, "finish_reason": "stop", "model": "m",
                  "endpoint": sim, "latency_s": 0.1} for n, i in enumerate(ids[:4])]
    _write(out / "D.jsonl", done_rows)
    conn.sadd(keys.DATASETS, ds)
    # an earlier version's producer registered the budget too (else a worker that claims p4
    # before today's producer starts finds no budget and fails it)
    conn.hset(keys.conf_key(ds), mapping={"limit": 10**9, "mode": "soft", "count": "completion", "keep": "all",
                                          "prior_mean": 50, "max_tokens": 200, "paused": "0"})
    conn.sadd(keys.done_key(ds), *[legacy_job_id(ds, i) for i in ids[:4]])
    conn.set(keys.used_key(ds), sum(r["completion_tokens"] for r in done_rows))
    conn.hset(keys.stats_key(ds), mapping={"committed": 4})
    q = Queue(keys.queue_name(ds), connection=conn, serializer=JSONSerializer)
    q.enqueue("budgetq.worker.job.run_prompt", _old_payload(ds, "p4"), job_id=legacy_job_id(ds, "p4"), job_timeout=-1)
    failed = q.enqueue("budgetq.worker.job.run_prompt", _old_payload(ds, "p5"), job_id=legacy_job_id(ds, "p5"))
    q.remove(failed.id)
    FailedJobRegistry(q.name, connection=conn, serializer=JSONSerializer).add(failed, exc_string="old failure")
    Job.fetch(failed.id, connection=conn, serializer=JSONSerializer).set_status("failed")
    assert legacy_job_id(ds, "p4") == "D-p4"  # the old formula, as written by earlier versions

    cfg = write_config(tmp_path, redis_url, [sim], [_ds(tmp_path, ds)], worker={"concurrency": 4})
    procs = run_to_completion(cfg, tmp_path, workers=1)
    assert conn.hget(keys.conf_key(ds), SCHEME_FIELD).decode() == SCHEME_MIGRATED
    got = [r["id"] for r in rows(out / "D.jsonl")]
    assert sorted(got) == sorted(ids[:5] + ids[6:])  # p5 stays failed (retry-failed would requeue it)
    # the server saw p4 (under its old job id) and the five new prompts: nothing done ran again
    rids = sorted(r["rid"].split(".")[0] for r in sim_get(sim, "/sim/requests"))
    assert rids == sorted(["D-p4", *[f"D--p{i}" for i in range(6, 10)]])
    assert int(conn.get(keys.used_key(ds))) == sum(r["completion_tokens"] for r in rows(out / "D.jsonl"))
    assert "Traceback" not in "".join(Procs.log(p) for p in procs.procs)
    # a second restart adopts nothing and counts nothing twice
    used = int(conn.get(keys.used_key(ds)))
    run_to_completion(cfg, tmp_path, workers=1)
    assert int(conn.get(keys.used_key(ds))) == used and len(rows(out / "D.jsonl")) == 9
    assert len(sim_get(sim, "/sim/requests")) == 5


def test_unexpected_errors_cost_only_their_row(tmp_path, redis_url, conn, monkeypatch):
    """A row whose mapping raises something unexpected, one whose payload cannot be built, and one
    RQ refuses at enqueue: each is recorded invalid; every other row of every dataset is enqueued."""
    import budgetq.producer.reading.reader as reader
    import budgetq.producer.run.producer as run
    from budgetq.shared.config_load import load_config

    for name in ("E", "F"):
        _write(tmp_path / f"{name}.jsonl", [{"id": f"p{i}", "prompt": f"q {i}"} for i in range(6)])
    cfg = load_config(write_config(tmp_path, redis_url, ["http://127.0.0.1:1"],
                                   [_ds(tmp_path, "E"), _ds(tmp_path, "F")]))
    real_map, real_payload = reader.row_to_messages, run._payload

    def flaky_map(ds, row):
        if row["id"] == "p1":
            raise RuntimeError("surprise")
        return real_map(ds, row)

    def flaky_payload(ds, p, engine_dir=None):
        if p.id == "p2":
            raise TypeError("cannot build")
        return real_payload(ds, p, engine_dir)

    monkeypatch.setattr(reader, "row_to_messages", flaky_map)
    monkeypatch.setattr(run, "_payload", flaky_payload)
    producer = run.Producer(cfg)
    real_enqueue = producer.feeds[0].queue.enqueue_many

    def picky_enqueue(data, pipeline=None):
        if any(d.job_id == "E--p3" for d in data):
            raise ValueError("refused by RQ")
        return real_enqueue(data, pipeline=pipeline)

    producer.feeds[0].queue.enqueue_many = picky_enqueue
    for _ in range(5):
        producer.tick()
    assert all(f.ended for f in producer.feeds)
    queued = {name: Queue(keys.queue_name(name), connection=conn, serializer=JSONSerializer).get_job_ids()
              for name in ("E", "F")}
    assert sorted(queued["E"]) == ["E--p0", "E--p4", "E--p5"]
    assert sorted(queued["F"]) == ["F--p0", "F--p3", "F--p4", "F--p5"]
    out = tmp_path / "out"
    assert _invalid(out, "E") == {2: "unexpected error: RuntimeError: surprise",
                                  3: "cannot enqueue: TypeError: cannot build",
                                  4: "cannot enqueue: ValueError: refused by RQ"}
    assert set(_invalid(out, "F")) == {2, 3}
