"""``reconcile`` against commits a replica never got (issue 38, item 8), on a real master and replica.

A promoted replica lacks the last commits its master acknowledged. Where the collector had
written such a commit's row, the job runs again on the new master, and a real engine samples
anew: the re-run counts another length, while the collector, which writes a prompt once, keeps
the row already on disk. ``used`` then follows the re-run and the file the first run; reconcile
makes ``used`` follow the file. The failover itself (sentinels, workers, producer) is
tests/test_sentinel.py; here the replica is promoted by hand, the steps by the scripts, so each
is where the test says.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import redis

from budgetq.producer.run import reconcile as reconcile_mod
from budgetq.producer.run.collector import Collector
from budgetq.producer.run.reconcile import reconcile
from budgetq.shared import budget, keys
from budgetq.shared.budget import Admission, Outcome, register_dataset
from budgetq.shared.config import Config
from budgetq.shared.config_load import load_config
from budgetq.shared.errors import BudgetqError
from budgetq.shared.identity import job_id
from budgetq.shared.scripts import run
from budgetq.simulator.local import LocalRedis
from tests.helpers import rows, wait_for, write_config, write_dataset
from tests.test_sentinel import cut_replication


@pytest.fixture
def pair():
    """A master and its replica, each a private redis-server; replication up."""
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server not found (apt-get install redis-server)")
    master, replica = LocalRedis(), LocalRedis()
    try:
        r = redis.Redis(port=replica.port)
        r.replicaof("127.0.0.1", master.port)
        wait_for(lambda: r.info("replication").get("master_link_status") == "up", 60, "the replica to sync")
        yield master, replica
    finally:
        master.stop()
        replica.stop()


def _config(tmp_path: Path, url: str) -> Config:
    write_dataset(tmp_path / "D.jsonl", 4)
    spec = {"name": "D", "path": str(tmp_path / "D.jsonl"), "budget": "1M", "id_field": "id",
            "sampling": {"max_tokens": 500}}
    return load_config(write_config(tmp_path, url, "http://127.0.0.1:9", [spec]), env={})


def _generate(conn: redis.Redis, pid: str, tokens: int) -> Outcome:
    """One job of prompt ``pid`` as a worker runs it: admitted, then its answer of ``tokens`` committed."""
    job = job_id("D", pid)
    assert run(conn, budget.reserve("D", job, 500)).status is Admission.ADMIT
    row = json.dumps({"id": pid, "prompt_tokens": 7, "completion_tokens": tokens, "finish_reason": "stop"})
    return run(conn, budget.commit("D", job, 7, tokens, "stop", row))


def _used(conn: redis.Redis) -> int:
    return int(conn.get(keys.used_key("D")) or 0)


def _synced(master: redis.Redis, replica: redis.Redis) -> bool:
    return master.info("replication")["master_repl_offset"] == replica.info("replication").get("slave_repl_offset")


def test_a_lost_commit_whose_job_ran_again_with_another_length_counts_by_its_row(tmp_path, pair):
    master, replica = pair
    m, r = redis.Redis(port=master.port), redis.Redis(port=replica.port)
    cfg = _config(tmp_path, master.url)
    register_dataset(m, cfg.dataset("D"))
    collector = Collector(m, cfg.output_dir, ["D"])
    out = cfg.output_dir / "D.jsonl"
    assert _generate(m, "p0", 40) is Outcome.COMMITTED and _generate(m, "p1", 50) is Outcome.COMMITTED
    assert collector.drain() == 2
    wait_for(lambda: _synced(m, r), 30, "the replica to catch up")
    cut_replication(r)
    # Acknowledged by the master, never replicated: p2's commit (60 tokens), whose row the collector writes.
    assert _generate(m, "p2", 60) is Outcome.COMMITTED and collector.drain() == 1
    assert _used(m) == 150 and _used(r) == 90
    # The failover: the replica is the master now, without p2's commit. p2's job runs again and the
    # engine samples 85 tokens this time: counted (p2 is not done here), and the collector, the same
    # producer, keeps the row it wrote (a prompt is written once).
    r.replicaof("NO", "ONE")
    collector.conn = r
    assert _generate(r, "p2", 85) is Outcome.COMMITTED
    assert collector.drain() == 0
    on_disk = sum(row["completion_tokens"] for row in rows(out))
    assert [row["completion_tokens"] for row in rows(out)] == [40, 50, 60]
    assert _used(r) == 175 != on_disk  # what reconcile is for: used follows the re-run, the file the first run
    report = reconcile(r, cfg, cfg.dataset("D"))
    assert (report.used_before, report.used_expected, report.used_after, report.adopted) == (175, 150, 150, 0)
    assert _used(r) == on_disk
    again = reconcile(r, cfg, cfg.dataset("D"))
    assert again.used_before == again.used_after == on_disk and again.adopted == 0


def test_a_lost_commit_whose_row_is_on_disk_and_not_yet_run_again_is_adopted(tmp_path, pair):
    master, replica = pair
    m, r = redis.Redis(port=master.port), redis.Redis(port=replica.port)
    cfg = _config(tmp_path, master.url)
    register_dataset(m, cfg.dataset("D"))
    collector = Collector(m, cfg.output_dir, ["D"])
    assert _generate(m, "p0", 40) is Outcome.COMMITTED and collector.drain() == 1
    wait_for(lambda: _synced(m, r), 30, "the replica to catch up")
    cut_replication(r)
    assert _generate(m, "p1", 60) is Outcome.COMMITTED and collector.drain() == 1
    r.replicaof("NO", "ONE")
    assert _used(r) == 40 and not r.sismember(keys.done_key("D"), job_id("D", "p1"))
    report = reconcile(r, cfg, cfg.dataset("D"))
    assert (report.adopted, report.tokens_added, report.used_after) == (1, 60, 100)
    # p1 is done again: its job, when it comes back, is not admitted (not generated a second time)
    assert run(r, budget.reserve("D", job_id("D", "p1"), 500)).status is Admission.DONE


def test_a_commit_collected_while_reconcile_reads_the_files_counts_once(tmp_path, conn, redis_url, monkeypatch):
    """A commit and its row written between reconcile's read of the counters and its read of the files: that
    row is in the files and its tokens already in ``used``; a correction computed from those two reads would
    add them a second time. The WATCH makes reconcile read again instead."""
    cfg = _config(tmp_path, redis_url)
    register_dataset(conn, cfg.dataset("D"))
    collector = Collector(conn, cfg.output_dir, ["D"])
    assert _generate(conn, "p0", 40) is Outcome.COMMITTED and collector.drain() == 1
    real = reconcile_mod.rows_on_disk
    reads = []

    def rows_on_disk(out_dir, ds):
        reads.append(1)
        if len(reads) == 2:  # the first read after the counters' (the first is adopt_missing's)
            assert _generate(conn, "p1", 60) is Outcome.COMMITTED and collector.drain() == 1
        return real(out_dir, ds)

    monkeypatch.setattr(reconcile_mod, "rows_on_disk", rows_on_disk)
    report = reconcile(conn, cfg, cfg.dataset("D"))
    assert _used(conn) == 100 == sum(row["completion_tokens"] for row in rows(cfg.output_dir / "D.jsonl"))
    assert report.used_after == report.used_expected == 100 and len(reads) == 3  # read again once


def test_reconcile_without_the_output_files_refuses_instead_of_zeroing_used(tmp_path, conn, redis_url):
    """Run on a host (or with an output_dir) without the files, reconcile would find no row and set ``used`` to
    0, reopening the budget: it refuses in one line naming the file, and changes nothing."""
    cfg = _config(tmp_path, redis_url)
    register_dataset(conn, cfg.dataset("D"))
    collector = Collector(conn, cfg.output_dir, ["D"])
    assert _generate(conn, "p0", 40) is Outcome.COMMITTED and collector.drain() == 1
    moved = cfg.model_copy(update={"output_dir": tmp_path / "elsewhere"})
    with pytest.raises(BudgetqError) as err:
        reconcile(conn, moved, moved.dataset("D"))
    assert str(err.value).startswith("dataset D: no output file ") and "elsewhere/D.jsonl" in str(err.value)
    assert "\n" not in str(err.value) and _used(conn) == 40
    assert reconcile(conn, cfg, cfg.dataset("D")).used_after == 40  # where the files are, nothing to change
