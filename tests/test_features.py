"""Hidden states: the features pass end to end against the simulator, and its pieces.

Real Redis, real RQ, real HTTP (``budgetq sim --enable-return-hidden-states``), real files.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import numpy as np
import pytest
import yaml

from budgetq.hidden_states.capture.decode import from_dtype, to_dtype
from budgetq.hidden_states.schema import FeaturesMeta
from budgetq.hidden_states.store.safetensors_io import read_header, read_tensor
from budgetq.hidden_states.store.shards import FeatureStore, features_dir, index_rows
from budgetq.shared import keys
from budgetq.simulator.hidden import NOT_ENABLED, vectors
from tests.helpers import PY, ROOT, Procs, stock_rq_worker, wait_for
from tests.tiny_tokenizer import make_tiny_tokenizer

HIDDEN = 16
WORDS = ["hello", "what", "is", "the", "answer", "question", "explain", "write", "about"]


def write_rows(out: Path, ds: str, n: int) -> list[str]:
    """n committed rows in out/<ds>.jsonl (as the collector writes them); returns their ids."""
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(7)
    ids = []
    with open(out / f"{ds}.jsonl", "w", encoding="utf-8") as fh:
        for i in range(n):
            q = " ".join(rng.choice(WORDS, size=3 + i % 5))
            a = " ".join(rng.choice(WORDS, size=4 + i % 7))
            row = {"id": f"r{i}", "dataset": ds, "status": "success", "prompt_tokens": 5, "completion_tokens": 5,
                   "conversations": [{"role": "user", "content": q}, {"role": "assistant", "content": a}],
                   "finish_reason": "stop", "model": "sim", "endpoint": "x", "latency_s": 0.1}
            fh.write(json.dumps(row) + "\n")
            ids.append(f"r{i}")
    return ids


def features_config(tmp_path: Path, redis_url: str, sim: str, **features) -> Path:
    tok = make_tiny_tokenizer(tmp_path / "tok")
    cfg = {"redis_url": redis_url, "output_dir": str(tmp_path / "out"),
           "server": {"urls": ["http://127.0.0.1:9"], "tokenizer": tok},
           "worker": {"heartbeat_ttl_s": 2},
           "features": {"server": {"urls": [sim]}, "dtype": "float16", "shard_mb": 0.002, **features},
           "datasets": [{"name": "A", "path": str(tmp_path / "none.jsonl"), "budget": "1k"}]}
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def run_features(cfg: Path, *extra: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([*PY, "features", "-c", str(cfg), *extra], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env=dict(os.environ))


def run_features_with_a_worker(cfg: Path, log_dir: Path, *extra: str,
                               timeout: float = 120) -> subprocess.CompletedProcess:
    """One `budgetq features-worker` beside `budgetq features` (``run_features``); the worker is stopped after."""
    procs = Procs(cfg, log_dir)
    try:
        procs.start("features-worker")
        return run_features(cfg, *extra, timeout=timeout)
    finally:
        procs.stop_all()


def check_samples(out: Path, ds: str, ids: list[str]) -> list[dict]:
    """Every id indexed once, hidden rows aligned with input_ids, loss mask = the answer's tokens."""
    d = features_dir(out, ds)
    rows = index_rows(d / "index.jsonl")
    assert sorted(r["id"] for r in rows) == sorted(ids)
    for r in rows:
        path = d / r["shard"]
        t = read_tensor(path, f"{r['key']}.hidden_state")
        assert t.shape == r["shape"] == [len(r["input_ids"]), HIDDEN]
        got = from_dtype(t.data, r["dtype"], t.shape)
        want = vectors(np.array(r["input_ids"]), np.arange(len(r["input_ids"])), HIDDEN)
        assert np.array_equal(got, want), f"{r['id']}: hidden rows are not aligned with input_ids"
        ids_t = np.frombuffer(read_tensor(path, f"{r['key']}.input_ids").data, "<i4")
        assert ids_t.tolist() == r["input_ids"]
        mask = r["loss_mask"]
        assert len(mask) == len(r["input_ids"]) and 0 < sum(mask) < len(mask)
        start = mask.index(1)
        assert mask[start:] == [1] * (len(mask) - start), "loss mask is the answer's tail span"
    return rows


def test_features_pass_captures_every_row_aligned_and_resumable(tmp_path, redis_url, conn, sim_factory):
    sim = sim_factory("--instant", "--enable-return-hidden-states", "--hidden-size", str(HIDDEN))
    cfg = features_config(tmp_path, redis_url, sim)
    out = tmp_path / "out"
    ids = write_rows(out, "A", 12)
    procs = Procs(cfg, tmp_path)
    try:
        procs.start("features-worker")
        res = run_features(cfg)
        assert res.returncode == 0, res.stdout + res.stderr
        rows = check_samples(out, "A", ids)
        assert len({r["shard"] for r in rows}) > 1, "shards close at features.shard_mb"
        # safetensors' own reader accepts our shards
        from safetensors.numpy import load_file
        shard = features_dir(out, "A") / rows[0]["shard"]
        loaded = load_file(str(shard))
        assert loaded[f"{rows[0]['key']}.hidden_state"].shape == tuple(rows[0]["shape"])
        assert conn.scard(keys.features_done_key("A")) == 12
        assert conn.zcard(f"rq:finished:{keys.features_queue_name('A')}") == 12
        # more rows committed later: a second pass captures only those
        ids += write_rows_more(out, "A", 12, 5)
        res = run_features(cfg, "--json")
        assert res.returncode == 0, res.stdout + res.stderr
        report = json.loads(res.stdout)
        assert report["datasets"]["A"]["captured"] == 5 and report["datasets"]["A"]["already_on_disk"] == 12
        check_samples(out, "A", ids)
        res = run_features(cfg, "--check")
        assert res.returncode == 0 and "consistent" in res.stdout, res.stdout + res.stderr
    finally:
        procs.stop_all()


def write_rows_more(out: Path, ds: str, start: int, n: int) -> list[str]:
    tmp = out / "more"
    new = write_rows(tmp, ds, start + n)[start:]
    lines = (tmp / f"{ds}.jsonl").read_text().splitlines(keepends=True)[start:]
    with open(out / f"{ds}.jsonl", "a") as fh:
        fh.writelines(lines)
    return new


def test_request_without_the_server_flag_fails_with_sglangs_400(tmp_path, redis_url, conn, sim_factory):
    sim = sim_factory("--instant", "--hidden-size", str(HIDDEN))
    cfg = features_config(tmp_path, redis_url, sim)
    write_rows(tmp_path / "out", "A", 3)
    procs = Procs(cfg, tmp_path)
    try:
        procs.start("features-worker")
        res = run_features(cfg)
        assert res.returncode == 1
        assert "HTTP 400" in res.stderr and "--enable-return-hidden-states" in res.stderr, res.stderr
        assert conn.zcard(f"rq:failed:{keys.features_queue_name('A')}") == 3
        assert index_rows(features_dir(tmp_path / "out", "A") / "index.jsonl") == []
    finally:
        procs.stop_all()


def test_simulator_answers_like_sglang(sim_factory):
    import urllib.error
    import urllib.request

    def post(url: str, body: dict) -> tuple[int, dict]:
        req = urllib.request.Request(url + "/generate", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=10) as resp:
                return resp.status, json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read())

    on = sim_factory("--instant", "--return-hidden-states-mode", "full", "--hidden-size", "8")
    last = sim_factory("--instant", "--return-hidden-states-mode", "last", "--hidden-size", "8")
    off = sim_factory("--instant")
    body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 1}, "return_hidden_states": True}
    status, out = post(on, body)
    hs = out["meta_info"]["hidden_states"]
    assert status == 200 and len(hs) == 1 and np.array(hs[0]).shape == (3, 8)  # [prefill block]
    status, out = post(on, {**body, "sampling_params": {"max_new_tokens": 3}})
    assert [np.array(h).shape for h in out["meta_info"]["hidden_states"]] == [(3, 8), (8,), (8,)]
    status, out = post(off, body)
    assert status == 400 and out == {"error": {"message": NOT_ENABLED}}
    status, out = post(last, body)
    assert status == 400 and "exceeds the server maximum `last`" in out["error"]["message"]
    # Over HTTP the JSON contract gate takes booleans only (api/v1/api_types.py decode_BoolOrList):
    # "last" is refused before the server's own mode check.
    status, out = post(last, {**body, "return_hidden_states": "last"})
    assert (status, out) == (400, {"error": 'invalid type: string "last", expected a value or an array of values '
                                            'for BoolOrList'})
    status, out = post(on, {**body, "return_hidden_states": [1]})
    assert (status, out) == (400, {"error": "invalid type: integer `1`, expected a boolean"})


def _meta(pid: str, n: int) -> tuple[FeaturesMeta, bytes]:
    ids = list(range(3, 3 + n))
    arr = vectors(np.array(ids), np.arange(n), HIDDEN)
    return (FeaturesMeta(id=pid, dataset="A", input_ids=ids, loss_start=1, loss_end=n, dtype="bfloat16",
                         shape=[n, HIDDEN]), to_dtype(arr, "bfloat16"))


def test_store_repairs_a_crash_between_shard_write_and_index(tmp_path):
    store = FeatureStore(tmp_path, "A", shard_bytes=10**9)
    for i in range(3):
        assert store.add(*_meta(f"p{i}", 4 + i))
    assert not store.add(*_meta("p1", 5)), "a second copy of a buffered id is dropped"
    store.flush()
    index = features_dir(tmp_path, "A") / "index.jsonl"
    index.write_text("".join(index.read_text().splitlines(keepends=True)[:1]) + '{"id": "p1", "tor')  # torn
    # (a kill after a shard's .tmp is written, before its rename: tests/test_store_faults.py kills a pass there)
    again = FeatureStore(tmp_path, "A", shard_bytes=10**9)
    assert again.recovered.reindexed == 2
    assert sorted(r["id"] for r in index_rows(index)) == ["p0", "p1", "p2"]
    assert not again.add(*_meta("p2", 6)), "an id on disk is never written twice"
    header, _ = read_header(features_dir(tmp_path, "A") / "000000.safetensors")
    assert header["__metadata__"]["format"] == "budgetq-features-1"


def test_bfloat16_round_trip_is_exact_for_bf16_values():
    x = np.array([[1.0, -2.5, 0.15625, 3.0e38, -1.0e-30]], np.float32)
    bf = from_dtype(to_dtype(x, "bfloat16"), "bfloat16", [1, 5])
    assert np.array_equal(from_dtype(to_dtype(bf, "bfloat16"), "bfloat16", [1, 5]), bf)
    assert np.allclose(bf, x, rtol=2**-8)


def test_sigkill_between_write_and_commit_leaves_no_orphan_or_duplicate(tmp_path, redis_url, conn, sim_factory):
    """The pass is SIGKILLed right after a shard's rename (BUDGETQ_FEATURES_CRASH_AFTER_SHARD); a second
    pass indexes that shard, drops the stream copies of its ids, and every id ends on disk once."""
    sim = sim_factory("--instant", "--enable-return-hidden-states", "--hidden-size", str(HIDDEN))
    cfg = features_config(tmp_path, redis_url, sim)
    out = tmp_path / "out"
    ids = write_rows(out, "A", 10)
    procs = Procs(cfg, tmp_path)
    try:
        procs.start("features-worker")
        env = dict(os.environ, BUDGETQ_FEATURES_CRASH_AFTER_SHARD="1")
        p = subprocess.Popen([*PY, "features", "-c", str(cfg)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
        output = p.communicate(timeout=120)[0]  # (communicate closes the pipe: no unclosed file)
        assert p.returncode == -signal.SIGKILL, output
        d = features_dir(out, "A")
        assert list(d.glob("*.safetensors")) and index_rows(d / "index.jsonl") == []
        assert conn.xlen(keys.features_results_key("A")) > 0, "the stream still holds what the shard holds"
        res = run_features(cfg)
        assert res.returncode == 0, res.stdout + res.stderr
        check_samples(out, "A", ids)
        assert int(conn.get(keys.features_pending_key("A")) or 0) == 0
        assert conn.xlen(keys.features_results_key("A")) == 0
    finally:
        procs.stop_all()


def test_disk_guard_stops_admissions_with_a_clear_message(tmp_path, redis_url, conn, sim_factory):
    sim = sim_factory("--instant", "--enable-return-hidden-states", "--hidden-size", str(HIDDEN))
    # 2 in flight before the first result; each sample is ~10-20 tokens x 16 x 2 bytes
    cfg = features_config(tmp_path, redis_url, sim, max_bytes=3000, concurrency=2)
    write_rows(tmp_path / "out", "A", 40)
    procs = Procs(cfg, tmp_path)
    try:
        procs.start("features-worker")
        res = run_features(cfg)
        assert res.returncode == 1
        assert "admissions stopped" in res.stderr and "features.max_bytes 3000" in res.stderr, res.stderr
        d = features_dir(tmp_path / "out", "A")
        on_disk = sum(p.stat().st_size for p in d.glob("*.safetensors"))
        rows = index_rows(d / "index.jsonl")
        assert 0 < len(rows) < 40
        assert on_disk <= 3000 * 1.5, "at most the bytes-per-token estimate's error past the limit"
        res = run_features(cfg, "--check")
        assert res.returncode == 0, res.stdout
    finally:
        procs.stop_all()


def test_dead_features_worker_jobs_come_back(tmp_path, redis_url, conn, sim_factory):
    """A features worker SIGKILLed with jobs in flight: the pass requeues them once their lease lapses."""
    sim = sim_factory("--enable-return-hidden-states", "--hidden-size", str(HIDDEN), "--prefill-tok-s", "20")
    cfg = features_config(tmp_path, redis_url, sim)
    ids = write_rows(tmp_path / "out", "A", 6)
    procs = Procs(cfg, tmp_path)
    try:
        victim = procs.start("features-worker")
        runner = subprocess.Popen([*PY, "features", "-c", str(cfg)], cwd=ROOT, env=dict(os.environ),
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        wait_for(lambda: conn.zcard(keys.rq_wip_key(keys.features_name("A"))) > 0, 30, "a claimed features job")
        victim.kill()
        procs.start("features-worker")
        out, err = runner.communicate(timeout=120)
        assert runner.returncode == 0, out + err
        check_samples(tmp_path / "out", "A", ids)
    finally:
        procs.stop_all()


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_decode_checks_rows_against_tokens(dtype):
    import orjson

    from budgetq.hidden_states.capture.decode import HiddenStatesError, decode

    arr = vectors(np.array([4, 5, 6]), np.arange(3), 8)
    body = orjson.dumps({"meta_info": {"hidden_states": [arr.tolist()]}})
    data, shape = decode(body, 3, dtype)
    assert shape == [3, 8] and np.array_equal(from_dtype(data, dtype, shape), arr)
    with pytest.raises(HiddenStatesError, match="2 of 3 tokens|3 of 4 tokens"):
        decode(body, 4, dtype)


def test_specforge_offline_layout(tmp_path):
    """Paths, keys, dtypes and shapes SpecForge's OfflineEagle3Dataset reads (torch.save itself needs torch)."""
    from budgetq.hidden_states.collect.export import offline_path, offline_samples

    store = FeatureStore(tmp_path, "A", shard_bytes=10**9)
    for i in range(3):
        store.add(*_meta(f"p{i}", 4 + i))
    store.flush()
    samples = list(offline_samples(tmp_path, "A"))
    assert [s.path for s in samples] == [f"rows_0-5000/data_{i}.ckpt" for i in range(3)]
    assert offline_path(5001) == "rows_5000-10000/data_5001.ckpt"
    s = samples[2]
    assert s.input_ids.dtype == np.int64 and s.loss_mask.dtype == np.int64
    assert s.input_ids.tolist() == list(range(3, 9)) and s.loss_mask.tolist() == [0, 1, 1, 1, 1, 1]
    dtype, shape, data = s.hidden_state
    assert dtype == "bfloat16" and shape == [1, 6, HIDDEN]
    assert np.array_equal(from_dtype(data, dtype, shape[1:]), vectors(np.arange(3, 9), np.arange(6), HIDDEN))
    assert s.aux_hidden_state is None  # a stock server gives the last layer only


def test_specforge_offline_files_load_with_torch(tmp_path):
    torch = pytest.importorskip("torch")
    from budgetq.hidden_states.collect.export import export_specforge_offline

    store = FeatureStore(tmp_path, "A", shard_bytes=10**9)
    store.add(*_meta("p0", 5))
    store.flush()
    res = export_specforge_offline(tmp_path, "A", tmp_path / "off")
    point = torch.load(tmp_path / "off" / "rows_0-5000" / "data_0.ckpt")
    assert res.written == 1 and point["hidden_state"].shape == (1, 5, HIDDEN)
    assert point["hidden_state"].dtype == torch.bfloat16 and point["input_ids"].dtype == torch.int64


def _wheel_source(rel: str) -> str:
    """A file of the installed sglang wheel, as text (found through its metadata: tests/sglang_contract.py
    replaces the ``sglang`` package in sys.modules with a stub)."""
    import importlib.metadata

    try:
        root = Path(str(importlib.metadata.distribution("sglang").locate_file("sglang")))
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("the sglang wheel is not installed (make installs it)")
    return (root / rel).read_text()


def test_simulator_messages_and_flags_are_sglangs():
    """The 400 texts, the request modes and the server flags, as the pinned wheel has them."""
    import re

    from budgetq.simulator import hidden

    def squash(text: str) -> str:  # Python's implicit string concatenation across lines
        return re.sub(r'"\s*\n\s*f?"', "", text)

    manager = squash(_wheel_source("srt/managers/tokenizer_manager.py"))
    assert hidden.NOT_ENABLED in manager
    assert hidden.exceeds("last").replace("`last`", "`{get_exec().features.return_hidden_states_mode}`") in manager
    assert hidden.BAD_MODE in _wheel_source("srt/managers/schedule_batch.py")
    args = _wheel_source("srt/arg_groups/fields/exec_.py")
    assert "enable_return_hidden_states:" in args and "return_hidden_states_mode:" in args
    assert 'choices=["last", "full"]' in args


def test_the_prefill_request_passes_sglangs_request_model():
    from budgetq.worker.sglang_wire import prefill_body
    from tests import sglang_contract as sc

    try:
        sc.validate_generate_request(json.loads(json.dumps(prefill_body([1, 2, 3], "A-features--r1.0123456789ab"))))
    except sc.SGLangMissing as exc:
        pytest.skip(str(exc))


def _info_worker(cfg: Path, tmp_path: Path, *extra: str) -> tuple[subprocess.Popen, Path]:
    log = tmp_path / f"fw-{len(list(tmp_path.glob('fw-*.log')))}.log"
    with open(log, "w") as out:  # the child keeps its own copy of the file: ours is closed at once
        p = subprocess.Popen([*PY[:-2], "--log-level", "INFO", "features-worker", "-c", str(cfg), *extra], cwd=ROOT,
                             env=dict(os.environ), stdout=out, stderr=subprocess.STDOUT)
    return p, log


def _stop(p: subprocess.Popen) -> None:
    if p.poll() is None:
        p.send_signal(signal.SIGINT)
        p.wait(30)


def test_workers_pause_while_redis_holds_redis_max_mb_for_the_collector(tmp_path, redis_url, conn, sim_factory):
    from budgetq.hidden_states.collect.features_pass import FeaturesPass
    from budgetq.shared.config_load import load_config

    sim = sim_factory("--instant", "--enable-return-hidden-states", "--hidden-size", str(HIDDEN))
    cfg = features_config(tmp_path, redis_url, sim, redis_max_mb=0.0001, concurrency=5)
    ids = write_rows(tmp_path / "out", "A", 5)
    fp = FeaturesPass(load_config(cfg), conn)
    fp._enqueue(fp.passes[0])  # queued, no collector running yet
    fp.release()
    assert conn.llen(keys.rq_queue_key(keys.features_name("A"))) == 5
    worker, log = _info_worker(cfg, tmp_path, "--concurrency", "1")
    try:
        wait_for(lambda: "A paused" in log.read_text(), 30, "the worker to pause the dataset")
        assert conn.xlen(keys.features_results_key("A")) == 1
        assert conn.llen(keys.rq_queue_key(keys.features_name("A"))) == 4
        res = run_features(cfg)  # the collector drains the stream; the worker goes on
        assert res.returncode == 0, res.stdout + res.stderr
        check_samples(tmp_path / "out", "A", ids)
    finally:
        _stop(worker)


def test_worker_holds_at_most_worker_max_mb(tmp_path, redis_url, conn, sim_factory):
    sim = sim_factory("--instant", "--enable-return-hidden-states", "--hidden-size", str(HIDDEN))
    cfg = features_config(tmp_path, redis_url, sim, worker_max_mb=0.0001, concurrency=4)
    ids = write_rows(tmp_path / "out", "A", 8)
    worker, log = _info_worker(cfg, tmp_path)
    try:
        res = run_features(cfg)
        assert res.returncode == 0, res.stdout + res.stderr
        check_samples(tmp_path / "out", "A", ids)
    finally:
        _stop(worker)
    text = log.read_text()
    assert "at most 1 holding responses at once" in text, text


def test_follow_captures_rows_as_they_commit(tmp_path, redis_url, conn, sim_factory):
    sim = sim_factory("--instant", "--enable-return-hidden-states", "--hidden-size", str(HIDDEN))
    cfg = features_config(tmp_path, redis_url, sim, shard_mb=0.0001)  # a shard per sample
    out = tmp_path / "out"
    ids = write_rows(out, "A", 6)
    procs = Procs(cfg, tmp_path)
    index = features_dir(out, "A") / "index.jsonl"
    try:
        procs.start("features-worker")
        follower = subprocess.Popen([*PY, "features", "--follow", "-c", str(cfg)], cwd=ROOT, env=dict(os.environ),
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        wait_for(lambda: len(index_rows(index)) == 6, 60, "the first rows' shards")
        ids += write_rows_more(out, "A", 6, 6)
        wait_for(lambda: len(index_rows(index)) == 12, 60, "shards of rows committed later")
        follower.send_signal(signal.SIGINT)
        _, err = follower.communicate(timeout=60)
        assert follower.returncode == 0, err
        check_samples(out, "A", ids)
    finally:
        procs.stop_all()


def test_disk_guard_stops_before_the_volume_fills(tmp_path, monkeypatch):
    from collections import namedtuple

    from budgetq.hidden_states.collect import guard as pf
    from budgetq.producer.run import disk_guard
    from budgetq.shared.config import Config

    cfg = Config.model_validate({"output_dir": str(tmp_path), "min_free_mb": 1, "features": {"concurrency": 2}})
    guard = pf.DiskGuard(cfg)
    assert guard.admit(100, 0, 0, 0, 0) and guard.admit(100, 100, 1, 0, 0)
    assert not guard.admit(100, 200, 2, 0, 0) and guard.reason is None, "waits for a first result"
    guard.learn(100, 100 * 8192)  # 8 KB a token: hidden 4096 in bfloat16
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(disk_guard.shutil, "disk_usage", lambda _p: usage(10 * 2**20, 0, 3 * 2**20))
    assert guard.admit(100, 0, 0, 0, 0), "0.8 MB fits in 3 MB free less 1 MB kept"
    assert not guard.admit(100, 200, 2, 0, 0)
    assert guard.reason is not None and "would fill" in guard.reason and "(min_free_mb)" in guard.reason
    assert not guard.admit(1, 0, 0, 0, 0), "stopped stays stopped"


def test_aux_server_answers_are_kept_as_aux_hidden_state(tmp_path, redis_url, conn, sim_factory):
    """features.server.aux_urls (a server with --enable-return-aux-hidden-states): each sample also gets
    the three EAGLE-3 layers, [tokens, 3 x hidden], aligned with its tokens, and the offline export has them."""
    from budgetq.hidden_states.collect.export import offline_samples
    from budgetq.simulator.hidden import aux_vectors

    main = sim_factory("--instant", "--enable-return-hidden-states", "--hidden-size", str(HIDDEN))
    aux = sim_factory("--instant", "--enable-return-aux-hidden-states", "--hidden-size", str(HIDDEN))
    cfg = features_config(tmp_path, redis_url, main)
    raw = yaml.safe_load(cfg.read_text())
    raw["features"]["server"]["aux_urls"] = [aux]
    cfg.write_text(yaml.safe_dump(raw))
    out = tmp_path / "out"
    ids = write_rows(out, "A", 5)
    res = run_features_with_a_worker(cfg, tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    rows = check_samples(out, "A", ids)
    d = features_dir(out, "A")
    for r in rows:
        assert r["aux_shape"] == [len(r["input_ids"]), 3 * HIDDEN]
        t = read_tensor(d / r["shard"], f"{r['key']}.aux_hidden_state")
        want = aux_vectors(np.array(r["input_ids"]), np.arange(len(r["input_ids"])), HIDDEN, 3)
        assert np.array_equal(from_dtype(t.data, r["dtype"], t.shape), want)
    assert all(s.aux_hidden_state is not None and s.aux_hidden_state[1] == [1, s.input_ids.size, 3 * HIDDEN]
               for s in offline_samples(out, "A"))
    assert run_features(cfg, "--check").returncode == 0


def test_a_plain_rq_worker_runs_a_features_job(tmp_path, redis_url, conn, sim_factory):
    """The fallback: `rq worker` (JSON serializer) runs the job function one job at a time; the pass collects."""
    from budgetq.hidden_states.collect.features_pass import FeaturesPass
    from budgetq.shared.config_load import load_config

    sim = sim_factory("--instant", "--enable-return-hidden-states", "--hidden-size", str(HIDDEN))
    cfg = features_config(tmp_path, redis_url, sim, concurrency=3)
    ids = write_rows(tmp_path / "out", "A", 3)
    fp = FeaturesPass(load_config(cfg), conn)
    fp._enqueue(fp.passes[0])
    fp.release()
    stock_rq_worker(redis_url, keys.features_queue_name("A"), cfg, tmp_path / "rq-worker.log")
    assert conn.xlen(keys.features_results_key("A")) == 3
    res = run_features(cfg)
    assert res.returncode == 0, res.stdout + res.stderr
    check_samples(tmp_path / "out", "A", ids)


def test_one_collector_per_dataset(tmp_path, redis_url, conn):
    from budgetq.hidden_states.collect.features_pass import FeaturesPass
    from budgetq.shared.config_load import load_config
    from budgetq.shared.errors import BudgetqError

    cfg = load_config(features_config(tmp_path, redis_url, "http://127.0.0.1:9"))
    first = FeaturesPass(cfg, conn)
    with pytest.raises(BudgetqError, match="another `budgetq features` is running"):
        FeaturesPass(cfg, conn)
    first.release()
    FeaturesPass(cfg, conn).release()
    conn.set(keys.features_lock_key("A"), f"{os.uname().nodename}:999999999:abc")  # a pass that died here
    FeaturesPass(cfg, conn).release()
