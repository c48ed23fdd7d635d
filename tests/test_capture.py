"""`capture: features`: `budgetq produce` captures the hidden states of a dataset's rows as they
commit, and ends only once every row has them; `budgetq worker` serves the features jobs.

Real Redis, real RQ, real HTTP (one `budgetq sim --enable-return-hidden-states` serves generation and
prefills), real worker and producer processes, real files.
"""

from __future__ import annotations

import os
import signal
import subprocess

import pytest
import yaml

from budgetq.hidden_states.store.shards import features_dir, index_rows
from budgetq.shared import keys
from tests.helpers import PY, ROOT, Procs, check_invariants, rows, wait_for, write_dataset
from tests.test_features import HIDDEN, check_samples
from tests.tiny_tokenizer import make_tiny_tokenizer


def capture_config(tmp_path, redis_url: str, sim: str, n_a: int, n_b: int, **worker) -> tuple:
    tok = make_tiny_tokenizer(tmp_path / "tok")
    ids_a = write_dataset(tmp_path / "A.jsonl", n_a)
    ids_b = write_dataset(tmp_path / "B.jsonl", n_b)
    common = {"id_field": "id", "sampling": {"max_tokens": 60}, "prior_mean_tokens": 20}
    cfg = {"redis_url": redis_url, "output_dir": str(tmp_path / "out"),
           "server": {"urls": [sim], "api": "generate", "tokenizer": tok},
           "worker": {"heartbeat_ttl_s": 2, "maintenance_interval_s": 0.5, **worker},
           "producer": {"progress": "off"},
           "features": {"dtype": "float16", "shard_mb": 0.002, "concurrency": 4, "decode_processes": 1},
           "datasets": [{"name": "A", "path": str(tmp_path / "A.jsonl"), "budget": "1M", "capture": "features",
                         **common},
                        {"name": "B", "path": str(tmp_path / "B.jsonl"), "budget": "1M", **common}]}
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path, ids_a, ids_b


def produce(cfg, tmp_path, name: str, **env: str) -> tuple[subprocess.Popen, object]:
    log = open(tmp_path / f"{name}.log", "w")
    p = subprocess.Popen([*PY, "produce", "-c", str(cfg)], cwd=ROOT, env=dict(os.environ, **env), stdout=log,
                         stderr=subprocess.STDOUT)
    return p, log


def test_produce_captures_every_row_and_leaves_other_datasets_alone(tmp_path, redis_url, conn, sim_factory):
    sim = sim_factory("--speedup", "50", "--length-mean", "20", "--enable-return-hidden-states",
                      "--hidden-size", str(HIDDEN))
    cfg, ids_a, ids_b = capture_config(tmp_path, redis_url, sim, 30, 10, concurrency=8)
    out = tmp_path / "out"
    procs = Procs(cfg, tmp_path)
    try:
        procs.worker()  # serves the features jobs too: A has capture: features
        res = subprocess.run([*PY, "produce", "-c", str(cfg)], cwd=ROOT, env=dict(os.environ), capture_output=True,
                             text=True, timeout=240)
        assert res.returncode == 0, res.stdout + res.stderr
        # produce ended with every committed row of A captured, aligned, once
        committed = [r["id"] for r in rows(out / "A.jsonl")]
        assert sorted(committed) == sorted(ids_a)
        check_samples(out, "A", committed)
        assert "hidden states A: 30 samples on disk (30 captured this run, 0 failed" in res.stdout, res.stdout
        assert conn.xlen(keys.features_results_key("A")) == 0
        assert int(conn.get(keys.features_pending_key("A")) or 0) == 0
        assert not conn.sismember(keys.FEATURES_DATASETS, "A"), "workers stop polling a finished capture"
        assert conn.get(keys.features_lock_key("A")) is None, "the lock is released"
        # B, without capture: its rows, and nothing of the features machinery
        check_invariants(conn, out, "B", ids_b)
        assert not features_dir(out, "B").exists()
        assert not conn.exists(keys.rq_queue_key(keys.features_name("B")), keys.features_results_key("B"))
        assert "hidden states B" not in res.stdout
        check = subprocess.run([*PY, "features", "--check", "--dataset", "A", "-c", str(cfg)], cwd=ROOT,
                               capture_output=True, text=True, timeout=120)
        assert check.returncode == 0 and "A: consistent" in check.stdout, check.stdout + check.stderr
        status = subprocess.run([*PY, "status", "-c", str(cfg)], cwd=ROOT, capture_output=True, text=True,
                                timeout=120)
        assert status.returncode == 0, status.stderr
        table = status.stdout[status.stdout.index("hidden states (capture: features)"):]
        assert "30 / 30" in table and "\n│ B " not in table, status.stdout
    finally:
        procs.stop_all()


def test_produce_captures_with_the_transformers_backend(tmp_path, redis_url, conn, sim_factory):
    """capture: features with features.backend: transformers: `budgetq worker` loads the target (a random Llama
    built here) and serves the features jobs beside generation; the simulator only generates (started without
    --enable-return-hidden-states, it would answer a hidden-states prefill with a 400). produce ends with every
    row generated once and captured once, each sample in exactly one shard, its last layer and aux layers bit
    for bit the model's own pass over the row's tokens."""
    pytest.importorskip("torch")
    from transformers import AutoTokenizer

    from tests.test_capture_hf import HIDDEN as HF_HIDDEN
    from tests.test_capture_hf import LAYERS, check_hf_samples
    from tests.tiny_llama import make_tiny_llama

    sim = sim_factory("--speedup", "50", "--length-mean", "20")
    cfg, ids_a, ids_b = capture_config(tmp_path, redis_url, sim, 16, 4, concurrency=8)
    raw = yaml.safe_load(cfg.read_text())
    model = make_tiny_llama(tmp_path / "llama", len(AutoTokenizer.from_pretrained(raw["server"]["tokenizer"])),
                            HF_HIDDEN, LAYERS)
    raw["features"].update({"backend": "transformers", "dtype": "bfloat16", "shard_mb": 0.05, "model": {
        "path": model, "attn_implementation": "eager", "max_batch_tokens": 256}})
    cfg.write_text(yaml.safe_dump(raw))
    out = tmp_path / "out"
    procs = Procs(cfg, tmp_path)
    try:
        procs.worker()
        res = subprocess.run([*PY, "produce", "-c", str(cfg)], cwd=ROOT, env=dict(os.environ), capture_output=True,
                             text=True, timeout=240)
        assert res.returncode == 0, res.stdout + res.stderr
        assert "hidden states A: 16 samples on disk (16 captured this run, 0 failed" in res.stdout, res.stdout
        check_invariants(conn, out, "A", ids_a)
        check_invariants(conn, out, "B", ids_b)
        committed = [r["id"] for r in rows(out / "A.jsonl")]
        assert sorted(committed) == sorted(ids_a)
        check_hf_samples(out, model, committed)
        assert len(list(features_dir(out, "A").glob("*.safetensors"))) > 1
        assert conn.xlen(keys.features_results_key("A")) == 0
        assert int(conn.get(keys.features_pending_key("A")) or 0) == 0
        assert not features_dir(out, "B").exists()
        check = subprocess.run([*PY, "features", "--check", "--dataset", "A", "-c", str(cfg)], cwd=ROOT,
                               capture_output=True, text=True, timeout=120)
        assert check.returncode == 0 and "A: consistent" in check.stdout, check.stdout + check.stderr
    finally:
        procs.stop_all()


@pytest.mark.parametrize("kill", ["sigkill", "between_shard_and_index"])
def test_sigkill_mid_run_then_restart_loses_and_duplicates_nothing(tmp_path, redis_url, conn, sim_factory, kill):
    """produce SIGKILLed while both generation and capture are under way (from outside once hidden states
    are on disk, or by itself between its first shard's rename and its index rows); a new produce
    finishes both."""
    # ~25 tok/s per request at 4 in flight: generating the 50 rows takes ~10 s, prefills are instant
    sim = sim_factory("--peak-tok-s", "900", "--length-mean", "20", "--enable-return-hidden-states",
                      "--hidden-size", str(HIDDEN))
    cfg, ids_a, ids_b = capture_config(tmp_path, redis_url, sim, 40, 10, concurrency=4)
    out = tmp_path / "out"
    index = features_dir(out, "A") / "index.jsonl"
    procs = Procs(cfg, tmp_path)
    try:
        procs.worker()
        if kill == "sigkill":
            first, log1 = produce(cfg, tmp_path, "produce-1")
            wait_for(lambda: len(index_rows(index)) >= 3, 120, "the first hidden states on disk")
            first.send_signal(signal.SIGKILL)
        else:
            first, log1 = produce(cfg, tmp_path, "produce-1", BUDGETQ_FEATURES_CRASH_AFTER_SHARD="1")
        assert first.wait(120) == -signal.SIGKILL, (tmp_path / "produce-1.log").read_text()
        log1.close()  # type: ignore[attr-defined]
        assert len(rows(out / "A.jsonl")) < 40, "killed with generation still under way"
        if kill == "between_shard_and_index":
            assert list(features_dir(out, "A").glob("*.safetensors")) and index_rows(index) == []
        second, log2 = produce(cfg, tmp_path, "produce-2")
        assert second.wait(240) == 0, (tmp_path / "produce-2.log").read_text()
        log2.close()  # type: ignore[attr-defined]
        text = (tmp_path / "produce-2.log").read_text()
        assert "taking over the features lock" in text, text
        check_invariants(conn, out, "A", ids_a)
        check_invariants(conn, out, "B", ids_b)
        committed = [r["id"] for r in rows(out / "A.jsonl")]
        assert sorted(committed) == sorted(ids_a)
        check_samples(out, "A", committed)  # every id indexed exactly once, aligned
        assert conn.xlen(keys.features_results_key("A")) == 0
        assert int(conn.get(keys.features_pending_key("A")) or 0) == 0
    finally:
        procs.stop_all()


def test_failed_prefills_and_the_disk_guard_end_the_run_with_a_report(tmp_path, redis_url, conn, sim_factory):
    """Generation completes; rows without hidden states are reported and the exit status is 1: first a server
    without --enable-return-hidden-states (every prefill fails with SGLang's 400), then a disk guard limit."""
    plain = sim_factory("--speedup", "50", "--length-mean", "20")
    cfg, ids_a, ids_b = capture_config(tmp_path, redis_url, plain, 6, 2)
    out = tmp_path / "out"
    procs = Procs(cfg, tmp_path)
    try:
        procs.worker()
        res = subprocess.run([*PY, "produce", "-c", str(cfg)], cwd=ROOT, env=dict(os.environ), capture_output=True,
                             text=True, timeout=240)
        assert res.returncode == 1, res.stdout + res.stderr
        check_invariants(conn, out, "A", ids_a)
        assert "budgetq: capture: A: 6 features jobs failed" in res.stderr, res.stderr
        assert "--enable-return-hidden-states" in res.stderr and "`budgetq features`" in res.stderr
        assert "hidden states A: 0 samples on disk" in res.stdout, res.stdout
    finally:
        procs.stop_all()
    # the same rows, a server with the flag and a limit of 1500 bytes: some are captured, then admissions stop
    hidden = sim_factory("--speedup", "50", "--length-mean", "20", "--enable-return-hidden-states",
                         "--hidden-size", str(HIDDEN))
    raw = yaml.safe_load(cfg.read_text())
    raw["server"]["urls"] = [hidden]
    raw["features"].update({"max_bytes": 1500, "concurrency": 1})
    cfg.write_text(yaml.safe_dump(raw))
    conn.delete(f"rq:failed:{keys.features_queue_name('A')}")  # as `budgetq retry-failed` would
    procs = Procs(cfg, tmp_path)
    try:
        procs.worker()
        res = subprocess.run([*PY, "produce", "-c", str(cfg)], cwd=ROOT, env=dict(os.environ), capture_output=True,
                             text=True, timeout=240)
        assert res.returncode == 1, res.stdout + res.stderr
        assert "admissions stopped" in res.stderr and "features.max_bytes 1500" in res.stderr, res.stderr
        on_disk = index_rows(features_dir(out, "A") / "index.jsonl")
        assert 0 < len(on_disk) < 6
        check_samples(out, "A", [r["id"] for r in on_disk])
    finally:
        procs.stop_all()


def test_sigint_stops_both_and_a_restart_finishes(tmp_path, redis_url, conn, sim_factory):
    sim = sim_factory("--peak-tok-s", "900", "--length-mean", "20", "--enable-return-hidden-states",
                      "--hidden-size", str(HIDDEN))
    cfg, ids_a, _ = capture_config(tmp_path, redis_url, sim, 40, 2, concurrency=4)
    out = tmp_path / "out"
    index = features_dir(out, "A") / "index.jsonl"
    procs = Procs(cfg, tmp_path)
    try:
        procs.worker()
        first, log1 = produce(cfg, tmp_path, "produce-1")
        wait_for(lambda: len(index_rows(index)) >= 3, 120, "the first hidden states on disk")
        first.send_signal(signal.SIGINT)
        assert first.wait(30) == 3, (tmp_path / "produce-1.log").read_text()  # stopped before the end
        log1.close()  # type: ignore[attr-defined]
        assert len(rows(out / "A.jsonl")) < 40
        assert conn.get(keys.features_lock_key("A")) is None, "a stopped produce releases the features lock"
        assert conn.sismember(keys.FEATURES_DATASETS, "A"), "unfinished: workers keep serving it"
        second, log2 = produce(cfg, tmp_path, "produce-2")
        assert second.wait(240) == 0, (tmp_path / "produce-2.log").read_text()
        log2.close()  # type: ignore[attr-defined]
        check_samples(out, "A", [r["id"] for r in rows(out / "A.jsonl")])
        assert sorted(r["id"] for r in rows(out / "A.jsonl")) == sorted(ids_a)
    finally:
        procs.stop_all()


def test_capture_is_none_by_default_and_needs_a_tokenizer(tmp_path):
    from budgetq.shared.config import Config
    from budgetq.shared.errors import ConfigError

    with pytest.raises((ValueError, ConfigError), match="dataset A: capture: features needs server.tokenizer"):
        Config.model_validate({"datasets": [{"name": "A", "path": "a.jsonl", "budget": "1k",
                                             "capture": "features"}]})
    with pytest.raises(ValueError, match="capture"):
        Config.model_validate({"server": {"tokenizer": "x"},
                               "datasets": [{"name": "A", "path": "a.jsonl", "budget": "1k", "capture": "yes"}]})
    ok = Config.model_validate({"datasets": [{"name": "A", "path": "a.jsonl", "budget": "1k"}]})
    assert ok.datasets[0].capture == "none"


def test_worker_serves_features_jobs_only_with_a_capture_dataset(tmp_path):
    from budgetq.cli.features import capture_datasets
    from budgetq.cli.main import build_parser
    from budgetq.shared.config import Config

    cfg = Config.model_validate({"server": {"tokenizer": "x"}, "datasets": [
        {"name": "A", "path": "a.jsonl", "budget": "1k", "capture": "features"},
        {"name": "B", "path": "b.jsonl", "budget": "1k"}]})
    assert capture_datasets(cfg) == ["A"]
    assert build_parser().parse_args(["worker", "--no-features"]).no_features


def test_a_second_collector_stops_produce_at_start_with_one_line(tmp_path, redis_url, conn):
    """`budgetq features --follow` already collects A: a produce with capture: features for A refuses to
    start (two collectors would write the same results), in one line, before enqueueing anything."""
    from budgetq.hidden_states.collect.features_pass import FeaturesPass
    from budgetq.shared.config_load import load_config

    cfg, _, _ = capture_config(tmp_path, redis_url, "http://127.0.0.1:9", 3, 1)
    other = FeaturesPass(load_config(cfg), conn, ["A"], follow=True)
    try:
        res = subprocess.run([*PY, "produce", "-c", str(cfg)], cwd=ROOT, env=dict(os.environ), capture_output=True,
                             text=True, timeout=120)
    finally:
        other.release()
    assert res.returncode == 2, res.stdout + res.stderr
    lines = [ln for ln in res.stderr.splitlines() if "budgetq" in ln and "PyTorch" not in ln]
    assert len(lines) == 1 and "dataset A: another `budgetq features` is running" in lines[0], res.stderr
    assert "capture: features" in lines[0]
    assert conn.llen(keys.rq_queue_key("A")) == 0 and conn.llen(keys.rq_queue_key("B")) == 0


def test_redis_crash_mid_run_capture_still_ends_complete(tmp_path, sim_factory):
    """Redis SIGKILLed (AOF, fsync every second) with generation and capture under way, restarted 4 s
    later: the producer's capture thread and the worker's features loop wait it out, and produce ends
    with every row generated once and captured once."""
    import time

    import redis

    from budgetq.simulator.local import LocalRedis

    server = LocalRedis(appendonly=True)
    conn = redis.Redis.from_url(server.url)
    try:
        sim = sim_factory("--peak-tok-s", "900", "--length-mean", "20", "--enable-return-hidden-states",
                          "--hidden-size", str(HIDDEN))
        # 200 rows of ~20 tokens at 900 tok/s: generation alone lasts seconds, so the outage comes while
        # the run is under way however fast the first hidden states land (checked, not assumed).
        cfg, ids_a, ids_b = capture_config(tmp_path, server.url, sim, 200, 4, concurrency=4)
        out = tmp_path / "out"
        index = features_dir(out, "A") / "index.jsonl"
        procs = Procs(cfg, tmp_path)
        try:
            worker = procs.worker()
            producer = procs.producer()
            wait_for(lambda: len(index_rows(index)) >= 3, 120, "the first hidden states on disk")
            assert producer.poll() is None, "the run ended before the outage: the test proves nothing"
            assert len(index_rows(index)) < len(ids_a)
            server.kill()
            time.sleep(4.0)  # an outage longer than the 2 s leases
            server.start()
            assert producer.wait(240) == 0, Procs.log(producer)
            assert worker.poll() is None, "the worker died with Redis"
        finally:
            procs.stop_all()
        # No log line is asserted: redis-py's own retries (up to ~6 s, shared/redis_conn.py) can carry
        # any process's calls over a 4 s outage silently. That the outage hit the run is checked above
        # (produce still running, rows still to capture, when Redis was killed).
        check_invariants(conn, out, "A", ids_a)
        committed = [r["id"] for r in rows(out / "A.jsonl")]
        assert sorted(committed) == sorted(ids_a)
        check_samples(out, "A", committed)
    finally:
        server.stop()


def test_jobs_redis_lost_are_enqueued_again(tmp_path, redis_url, conn, sim_factory):
    """Features jobs enqueued, then gone from Redis (a crash past its last AOF fsync): the pass notices once
    nothing is queued or running, reads those rows again and enqueues them anew, and ends complete."""
    from budgetq.hidden_states.collect.features_pass import FeaturesPass
    from budgetq.shared.config_load import load_config
    from budgetq.shared.identity import job_id
    from tests.test_features import features_config, write_rows

    sim = sim_factory("--instant", "--enable-return-hidden-states", "--hidden-size", str(HIDDEN))
    cfg = features_config(tmp_path, redis_url, sim)
    ids = write_rows(tmp_path / "out", "A", 6)
    fp = FeaturesPass(load_config(cfg), conn)
    fp._enqueue(fp.passes[0])
    name = keys.features_name("A")
    assert conn.llen(keys.rq_queue_key(name)) == 6
    conn.delete(keys.rq_queue_key(name), *[keys.rq_job_key(job_id(name, i)) for i in ids[:4]])  # lost
    conn.rpush(keys.rq_queue_key(name), *[job_id(name, i) for i in ids[4:]])
    procs = Procs(cfg, tmp_path)
    try:
        procs.start("features-worker")
        rep = fp.run()
    finally:
        procs.stop_all()
    assert rep.ok, rep
    assert rep.datasets["A"]["captured"] == 6 and rep.datasets["A"]["enqueued"] == 10
    check_samples(tmp_path / "out", "A", ids)
