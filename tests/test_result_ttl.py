"""producer.result_ttl_s: 0 through the real producer, workers and simulator: finished jobs are
deleted as they finish (RQ's result_ttl=0), failed ones are kept, every row is on disk."""

from __future__ import annotations

import json

from rq.registry import FailedJobRegistry, FinishedJobRegistry
from rq.serializers import JSONSerializer

from budgetq.shared import jobs, keys
from budgetq.shared.identity import job_id
from tests.helpers import check_invariants, live_run, rows, write_config


def test_finished_jobs_are_deleted_and_failed_ones_kept(tmp_path, redis_url, conn, sim_factory):
    sim = sim_factory("--speedup", "200", "--seed", "5", "--length-mean", "40", "--context-length", "400")
    ids = [f"p{i}" for i in range(60)]
    long = {"p7", "p31"}  # longer than the server's context: SGLang answers 400, the job fails
    with open(tmp_path / "D.jsonl", "w") as fh:
        for pid in ids:
            fh.write(json.dumps({"id": pid, "prompt": ("word " * 600 if pid in long else f"question {pid}")}) + "\n")
    cfg = write_config(tmp_path, redis_url, sim, [{"name": "D", "path": str(tmp_path / "D.jsonl"), "budget": "1M",
                                                   "id_field": "id", "sampling": {"max_tokens": 200}}],
                       producer={"result_ttl_s": 0}, worker={"concurrency": 16})
    run = live_run(cfg, tmp_path, workers=[["--log-level", "WARNING"]], producer_args=["--log-level", "WARNING"],
                   timeout_s=240)
    assert run.producer.returncode == 0, run.producer.stderr
    states = check_invariants(conn, run.out, "D", ids)
    assert (states["committed"], states["failed"]) == (58, 2)
    assert {r["id"] for r in rows(run.out / "D.jsonl")} == set(ids) - long
    name = keys.queue_name("D")
    assert FinishedJobRegistry(name, connection=conn, serializer=JSONSerializer).get_job_ids(cleanup=False) == []
    for pid in set(ids) - long:  # committed: job hash and RQ result gone, as RQ's worker leaves them
        assert not conn.exists(keys.rq_job_key(job_id("D", pid)), keys.rq_results_key(job_id("D", pid)))
    failed = FailedJobRegistry(name, connection=conn, serializer=JSONSerializer).get_job_ids(cleanup=False)
    assert sorted(failed) == sorted(job_id("D", p) for p in long)
    for jid in failed:  # kept for retry-failed
        assert 0 < conn.ttl(keys.rq_job_key(jid)) <= jobs.KEEP_S
