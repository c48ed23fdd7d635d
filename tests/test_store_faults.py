"""Faults in the hidden-states store, put where they are claimed to be (hidden_states/store/fault_points.py).

A real features run (`budgetq features` + `budgetq features-worker` against `budgetq sim
--enable-return-hidden-states`) is SIGKILLed at each named step of a shard's way: the worker (features.store)
after its ``.tmp`` is written, after the rename, before its index message; the collector after its own ``.tmp``,
after its rename, before the index rows. Each test shows the kill landed there (the process's own last line,
and what is on disk and in Redis at that moment), then restarts what was killed and checks the work was redone
exactly once: each id indexed once, in one shard, bit for bit the simulator's vectors, no ``.tmp`` left, no
orphan shard, the results stream emptied.

Then a store that fails to write (ENOSPC, once or longer than a job's tries): the job is retried or handed back,
never failed for good, no ``.tmp`` stays, and the worker says so in one line; and an index message whose shard
name is not one a worker makes (``../x``, an absolute path) is refused without touching the file it names.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import signal
import subprocess
from pathlib import Path

import pytest

from budgetq.hidden_states.store import fault_points, safetensors_io
from budgetq.hidden_states.store.safetensors_io import read_header
from budgetq.hidden_states.store.shards import (
    INCOMING,
    WORKER_SHARD_NAME,
    FeatureStore,
    features_dir,
    index_rows,
    write_sample_shard,
)
from budgetq.shared import keys
from tests.helpers import PY, ROOT, Procs
from tests.test_features import HIDDEN, check_samples, features_config, run_features, write_rows
from tests.test_features_store import _meta, exactly_once, store_config

ROWS = 6


def _complete_shard(path: Path) -> list[dict]:
    """The samples of a whole shard file (its header parses and its tensors end where the file does)."""
    header, start = read_header(path)
    end = max(v["data_offsets"][1] for k, v in header.items() if k != "__metadata__")
    assert path.stat().st_size == start + end, f"{path.name} is a whole shard"
    return json.loads(header["__metadata__"]["samples"])


def _samples_in(shards: list[Path]) -> list[dict]:
    return [x for s in shards for x in _complete_shard(s)]


def _killed_at(p: subprocess.Popen, log: Path, point: str, timeout: float = 90) -> str:
    """The process died of SIGKILL, and its last line says the kill was fault point ``point``'s."""
    assert p.wait(timeout) == -signal.SIGKILL, log.read_text()
    text = log.read_text()
    assert text.rstrip().splitlines()[-1].startswith(f"budgetq fault point {point}: SIGKILL"), text[-2000:]
    return text


def _spawn(args: list[str], cfg: Path, log: Path, point: str | None) -> subprocess.Popen:
    env = dict(os.environ)
    env.pop(fault_points.ENV, None)
    if point:
        env[fault_points.ENV] = point
    with open(log, "w") as fh:
        return subprocess.Popen([*PY, *args, "-c", str(cfg)], cwd=ROOT, env=env, stdout=fh, stderr=subprocess.STDOUT)


def _wait_or_kill(p: subprocess.Popen, timeout: float) -> int:
    try:
        return p.wait(timeout)
    finally:
        _kill(p)


def _kill(*ps: subprocess.Popen | None) -> None:
    """Whatever a failed assertion left running (a victim the fault point never killed, a pass)."""
    for p in ps:
        if p is not None and p.poll() is None:
            p.kill()
            p.wait()


@pytest.mark.parametrize("point", [fault_points.SHARD_TMP_WRITTEN, fault_points.SHARD_RENAMED,
                                   fault_points.BEFORE_INDEX_MESSAGE])
def test_a_features_worker_killed_at_each_step_of_its_shard(tmp_path, redis_url, conn, sim_factory, point):
    sim = sim_factory("--instant", "--enable-return-hidden-states", "--hidden-size", str(HIDDEN))
    cfg, store = store_config(tmp_path, redis_url, sim, concurrency=1)
    ids = write_rows(tmp_path / "out", "A", ROWS)
    d = features_dir(store, "A")
    victim = _spawn(["features-worker"], cfg, tmp_path / "victim.log", point)
    runner = _spawn(["features"], cfg, tmp_path / "pass.log", None)
    procs = Procs(cfg, tmp_path)
    try:
        _killed_at(victim, tmp_path / "victim.log", point)
        tmps = list((d / INCOMING).glob("*"))
        shards = list(d.glob("*.safetensors"))
        assert not index_rows(d / "index.jsonl") and conn.xlen(keys.features_results_key("A")) == 0, \
            "no index message was sent, nothing indexed"
        if point == fault_points.SHARD_TMP_WRITTEN:
            assert not shards and len(tmps) == 1, (shards, tmps)
            assert tmps[0].name.endswith(".safetensors.tmp") and WORKER_SHARD_NAME.fullmatch(tmps[0].name[:-4])
            (sample,) = _complete_shard(tmps[0])      # written and fsynced, never renamed
        else:   # renamed (and, before-index-message: the engine's files gone; the sim's backend has none)
            assert not tmps and len(shards) == 1, (shards, tmps)
            assert WORKER_SHARD_NAME.fullmatch(shards[0].name)
            (sample,) = _complete_shard(shards[0])
        assert sample["id"] in ids
        procs.start("features-worker")    # the victim's job: its lease lapses, the pass requeues it, this one runs it
        assert _wait_or_kill(runner, 120) == 0, (tmp_path / "pass.log").read_text()
    finally:
        _kill(victim, runner)
        procs.stop_all()
    check_samples(store, "A", ids)     # every id indexed once, bit for bit the simulator's vectors
    exactly_once(store, ids)           # each in one shard, no orphan shard, incoming/ (the .tmp) emptied
    assert not list(d.rglob("*.tmp"))
    assert conn.zcard(f"rq:finished:{keys.features_queue_name('A')}") == ROWS, "each job finished once"
    assert conn.xlen(keys.features_results_key("A")) == 0
    res = run_features(cfg, "--check")
    assert res.returncode == 0 and "consistent" in res.stdout, res.stdout + res.stderr


@pytest.mark.parametrize(("point", "store_mode"), [
    (fault_points.SHARD_TMP_WRITTEN, False), (fault_points.SHARD_RENAMED, False),
    (fault_points.BEFORE_INDEX_ROWS, False), (fault_points.BEFORE_INDEX_ROWS, True)],
    ids=["shard-tmp-written", "shard-renamed", "before-index-rows", "before-index-rows-store"])
def test_the_collector_killed_at_each_step_of_its_shards(tmp_path, redis_url, conn, sim_factory, point, store_mode):
    """Without features.store the collector writes the shards from the results stream; with it, it only indexes
    the workers' shards. Killed at each step, a second pass finishes the job with each id once."""
    sim = sim_factory("--instant", "--enable-return-hidden-states", "--hidden-size", str(HIDDEN))
    if store_mode:
        cfg, root = store_config(tmp_path, redis_url, sim, concurrency=2)
    else:
        cfg, root = features_config(tmp_path, redis_url, sim, concurrency=2), tmp_path / "out"
    ids = write_rows(tmp_path / "out", "A", ROWS)
    d = features_dir(root, "A")
    procs = Procs(cfg, tmp_path)
    victim = None
    try:
        procs.start("features-worker")
        victim = _spawn(["features"], cfg, tmp_path / "victim.log", point)
        _killed_at(victim, tmp_path / "victim.log", point)
        shards = sorted(d.glob("*.safetensors"))
        tmps = sorted(d.glob("*.tmp"))
        assert not index_rows(d / "index.jsonl"), "killed before any index row"
        in_stream = conn.xlen(keys.features_results_key("A"))
        assert in_stream > 0, "what was not indexed is still in the results stream"
        if point == fault_points.SHARD_TMP_WRITTEN:
            assert not shards and len(tmps) == 1 and tmps[0].name == "000000.safetensors.tmp", (shards, tmps)
            assert _complete_shard(tmps[0])
        elif store_mode:
            assert not tmps and shards and all(WORKER_SHARD_NAME.fullmatch(s.name) for s in shards)
        else:
            assert not tmps and [s.name for s in shards] == ["000000.safetensors"]
            assert _complete_shard(shards[0])
        res = run_features(cfg)
        assert res.returncode == 0, res.stdout + res.stderr
        repaired = re.search(r"repaired after a crash: (\d+) unfinished shard writes removed, (\d+) samples indexed",
                             res.stderr)
        assert repaired, res.stderr
        if point == fault_points.SHARD_TMP_WRITTEN:
            assert repaired.groups() == ("1", "0"), "the .tmp removed at opening"
        elif store_mode:   # the worker went on writing shards meanwhile: those are indexed at opening too
            assert repaired.group(1) == "0" and int(repaired.group(2)) >= len(_samples_in(shards)), res.stderr
        else:
            assert repaired.groups() == ("0", str(len(_samples_in(shards)))), "the killed pass's shard indexed"
    finally:
        _kill(victim)
        procs.stop_all()
    check_samples(root, "A", ids)
    if store_mode:
        exactly_once(root, ids)
    else:
        rows = index_rows(d / "index.jsonl")
        assert {r["shard"] for r in rows} == {p.name for p in d.glob("*.safetensors")}, "no orphan shard"
    assert not list(d.rglob("*.tmp")), "the killed write's .tmp is removed"
    assert conn.xlen(keys.features_results_key("A")) == 0
    assert int(conn.get(keys.features_pending_key("A")) or 0) == 0
    res = run_features(cfg, "--check")
    assert res.returncode == 0 and "consistent" in res.stdout, res.stdout + res.stderr


# -- a store that fails to write ------------------------------------------------------------------------------

def test_a_write_that_fails_removes_its_tmp(tmp_path, monkeypatch):
    """ENOSPC at the fsync (the data did not fit): the OSError reaches the caller and no .tmp is left to fill
    the volume further."""
    d = features_dir(tmp_path, "A")
    d.mkdir(parents=True)

    def full(_fd: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(safetensors_io.os, "fsync", full)
    meta, data = _meta("p0")
    with pytest.raises(OSError) as got:
        write_sample_shard(d, meta, data, None)
    assert got.value.errno == errno.ENOSPC
    assert not list(d.rglob("*.tmp")) and not list(d.glob("*.safetensors"))


def _operator_lines(log: str) -> list[str]:
    """What a features worker logged at WARNING or above about features.store."""
    return [ln for ln in log.splitlines() if re.search(r" (WARNING|ERROR|CRITICAL) ", ln) and "features.store" in ln]


@pytest.mark.parametrize("failures", [1, 5], ids=["once", "longer-than-a-jobs-tries"])
def test_a_full_store_costs_retries_not_the_job(tmp_path, redis_url, conn, sim_factory, monkeypatch, failures):
    """``shard-tmp-written:ENOSPC:<n>``: the first n shard writes of the worker fail with ENOSPC after their
    .tmp is written. Once: the write is tried again and the job ends written. Five (more than STORE_WRITE_TRIES):
    the job goes back to its queue, the worker pauses its claims, then writes it. Either way every id is
    written once, the job never fails, no .tmp stays, and the operator reads one line (two when a job was
    handed back)."""
    from budgetq.hidden_states.capture.features_worker import STORE_WRITE_TRIES

    sim = sim_factory("--instant", "--enable-return-hidden-states", "--hidden-size", str(HIDDEN))
    cfg, store = store_config(tmp_path, redis_url, sim, concurrency=1)
    ids = write_rows(tmp_path / "out", "A", 4)
    monkeypatch.setenv(fault_points.ENV, f"{fault_points.SHARD_TMP_WRITTEN}:ENOSPC:{failures}")
    procs = Procs(cfg, tmp_path)
    try:
        worker = procs.start("features-worker")
        monkeypatch.delenv(fault_points.ENV)
        res = run_features(cfg, "--json")
        assert res.returncode == 0, res.stdout + res.stderr
    finally:
        procs.stop_all()
    exactly_once(store, ids)
    check_samples(store, "A", ids)
    assert not list(features_dir(store, "A").rglob("*.tmp"))
    assert conn.zcard(f"rq:failed:{keys.features_queue_name('A')}") == 0, "no job failed"
    assert conn.zcard(f"rq:finished:{keys.features_queue_name('A')}") == 4
    lines = _operator_lines(Procs.log(worker))
    handed_back = failures >= STORE_WRITE_TRIES
    assert len(lines) == 1 + handed_back, lines
    assert "No space left on device" in lines[0] and "features.store" in lines[0]
    if handed_back:
        assert "handed back" in lines[1]
    assert "Traceback" not in Procs.log(worker)


def test_an_index_message_naming_a_path_outside_the_store_touches_nothing(tmp_path, caplog):
    """The shard name of an index message comes from Redis: ``../x``, an absolute path or any name a worker does
    not make is refused in one line, and the file it names is neither deleted (as a second copy) nor indexed."""
    d = features_dir(tmp_path / "store", "A")
    d.mkdir(parents=True)
    store = FeatureStore(tmp_path / "store", "A", shard_bytes=10**9)
    meta, data = _meta("p0")
    name, size = write_sample_shard(d, meta, data, None)
    assert store.adopt(meta.model_copy(update={"shard": name, "shard_bytes": size})) == "new"
    store.flush()
    victim = tmp_path / "victim.safetensors"       # outside the store
    victim.write_bytes(b"keep me")
    outside = os.path.relpath(victim, d)
    for bad in (outside, str(victim), "../index.jsonl", "w-0123456789abcdef.safetensors/../../x", "/etc/passwd"):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="budgetq.features"):
            # an id already indexed: a well-named second copy would be deleted by this name
            assert store.adopt(meta.model_copy(update={"shard": bad})) == "refused", bad
            # a new id: a well-named shard would be indexed
            assert store.adopt(meta.model_copy(update={"id": "p1", "shard": bad})) == "refused", bad
        assert [r.levelno for r in caplog.records] == [logging.ERROR] * 2, caplog.text
        assert bad in caplog.records[0].getMessage() or repr(bad) in caplog.records[0].getMessage()
        assert victim.read_bytes() == b"keep me" and (d / name).exists()
    assert store.flush() == []
    assert [r["id"] for r in index_rows(d / "index.jsonl")] == ["p0"]
