"""A dataset whose ``gates.validator`` cannot be imported, on the real pipeline: ``produce`` says so at
start, and a worker fails each job *before* sending it (an answer no validator can judge would be
generated for nothing: GPU time spent, the answer lost), in one line logged once."""

from __future__ import annotations

from rq.job import Job
from rq.serializers import JSONSerializer

from budgetq.shared import keys
from budgetq.shared.identity import job_id
from budgetq.shared.ledger import read_ledger
from tests.helpers import live_run, sim_get, write_config, write_dataset

SPEC = "nosuch_checks_39:no_refusals"


def test_an_unimportable_validator_fails_every_job_before_its_request(tmp_path, redis_url, conn, sim_factory):
    sim = sim_factory("--speedup", "20", "--length-mean", "50")
    ids = write_dataset(tmp_path / "D.jsonl", 12)
    cfg = write_config(tmp_path, redis_url, [sim], [
        {"name": "D", "path": str(tmp_path / "D.jsonl"), "budget": "1M", "id_field": "id",
         "sampling": {"max_tokens": 200}, "gates": {"validator": SPEC}}], worker={"concurrency": 4})
    run = live_run(cfg, tmp_path, timeout_s=120)
    err = run.producer.stderr
    assert f"dataset D: gates.validator {SPEC}: nosuch_checks_39 is not importable here" in err, err
    # nothing was generated: the server saw no request
    assert sim_get(sim, "/sim/requests") == [] and sim_get(sim, "/sim/stats")["generated_tokens"] == 0
    ledger = read_ledger(conn, "D")
    assert ledger["failed"] == len(ids) and ledger.get("committed", 0) == 0, ledger
    assert int(conn.get(keys.used_key("D")) or 0) == 0
    job = Job.fetch(job_id("D", ids[0]), connection=conn, serializer=JSONSerializer)
    result = job.latest_result()
    assert result is not None and f"gates.validator {SPEC}: cannot import nosuch_checks_39" in (result.exc_string or "")
    log = run.worker_logs[0]
    assert log.count("cannot import nosuch_checks_39") == 1, log  # once per worker, not once per job
    assert "fails the dataset's jobs without sending them" in log and "Traceback" not in log + err
