"""A dataset whose ``gates.validator`` cannot be imported, on the real pipeline: ``produce`` says so at
start, and a worker fails each job *before* sending it (an answer no validator can judge would be
generated for nothing: GPU time spent, the answer lost), in one line logged once. And one that hangs."""

from __future__ import annotations

import os

from rq.job import Job
from rq.serializers import JSONSerializer

from budgetq.shared import keys
from budgetq.shared.identity import job_id
from budgetq.shared.ledger import read_ledger
from budgetq.worker.quality import THREADS_MAX
from tests.helpers import live_run, rows, sim_get, write_config, write_dataset

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


def test_a_validator_that_hangs_does_not_stop_the_worker(tmp_path, redis_url, conn, sim_factory):
    """User code that hangs, on the real pipeline: one validator's import never ends (H), another's every call
    (C), a third dataset has none (E). The worker's event loop never waits on them: E is generated in full;
    H's jobs fail before their requests once the import passed gates.validator_timeout_s; C's answers are
    discarded with why (a call past the limit; then, with THREADS_MAX calls hung, without a call). Each
    line is logged once. Before, the worker's loop ran the validator itself and froze: nothing ended."""
    (tmp_path / "hang_import_39.py").write_text("import threading\nthreading.Event().wait()\n")
    (tmp_path / "hang_call_39.py").write_text("import threading\ndef f(answer):\n    threading.Event().wait()\n")
    paths = {}
    for name in ("H", "C", "E"):
        paths[name] = write_dataset(tmp_path / f"{name}.jsonl", 12)
    gates = {"H": {"validator": "hang_import_39:f", "validator_timeout_s": 1},
             "C": {"validator": "hang_call_39:f", "validator_timeout_s": 1}, "E": {}}
    cfg = write_config(tmp_path, redis_url, [sim_factory("--speedup", "20", "--length-mean", "50")], [
        {"name": n, "path": str(tmp_path / f"{n}.jsonl"), "budget": "1M", "id_field": "id",
         "sampling": {"max_tokens": 200}, "gates": gates[n]} for n in ("H", "C", "E")], worker={"concurrency": 4})
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))}
    run = live_run(cfg, tmp_path, env=env, timeout_s=180)
    assert read_ledger(conn, "E")["rows"] == len(paths["E"]), read_ledger(conn, "E")
    assert len(rows(run.out / "E.jsonl")) == len(paths["E"])
    assert read_ledger(conn, "H")["failed"] == len(paths["H"]), read_ledger(conn, "H")
    job = Job.fetch(job_id("H", paths["H"][0]), connection=conn, serializer=JSONSerializer)
    result = job.latest_result()
    assert result is not None and "importing hang_import_39 did not finish within 1 s" in (result.exc_string or "")
    assert read_ledger(conn, "C")["discarded"] == len(paths["C"]), read_ledger(conn, "C")
    # THREADS_MAX calls hang for good and discard their answers; every other answer waited its second for a
    # thread and was discarded without a call: the worker holds THREADS_MAX threads for C, not one an answer.
    reasons = [d["discard"]["reason"] for d in rows(run.out / "C.discarded.jsonl")]
    late = "validator:did not return within 1 s (gates.validator_timeout_s)"
    not_called = f"validator:not called: its {THREADS_MAX} calls running did not return within 1 s"
    assert sorted(reasons) == sorted([late] * THREADS_MAX + [not_called] * (len(paths["C"]) - THREADS_MAX))
    log = run.worker_logs[0]
    assert [log.count(w) for w in ("did not finish within", "within 1 s (gates.", "not called")] == [1, 2, 1], log
    assert run.worker_rcs == [0], log   # the hung threads are daemons: the worker still stops on SIGTERM
    assert "Traceback" not in log + run.producer.stderr
