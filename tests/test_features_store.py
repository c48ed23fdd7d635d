"""features.store: features workers write their shards into a volume the collector shares, Redis carries only
index messages; every sample ends in exactly one shard whoever is SIGKILLed when (no vLLM needed: the
simulator's http backend, whose vectors are a function of token and position, checked bit for bit).

The vllm backend on a real vLLM server: tests/test_vllm_features.py.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import threading
from pathlib import Path

import numpy as np
import pytest
import redis
import yaml

from budgetq.hidden_states.capture.decode import HiddenStatesError, to_dtype
from budgetq.hidden_states.capture.vllm_backend import read_engine_file, wait_written
from budgetq.hidden_states.capture.vllm_layout import FinalNorm, layout_for, load_final_norm, server_flags
from budgetq.hidden_states.schema import FeaturesMeta, FeaturesPayload
from budgetq.hidden_states.store.safetensors_io import Tensor, read_header, write_atomic
from budgetq.hidden_states.store.shards import (
    CRASH_ENV,
    INCOMING,
    WORKER_CRASH_ENV,
    FeatureStore,
    features_dir,
    index_rows,
    write_sample_shard,
)
from budgetq.shared import keys
from budgetq.shared.errors import ConfigError
from budgetq.simulator.hidden import vectors
from tests.helpers import PY, ROOT, Procs, wait_for
from tests.test_features import HIDDEN, check_samples, features_config, run_features, write_rows


def store_config(tmp_path: Path, redis_url: str, sim: str, **features) -> tuple[Path, Path]:
    """The simulator config of tests/test_features.py with features.store set: (config, store root)."""
    cfg = features_config(tmp_path, redis_url, sim, **features)
    raw = yaml.safe_load(cfg.read_text())
    store = tmp_path / "store"
    raw["features"]["store"] = str(store)
    cfg.write_text(yaml.safe_dump(raw))
    return cfg, store


def exactly_once(store: Path, ids: list[str]) -> None:
    """Each id in one index row and in exactly one shard on disk; nothing left in incoming/."""
    d = features_dir(store, "A")
    rows = index_rows(d / "index.jsonl")
    assert sorted(r["id"] for r in rows) == sorted(ids)
    in_shards = [s["id"] for shard in sorted(d.glob("*.safetensors"))
                 for s in json.loads(read_header(shard)[0]["__metadata__"]["samples"])]
    assert sorted(in_shards) == sorted(ids), "each sample in exactly one shard"
    assert {r["shard"] for r in rows} == {p.name for p in d.glob("*.safetensors")}, "no shard read twice or never"
    assert not list((d / INCOMING).glob("*")), "incoming/ is emptied once no job runs"


def _meta(pid: str, n: int = 4) -> tuple[FeaturesMeta, bytes]:
    ids = list(range(3, 3 + n))
    arr = vectors(np.array(ids), np.arange(n), HIDDEN)
    return (FeaturesMeta(id=pid, dataset="A", input_ids=ids, loss_start=1, loss_end=n, dtype="bfloat16",
                         shape=[n, HIDDEN]), to_dtype(arr, "bfloat16"))


def test_the_store_adopts_worker_shards_once_and_removes_second_copies(tmp_path):
    d = features_dir(tmp_path, "A")
    d.mkdir(parents=True)
    store = FeatureStore(tmp_path, "A", shard_bytes=10**9)
    meta, data = _meta("p0")
    first, size = write_sample_shard(d, meta, data, None)
    second, _ = write_sample_shard(d, meta, data, None)       # the job ran twice
    assert first != second and not list((d / INCOMING).glob("*"))
    assert store.adopt(meta.model_copy(update={"shard": first, "shard_bytes": size})) == "new"
    assert store.adopt(meta.model_copy(update={"shard": second})) == "duplicate"
    assert not (d / second).exists(), "the second copy is removed"
    assert store.adopt(meta.model_copy(update={"shard": "w-00000000deadbeef.safetensors", "id": "p9"})) == "missing"
    assert store.flush() == ["p0"] and store.bytes_on_disk == size
    assert store.adopt(meta.model_copy(update={"shard": first})) == "duplicate" and (d / first).exists(), \
        "the same shard announced again is kept"
    # A worker killed between its rename and its message: two shards nobody announced, one an orphan copy
    m1, d1 = _meta("p1")
    a, _ = write_sample_shard(d, m1, d1, None)
    b, _ = write_sample_shard(d, m1, d1, None)
    again = FeatureStore(tmp_path, "A", shard_bytes=10**9)
    assert again.recovered.reindexed == 1 and again.recovered.duplicates_removed == 1
    assert sorted(r["id"] for r in index_rows(d / "index.jsonl")) == ["p0", "p1"]
    assert len(list(d.glob("*.safetensors"))) == 2 and ((d / a).exists() != (d / b).exists())
    # (a worker killed after writing its .tmp, before the rename: tests/test_store_faults.py kills one there)


class ResultsWatch:
    """Every XADD to a dataset's features results stream as Redis received it (MONITOR: no entry is missed, however
    fast the collector reads and deletes it): the field names of each entry."""

    ARG = re.compile(r'"((?:[^"\\]|\\.)*)"')   # one argument as MONITOR quotes it (\" \\ \xHH escaped)

    def __init__(self, redis_url: str, ds: str) -> None:
        self.key = keys.features_results_key(ds)
        self.entries: list[list[str]] = []
        self._end = f"results-watch-end-{os.getpid()}"
        self._conn = redis.Redis.from_url(redis_url)
        self._mon = redis.Redis.from_url(redis_url, socket_timeout=None).monitor()
        self._mon.__enter__()   # MONITOR is on (its OK read) before anything runs
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        while True:
            raw = self._mon.connection.read_response()
            line = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else str(raw)
            args = self.ARG.findall(line.split("] ", 1)[-1])
            if [a.lower() for a in args[:1]] == ["echo"] and args[1:] == [self._end]:
                return
            if len(args) > 3 and args[0].lower() == "xadd" and args[1] == self.key:
                fields = args[3:]                    # XADD key * f1 v1 f2 v2 ... (ids are always "*" here)
                self.entries.append(fields[0::2])

    def stop(self) -> None:
        self._conn.echo(self._end)
        self._thread.join(30)
        self._mon.__exit__()


def test_store_mode_end_to_end_without_tensor_bytes_in_redis(tmp_path, redis_url, conn, sim_factory):
    sim = sim_factory("--instant", "--enable-return-hidden-states", "--hidden-size", str(HIDDEN))
    cfg, store = store_config(tmp_path, redis_url, sim)
    ids = write_rows(tmp_path / "out", "A", 12)
    watch = ResultsWatch(redis_url, "A")
    procs = Procs(cfg, tmp_path)
    try:
        procs.start("features-worker")
        res = run_features(cfg)
        assert res.returncode == 0, res.stdout + res.stderr
    finally:
        procs.stop_all()
        watch.stop()
    # Each sample reached the collector as one index message: its id and meta, never its tensors (the Redis
    # stream path XADDs a "data" field with the tensor bytes, and "aux" with the aux layers').
    assert len(watch.entries) == 12, watch.entries
    assert all(fields == ["id", "meta"] for fields in watch.entries), watch.entries
    check_samples(store, "A", ids)     # bit for bit the simulator's vectors, aligned with the tokens
    exactly_once(store, ids)
    d = features_dir(store, "A")
    assert all(p.name.startswith("w-") for p in d.glob("*.safetensors")), "the worker wrote the shards"
    assert not features_dir(tmp_path / "out", "A").exists(), "nothing under output_dir"
    res = run_features(cfg, "--check")
    assert res.returncode == 0 and "consistent" in res.stdout, res.stdout + res.stderr
    res = subprocess.run([*PY, "export", "-c", str(cfg), "--format", "specforge-offline", "--out",
                          str(tmp_path / "exp")], cwd=ROOT, capture_output=True, text=True, timeout=120)
    if "install torch" not in res.stderr:
        assert res.returncode == 0, res.stdout + res.stderr
        assert len(list((tmp_path / "exp" / "A.specforge-offline").rglob("*.ckpt"))) == 12


def test_workers_whose_store_is_not_the_collectors_fail_the_pass_saying_why(tmp_path, redis_url, conn,
                                                                            sim_factory):
    """A features worker on a machine without the shared volume writes its shards to a directory of its own:
    each job is sent again once, then the pass ends (it does not send them without end), exit 1, every row
    reported failed with its shard and the fix, and the error logged once, not once per sample."""
    sim = sim_factory("--instant", "--enable-return-hidden-states", "--hidden-size", str(HIDDEN))
    cfg, store = store_config(tmp_path, redis_url, sim)
    ids = write_rows(tmp_path / "out", "A", 5)
    worker_cfg = tmp_path / "worker.yaml"
    raw = yaml.safe_load(cfg.read_text())
    raw["features"]["store"] = str(tmp_path / "elsewhere")
    worker_cfg.write_text(yaml.safe_dump(raw))
    procs = Procs(worker_cfg, tmp_path)
    try:
        procs.start("features-worker")
        res = run_features(cfg)
    finally:
        procs.stop_all()
    assert res.returncode == 1, res.stdout + res.stderr
    failed = [line for line in res.stderr.splitlines() if line.startswith("  failed: ")]
    assert len(failed) == 5 and all("is not in" in line and "features.store must be the collector's directory"
                                    in line for line in failed), res.stderr
    assert sum("is not in" in line for line in res.stderr.splitlines() if "failed: " not in line) == 1, res.stderr
    assert not list(features_dir(store, "A").glob("*.safetensors"))
    # Each job ran twice (sent again once), and no more: the worker's own directory has two shards per row.
    assert len(list(features_dir(tmp_path / "elsewhere", "A").glob("w-*.safetensors"))) == 2 * len(ids)


def test_worker_sigkilled_between_its_shard_and_its_message(tmp_path, redis_url, conn, sim_factory):
    """The first worker writes a shard and dies before its index message; its job's lease lapses, a second
    worker captures it again: the orphan is indexed or removed, never both copies kept."""
    sim = sim_factory("--instant", "--enable-return-hidden-states", "--hidden-size", str(HIDDEN))
    cfg, store = store_config(tmp_path, redis_url, sim, concurrency=1)
    ids = write_rows(tmp_path / "out", "A", 6)
    env = dict(os.environ, **{WORKER_CRASH_ENV: "1"})
    victim = subprocess.Popen([*PY, "features-worker", "-c", str(cfg)], cwd=ROOT, env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    runner = subprocess.Popen([*PY, "features", "-c", str(cfg)], cwd=ROOT, env=dict(os.environ),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    procs = Procs(cfg, tmp_path)
    try:
        assert victim.wait(60) == -signal.SIGKILL
        d = features_dir(store, "A")
        assert len(list(d.glob("w-*.safetensors"))) == 1 and not index_rows(d / "index.jsonl")
        procs.start("features-worker")
        out, err = runner.communicate(timeout=120)
        assert runner.returncode == 0, out + err
    finally:
        if runner.poll() is None:
            runner.kill()
            runner.communicate()
        procs.stop_all()
    check_samples(store, "A", ids)
    exactly_once(store, ids)
    assert run_features(cfg, "--check").returncode == 0


def test_collector_sigkilled_between_shards_and_index_then_anywhere(tmp_path, redis_url, conn, sim_factory):
    """The collector dies right before it indexes adopted shards (BUDGETQ_FEATURES_CRASH_AFTER_SHARD), then is
    SIGKILLed from outside at arbitrary moments; each restart continues, and every sample is indexed once."""
    sim = sim_factory("--enable-return-hidden-states", "--hidden-size", str(HIDDEN), "--prefill-tok-s", "400")
    cfg, store = store_config(tmp_path, redis_url, sim, concurrency=2)
    ids = write_rows(tmp_path / "out", "A", 16)
    index = features_dir(store, "A") / "index.jsonl"
    procs = Procs(cfg, tmp_path)
    try:
        procs.start("features-worker")
        p = subprocess.Popen([*PY, "features", "-c", str(cfg)], cwd=ROOT, env=dict(os.environ, **{CRASH_ENV: "1"}),
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        assert p.wait(120) == -signal.SIGKILL
        assert index_rows(index) == [] and list(features_dir(store, "A").glob("w-*.safetensors"))
        for _ in range(3):   # killed from outside wherever it is, once more index rows are there
            before = len(index_rows(index))
            p = subprocess.Popen([*PY, "features", "-c", str(cfg)], cwd=ROOT, env=dict(os.environ),
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            wait_for(lambda b=before, q=p: len(index_rows(index)) > b or q.poll() is not None, 60, "progress")
            p.kill()
            p.wait()
        res = run_features(cfg)
        assert res.returncode == 0, res.stdout + res.stderr
    finally:
        procs.stop_all()
    check_samples(store, "A", ids)
    exactly_once(store, ids)
    assert int(conn.get(keys.features_pending_key("A")) or 0) == 0
    assert run_features(cfg, "--check").returncode == 0


# -- the vllm backend's pieces, without a server ------------------------------------------
def _model_dir(tmp_path: Path, layers: int = 8, hidden: int = 4, kind: str = "llama") -> Path:
    d = tmp_path / "model"
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps({"num_hidden_layers": layers, "hidden_size": hidden,
                                               "rms_norm_eps": 1e-5, "model_type": kind}))
    w = np.arange(1, hidden + 1, dtype="<f4")
    write_atomic(d / "model.safetensors", [Tensor("model.norm.weight", "F32", [hidden], w.tobytes())], {})
    return d


def test_server_flags_and_layer_ids(tmp_path):
    d = _model_dir(tmp_path, layers=30)
    lay = layout_for(d, None)
    assert lay.aux == [1, 14, 26] and lay.aux_ids == [2, 15, 27] and lay.layer_ids == [2, 15, 27, 30]
    flags = server_flags(d, None, "/mnt/store")
    spec, kv = json.loads(flags[1]), json.loads(flags[3])
    assert flags[0] == "--speculative-config" and flags[2] == "--kv-transfer-config"
    assert spec == {"method": "extract_hidden_states", "num_speculative_tokens": 1,
                    "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": [2, 15, 27, 30]}}}
    assert kv["kv_connector"] == "ExampleHiddenStatesConnector" and kv["kv_role"] == "kv_producer"
    assert kv["kv_connector_extra_config"]["allow_custom_save_path"] is True
    assert layout_for(d, []).layer_ids == [30] and layout_for(d, [0, 29]).layer_ids == [1, 30]
    with pytest.raises(ConfigError, match="aux_layers"):
        layout_for(d, [30])
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml.safe_dump({"features": {"backend": "vllm", "store": str(tmp_path / "s"),
                                                "model": {"path": str(d)}, "server": {"urls": ["http://h:8000"]}},
                                   "datasets": [{"name": "A", "path": "x.jsonl", "budget": "1k"}]}))
    res = subprocess.run([*PY, "features", "-c", str(cfg), "--server-flags"], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    assert res.returncode == 0 and "eagle_aux_hidden_state_layer_ids\":[2,15,27,30]" in res.stdout, res.stderr
    with pytest.raises(ValueError, match="features.backend vllm needs"):
        from budgetq.shared.config import Config

        Config.model_validate({"features": {"backend": "vllm", "model": {"path": str(d)}}})
    with pytest.raises(ValueError, match="features.backend vllm needs features.server.urls"):
        Config.model_validate({"features": {"backend": "vllm", "model": {"path": str(d)}, "store": "/s"}})


def _engine_file(path: Path, ids: list[int], x: np.ndarray) -> None:
    write_atomic(path, [Tensor("hidden_states", "F32", list(x.shape), x.astype("<f4").tobytes()),
                        Tensor("token_ids", "I64", [len(ids)], np.asarray(ids, "<i8").tobytes())], {})


def test_the_engine_file_is_checked_and_the_final_norm_applied(tmp_path):
    d = _model_dir(tmp_path, layers=8, hidden=4)
    lay, norm = layout_for(d, None), load_final_norm(d, 4)   # ids [2, 4, 5, 8]
    assert lay.layer_ids == [2, 4, 5, 8] and norm.weight.tolist() == [1, 2, 3, 4]
    ids = [5, 6, 7]
    x = np.random.default_rng(0).normal(size=(3, 4, 4)).astype(np.float32)
    path = tmp_path / "f.safetensors"
    _engine_file(path, ids, x)
    p = FeaturesPayload(id="a", dataset="A", input_ids=ids, loss_start=1, loss_end=3, dtype="bfloat16")
    from budgetq.hidden_states.capture.decode import from_dtype

    got = read_engine_file(str(path), p, lay, norm)
    last = x[:, 3, :]
    want = last / np.sqrt(np.mean(last**2, -1, keepdims=True) + 1e-5) * np.array([1, 2, 3, 4], np.float32)
    assert np.allclose(from_dtype(got.data, "bfloat16", [3, 4]), want, rtol=1e-2, atol=1e-2)
    assert np.allclose(from_dtype(got.aux, "bfloat16", [3, 12]), x[:, :3, :].reshape(3, 12), rtol=1e-2, atol=1e-2)
    assert got.raw_files == [str(path), str(path) + ".lock"]
    with pytest.raises(HiddenStatesError, match="not the request's"):
        read_engine_file(str(path), p.model_copy(update={"input_ids": [5, 6, 8]}), lay, norm)
    with pytest.raises(HiddenStatesError, match=r"expected \[3, 3, 4\]"):
        read_engine_file(str(path), p, layout_for(d, [1, 3]), norm)
    x[1, 2, 0] = np.nan
    _engine_file(path, ids, x)
    with pytest.raises(HiddenStatesError, match="NaN"):
        read_engine_file(str(path), p, lay, norm)
    with pytest.raises(ConfigError, match="gemma"):
        load_final_norm(_model_dir(tmp_path / "g", kind="gemma2"), 4)
    assert isinstance(norm, FinalNorm)


def test_the_worker_waits_for_the_engines_lock(tmp_path):
    """The engine holds an exclusive flock on <file>.lock while it writes; the reader waits for it."""
    import asyncio
    import fcntl

    path = str(tmp_path / "f.safetensors")
    fd = os.open(path + ".lock", os.O_CREAT | os.O_WRONLY, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)

    async def main() -> None:
        waiting = asyncio.create_task(wait_written(path, 30))
        await asyncio.sleep(0.2)
        assert not waiting.done(), "no reading while the engine writes"
        os.close(fd)                     # the engine's write is done: its lock goes
        await asyncio.wait_for(waiting, 10)
        with pytest.raises(HiddenStatesError, match="file_wait_s"):
            await wait_written(str(tmp_path / "never.safetensors"), 0.1)

    asyncio.run(main())
