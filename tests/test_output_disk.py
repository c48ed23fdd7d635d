"""The output volume: full, read-only, or short of room. Real filesystems (a small tmpfs mounted for
the test; skipped where mount is not allowed) and a real per-process file size limit.

Nothing generated is lost: a write that fails is cut back and its results stay in Redis until
the disk takes them; admissions hold meanwhile (workers stop reserving) and the operator reads
one line, never a traceback.
"""

from __future__ import annotations

import errno
import json
import os
import resource
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from budgetq.producer.run.collector import Collector
from budgetq.shared import budget, keys
from budgetq.shared.budget import Admission
from budgetq.shared.config import DatasetConfig
from budgetq.shared.config_load import load_config
from budgetq.shared.errors import BudgetqError
from budgetq.shared.scripts import run
from budgetq.shared.status import snapshot
from tests.helpers import CLI, ROOT, check_invariants, rows, wait_for, write_config, write_dataset

HELD = "admissions held"
MB = 2**20


def _mount(point: Path, size: str, *opts: str) -> None:
    point.mkdir(parents=True, exist_ok=True)
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", ",".join([f"size={size}", *opts]), "tmpfs", str(point)],
                         capture_output=True, text=True)
    if res.returncode != 0:
        pytest.skip(f"mounting a tmpfs is not allowed here ({res.stderr.strip()})")


@pytest.fixture
def volume(tmp_path):
    """mount(size, *options) -> a fresh tmpfs under tmp_path; unmounted after the test."""
    mounted: list[Path] = []

    def mount(size: str, *opts: str) -> Path:
        point = tmp_path / f"vol{len(mounted)}"
        _mount(point, size, *opts)
        mounted.append(point)
        return point

    yield mount
    for point in mounted:
        subprocess.run(["umount", "-l", str(point)], capture_output=True)


def fill(volume: Path, leave: int = 0) -> Path:
    """Take the volume's free space (all of it, or all but ``leave`` bytes) with one file."""
    filler = volume / "filler"
    with open(filler, "wb") as fh:
        try:
            while True:
                free = os.statvfs(volume).f_bavail * os.statvfs(volume).f_frsize - leave
                if free <= 0:
                    break
                fh.write(b"\0" * min(free, MB))
                fh.flush()
        except OSError as exc:
            assert exc.errno == errno.ENOSPC
    return filler


def _results(conn, ds: str, n: int, start: int = 0) -> list[str]:
    ids = [f"p{i}" for i in range(start, start + n)]
    for pid in ids:
        conn.xadd(keys.results_key(ds), {"row": json.dumps({"id": pid, "text": "x" * 200, "completion_tokens": 3})})
    return ids


# -- the collector: a failed write leaves the files as they were, the results in Redis ------------------

def test_a_write_over_the_file_size_limit_is_cut_back_and_written_later(tmp_path, conn):
    """RLIMIT_FSIZE (no privileges needed): the kernel refuses the write with EFBIG mid-batch."""
    out = tmp_path / "out"
    col = Collector(conn, out, ["A"])
    _results(conn, "A", 5)
    assert col.drain() == 5
    path = out / "A.jsonl"
    before = path.read_bytes()
    ids = _results(conn, "A", 50, start=5)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (len(before) + 1000, hard))  # room for ~4 of the 50 rows
    try:
        with pytest.raises(OSError) as caught:
            col.drain()
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert caught.value.errno == errno.EFBIG
    assert path.read_bytes() == before, "the partial batch was cut back"
    assert conn.xlen(keys.results_key("A")) == 50, "nothing trimmed past what is on disk"
    assert col.drain() == 50
    assert [r["id"] for r in rows(path)] == [f"p{i}" for i in range(5)] + ids


def test_collector_on_a_full_tmpfs_keeps_results_in_redis(volume, conn):
    vol = volume("1m")
    out = vol / "out"
    col = Collector(conn, out, ["A"])
    filler = fill(vol, leave=8192)
    ids = _results(conn, "A", 200)   # ~50 KB: more than is left
    with pytest.raises(OSError) as caught:
        col.drain()
    assert caught.value.errno == errno.ENOSPC
    on_disk = [r["id"] for r in rows(out / "A.jsonl")]
    assert conn.xlen(keys.results_key("A")) == 200 - len(on_disk)
    filler.unlink()
    col.drain()
    got = [r["id"] for r in rows(out / "A.jsonl")]
    assert got == ids and conn.xlen(keys.results_key("A")) == 0


# -- the guard: low space holds admissions, in the producer and in reserve.lua ---------------------------

def test_guard_holds_below_min_free_and_reserve_answers_paused(volume, conn, caplog):
    from budgetq.producer.run.disk_guard import OutputGuard

    vol = volume("8m")
    ds = DatasetConfig.model_validate({"name": "A", "path": "x.jsonl", "budget": 10_000})
    budget.register_dataset(conn, ds)
    guard = OutputGuard(conn, vol, min_free_mb=2, datasets=["A"])
    assert guard.admitting()
    guard.sync()
    filler = fill(vol, leave=MB)
    assert not guard.admitting() and guard.held
    guard.sync()
    assert b"under min_free_mb 2" in conn.hget(keys.conf_key("A"), "hold")
    assert run(conn, budget.reserve("A", "A-j1", 100, 0)).status is Admission.PAUSED
    assert budget.dataset_state(conn, "A").paused, "workers stop claiming from a held dataset"
    assert not guard.admitting()
    assert sum(HELD in r.getMessage() for r in caplog.records) == 1, "one line, not one per tick"
    filler.unlink()
    assert guard.admitting() and not guard.held
    guard.sync()
    assert conn.hget(keys.conf_key("A"), "hold") is None
    assert run(conn, budget.reserve("A", "A-j1", 100, 0)).status is Admission.ADMIT


# -- before anything is written to Redis ------------------------------------------------------------------

def test_preflight_names_the_directory_and_the_reason(tmp_path):
    from budgetq.producer.run.disk_guard import preflight

    afile = tmp_path / "afile"
    afile.write_text("x")
    with pytest.raises(BudgetqError, match=r"output_dir .*afile/out: .*not a directory"):
        preflight(afile / "out", 0)
    preflight(tmp_path / "new" / "out", 0)       # creatable: fine (nothing created yet)
    assert not (tmp_path / "new").exists()
    with pytest.raises(BudgetqError, match=r"MB free, under min_free_mb"):
        preflight(tmp_path, 1e12)


def _produce(cfg: Path, *extra: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *extra, "produce", "-c", str(cfg)], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


def _check(cfg: Path) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, "check", "-c", str(cfg), "--timeout-s", "0.5"], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)


@pytest.mark.parametrize("fault", ["read-only", "full"])
def test_unusable_output_dir_fails_in_one_line_before_redis(tmp_path, volume, redis_url, conn, fault):
    write_dataset(tmp_path / "A.jsonl", 5)
    vol = volume("4m", "ro") if fault == "read-only" else volume("4m")
    if fault == "full":
        fill(vol, leave=256 * 1024)   # files can still be created, but under min_free_mb
    cfg = write_config(tmp_path, redis_url, "http://127.0.0.1:9", [
        {"name": "A", "path": str(tmp_path / "A.jsonl"), "budget": "1k", "id_field": "id"}],
        min_free_mb=1)
    raw = yaml.safe_load(cfg.read_text())
    raw["output_dir"] = str(vol / "out")
    cfg.write_text(yaml.safe_dump(raw))
    res = _produce(cfg)
    assert res.returncode == 2, res.stderr
    lines = res.stderr.strip().splitlines()
    reason = "Read-only file system" if fault == "read-only" else "under min_free_mb 1"
    assert len(lines) == 1 and str(vol / "out") in lines[0] and reason in lines[0], res.stderr
    assert conn.dbsize() == 0, "nothing written to Redis"
    chk = _check(cfg)
    assert chk.returncode == 1
    assert f"output_dir {vol / 'out'}: FAILED" in chk.stdout and reason in chk.stdout, chk.stdout


def test_check_says_when_the_estimated_output_does_not_fit(tmp_path, volume, redis_url):
    write_dataset(tmp_path / "A.jsonl", 5000)
    vol = volume("2m")
    cfg = write_config(tmp_path, redis_url, "http://127.0.0.1:9", [
        {"name": "A", "path": str(tmp_path / "A.jsonl"), "budget": "2M", "id_field": "id", "prior_mean_tokens": 400}],
        min_free_mb=0.5)
    raw = yaml.safe_load(cfg.read_text())
    raw["output_dir"] = str(vol / "out")
    cfg.write_text(yaml.safe_dump(raw))
    chk = _check(cfg)
    assert "would not fit" in chk.stdout and chk.returncode == 1, chk.stdout
    report = json.loads(subprocess.run([*CLI, "check", "-c", str(cfg), "--timeout-s", "0.5", "--json"], cwd=ROOT,
                                       capture_output=True, text=True, timeout=60).stdout)
    assert report["output"]["expected_bytes"] > 2 * MB and not report["output"]["ok"]
    load_config(cfg)  # the config itself is fine


# -- the whole pipeline against the simulator: the disk fills mid-run, then space returns ------------------

def _remount(point: Path, mode: str) -> None:
    """Remount rw or ro (ro is refused while the producer has a file open for writing: try again)."""
    def done() -> bool:
        return subprocess.run(["mount", "-o", f"remount,{mode}", str(point)], capture_output=True).returncode == 0
    wait_for(done, 30, f"remount {mode}", every_s=0.05)


@pytest.mark.parametrize("fault", ["full", "read-only", "min_free"])
def test_disk_fault_mid_run_holds_loses_nothing_and_resumes(tmp_path, volume, redis_url, conn, sim_factory, fault):
    sim = sim_factory("--peak-tok-s", "3000", "--length-mean", "30", "--max-running-requests", "4")
    ids = write_dataset(tmp_path / "A.jsonl", 60)
    vol = volume("4m")
    cfg = write_config(tmp_path, redis_url, sim, [
        {"name": "A", "path": str(tmp_path / "A.jsonl"), "budget": "1M", "id_field": "id",
         "sampling": {"max_tokens": 200}}],
        min_free_mb=1 if fault == "min_free" else 0, worker={"concurrency": 4, "control_interval_s": 0.2},
        producer={"high_water": 8})
    raw = yaml.safe_load(cfg.read_text())
    out = vol / "out"
    raw["output_dir"] = str(out)
    cfg.write_text(yaml.safe_dump(raw))
    env = dict(os.environ)
    wlog = open(tmp_path / "worker.log", "w")
    plog = open(tmp_path / "producer.log", "w")
    worker = subprocess.Popen([*CLI, "--log-level", "WARNING", "worker", "-c", str(cfg)], cwd=ROOT, env=env,
                              stdout=wlog, stderr=subprocess.STDOUT)
    prod = subprocess.Popen([*CLI, "produce", "-c", str(cfg)], cwd=ROOT, env=env, stdout=plog,
                            stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: len(rows(out / "A.jsonl")) >= 8, 60, "the first rows on disk")
        if fault == "read-only":
            _remount(vol, "ro")
        else:   # full: not a byte left; min_free: files still take rows, but under min_free_mb
            filler = fill(vol, leave=512 * 1024 if fault == "min_free" else 0)
        log = tmp_path / "producer.log"
        wait_for(lambda: HELD in log.read_text(), 30, "the producer's hold line")
        wait_for(lambda: conn.hget(keys.conf_key("A"), "hold"), 10, "the hold in Redis")
        (d,) = snapshot(conn, redis_url)["datasets"]
        assert d["stop"] == "held" and d["hold"], d   # the stop reason says what holds it, not "running"
        # Workers stop reserving: what is in flight ends (kept in the stream, or written while the
        # volume still takes files), nothing new starts.
        wait_for(lambda: conn.hlen(keys.resv_key("A")) == 0, 30, "requests in flight to end")

        def results() -> tuple[int, int]:
            return len(rows(out / "A.jsonl")), conn.xlen(keys.results_key("A"))
        wait_for(lambda: fault != "min_free" or results()[1] == 0, 10, "results written under min_free_mb")
        before = results()
        time.sleep(1.0)  # several worker control intervals: nothing more may be generated
        assert conn.hlen(keys.resv_key("A")) == 0 and results() == before and 8 <= sum(before) < 60, before
        assert prod.poll() is None
        if fault == "read-only":
            _remount(vol, "rw")
        else:
            filler.unlink()   # space returns
        assert prod.wait(90) == 0, log.read_text()
    finally:
        for p in (prod, worker):
            if p.poll() is None:
                p.terminate()
                p.wait(30)
        wlog.close()
        plog.close()
    text = (tmp_path / "producer.log").read_text()
    assert "Traceback" not in text and "Traceback" not in (tmp_path / "worker.log").read_text()
    held = [line for line in text.splitlines() if HELD in line]
    why = {"full": f"writing {out / 'A.jsonl'} failed: No space left on device",
           "read-only": f"writing {out / 'A.jsonl'} failed: Read-only file system",
           "min_free": "MB free, under min_free_mb 1"}[fault]
    assert len(held) == 1 and why in held[0], held
    assert len([line for line in text.splitlines() if "writable again" in line]) == 1
    got = check_invariants(conn, out, "A", ids)
    assert got["rows"] == 60 and got["committed"] == 60, got   # every row, none twice, used == tokens on disk
    assert conn.hget(keys.conf_key("A"), "hold") is None


def test_results_left_in_redis_are_written_by_the_next_start(tmp_path, volume, redis_url, conn):
    """The producer stopped while the disk was full: the next start (with room) writes them."""
    vol = volume("1m")
    out = vol / "out"
    write_dataset(tmp_path / "A.jsonl", 3)
    cfg = write_config(tmp_path, redis_url, "http://127.0.0.1:9",
                       [{"name": "A", "path": str(tmp_path / "A.jsonl"), "budget": "1k", "id_field": "id"}],
                       min_free_mb=0)
    raw = yaml.safe_load(cfg.read_text())
    raw["output_dir"] = str(out)
    cfg.write_text(yaml.safe_dump(raw))
    conf = load_config(cfg)
    col = Collector(conn, out, ["A"])
    filler = fill(vol)
    _results(conn, "A", 100)
    with pytest.raises(OSError):
        col.drain()
    conn.hset(keys.conf_key("A"), "hold", "disk full")   # as the stopped producer left it
    filler.unlink()
    from budgetq.producer.run.producer import Producer

    p = Producer(conf)
    assert conn.hget(keys.conf_key("A"), "hold") is None, "a new start ends the old hold"
    p._drain()
    assert len(rows(out / "A.jsonl")) == 100 and conn.xlen(keys.results_key("A")) == 0
