"""Disk as a budget for hidden states: features.max_bytes split across the datasets by weight (water-filled
as the token budgets are), bytes per token from the model's config, bytes written counted once in Redis, and
a real `budgetq features` pass whose datasets stop capturing at their shares; and one features.max_bytes for
the run, whatever the passes (one after the other, at once, a dataset done before another starts)."""

from __future__ import annotations

import json
import subprocess

import pytest
import yaml

from budgetq.hidden_states.collect.features_pass import SAMPLE_HEADER_BYTES
from budgetq.hidden_states.store.shards import features_dir, index_rows
from budgetq.producer.run.allocation import byte_shares
from budgetq.shared import features_bytes, keys
from budgetq.shared.config_load import load_config
from budgetq.shared.scripts import run
from tests.helpers import PY, ROOT, Procs
from tests.test_features import HIDDEN, features_config, run_features, run_features_with_a_worker, write_rows


def test_the_byte_budget_is_split_by_weight_and_water_filled():
    w = {"a": 1.0, "b": 3.0}
    assert byte_shares(4000, w, {"a": None, "b": None}, {}) == {"a": 1000, "b": 3000}
    # b capped by its own features_max_bytes: what it cannot use goes to a
    assert byte_shares(4000, w, {"a": None, "b": 1500}, {}) == {"a": 2500, "b": 1500}
    # a has written more than its weighted share already: its share is what it wrote, b gets the rest
    assert byte_shares(4000, w, {"a": None, "b": None}, {"a": 1800}) == {"a": 1800, "b": 2200}
    # three datasets, one capped, the rest by weight; the shares add up to the total exactly
    s = byte_shares(10**12, {"a": 1, "b": 1, "c": 2}, {"a": 10**11, "b": None, "c": None}, {})
    assert s == {"a": 10**11, "b": 3 * 10**11, "c": 6 * 10**11} and sum(s.values()) == 10**12
    # no total: each dataset's own cap, None unbounded
    assert byte_shares(None, w, {"a": 5000, "b": None}, {"a": 9}) == {"a": 5000, "b": None}


def test_bytes_per_token_and_the_worked_example():
    # the motivating run: hidden 7168, 4 layers (target + 3 aux), bf16 = 57 KB a token, 92M tokens ~5.3 TB
    bf16 = features_bytes.bytes_per_token(7168, 4, "bfloat16")
    assert bf16 == 7168 * 4 * 2 + 5
    assert features_bytes.format_bytes(92_000_000 * bf16) == "5.28 TB"
    fp8 = features_bytes.bytes_per_token(7168, 4, "fp8")
    assert fp8 == 7168 * 4 + 4 * 4 + 5 and 0.5 < fp8 / bf16 < 0.501
    assert features_bytes.bytes_per_token(576, 1, "float16") == 576 * 2 + 5


def test_bytes_per_token_from_the_models_config(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"hidden_size": 576, "num_hidden_layers": 30}))
    raw = {"datasets": [{"name": "a", "path": str(tmp_path / "a.jsonl"), "budget": "1M"}],
           "server": {"urls": ["http://127.0.0.1:9"]},
           "features": {"backend": "transformers", "model": {"path": str(model)}}}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(raw))
    cfg = load_config(tmp_path / "c.yaml")
    assert features_bytes.model_shape(cfg) == (576, 30) and features_bytes.stored_layers(cfg) == 4
    assert features_bytes.config_bytes_per_token(cfg) == 4 * 576 * 2 + 5
    raw["features"]["model"]["aux_layers"] = []     # the last layer only
    raw["features"]["dtype"] = "fp8"
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(raw))
    assert features_bytes.config_bytes_per_token(load_config(tmp_path / "c.yaml")) == 576 + 4 + 5


def test_bytes_written_are_counted_once_per_sample(conn):
    call = features_bytes.mark_done("A", [("p1", 100, 10), ("p2", 50, 5)])
    assert run(conn, call) == 150
    assert run(conn, call) == 150, "a retried flush counts nothing twice"
    assert run(conn, features_bytes.mark_done("A", [("p2", 50, 5), ("p3", 7, 1)])) == 157
    assert features_bytes.read(conn, ["A", "B"]) == {"A": {"bytes_written": 157, "tokens": 16, "max_bytes": None,
                                                           "stop": None}}
    assert conn.scard(keys.features_done_key("A")) == 3


def _two_datasets(tmp_path, redis_url, sim, store: bool) -> tuple:
    cfg = features_config(tmp_path, redis_url, sim, max_bytes=8000, concurrency=2)
    raw = yaml.safe_load(cfg.read_text())
    raw["datasets"] = [{"name": "A", "path": str(tmp_path / "none.jsonl"), "budget": "1k", "weight": 1},
                       {"name": "B", "path": str(tmp_path / "none.jsonl"), "budget": "1k", "weight": 3}]
    root = tmp_path / "out"
    if store:
        raw["features"]["store"] = str(tmp_path / "store")
        root = tmp_path / "store"
    cfg.write_text(yaml.safe_dump(raw))
    return cfg, root


@pytest.mark.parametrize("store", [False, True], ids=["redis-stream", "features-store"])
def test_each_dataset_stops_capturing_at_its_share(tmp_path, redis_url, conn, sim_factory, store):
    """features.max_bytes 8000 over A (weight 1) and B (weight 3): A stops near 2000 bytes, B near 6000, each
    with its one-line reason; Redis counts exactly the bytes on disk; status shows them against the shares."""
    sim = sim_factory("--instant", "--enable-return-hidden-states", "--hidden-size", str(HIDDEN))
    cfg, root = _two_datasets(tmp_path, redis_url, sim, store)
    write_rows(tmp_path / "out", "A", 40)
    write_rows(tmp_path / "out", "B", 40)
    res = run_features_with_a_worker(cfg, tmp_path)
    assert res.returncode == 1, res.stdout + res.stderr
    lines = [ln for ln in res.stderr.splitlines() if "disk budget reached" in ln]
    assert any("dataset A: disk budget reached: its share is 2000 bytes (features.max_bytes 8000 split by weight)"
               in ln for ln in lines), res.stderr
    assert any("dataset B: disk budget reached: its share is 6000 bytes" in ln for ln in lines), res.stderr
    seen = features_bytes.read(conn, ["A", "B"])
    for name, share in (("A", 2000), ("B", 6000)):
        d = features_dir(root, name)
        on_disk = sum(p.stat().st_size for p in d.glob("*.safetensors"))
        n = len(index_rows(d / "index.jsonl"))
        assert 0 < n < 40, (name, n)
        assert on_disk <= share * 1.5, "at most the bytes-per-token estimate's error past the share"
        assert seen[name]["bytes_written"] == on_disk, "counted in Redis exactly as on disk"
        assert seen[name]["max_bytes"] == share and "disk budget reached" in seen[name]["stop"]
    assert seen["B"]["bytes_written"] > 2 * seen["A"]["bytes_written"]
    status = subprocess.run([*PY, "status", "-c", str(cfg), "--json"], cwd=ROOT, capture_output=True, text=True,
                            timeout=60)
    assert status.returncode == 0, status.stderr
    snap = json.loads(status.stdout)
    assert snap["features"]["A"]["max_bytes"] == 2000 and snap["features"]["B"]["bytes_written"] > 0
    text = subprocess.run([*PY, "status", "-c", str(cfg)], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert "disk budget reached" in text.stdout and "2.00 KB" in text.stdout, text.stdout
    res = run_features(cfg, "--check")
    assert res.returncode == 0, res.stdout + res.stderr


def test_plan_shows_bytes_per_token_what_the_budgets_take_and_the_disk_budgets(tmp_path):
    from budgetq.producer.ops.plan import format_plan, make_plan

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"hidden_size": 576, "num_hidden_layers": 30}))
    rows = tmp_path / "a.jsonl"
    rows.write_text("".join(json.dumps({"prompt": f"hello {i}"}) + "\n" for i in range(2000)))
    raw = {"redis_url": "redis://127.0.0.1:1/0", "server": {"urls": ["http://127.0.0.1:9"], "tokenizer": str(model)},
           "run": {"total_budget": "1M"},
           "features": {"backend": "transformers", "model": {"path": str(model)}, "max_bytes": "4G"},
           "datasets": [{"name": "chat", "path": str(rows), "weight": 3, "capture": "features"},
                        {"name": "code", "path": str(rows), "weight": 1, "capture": "features",
                         "features_max_bytes": "500M"}]}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(raw))
    p = make_plan(load_config(tmp_path / "c.yaml"), timeout_s=0.2)
    by = {r.name: r for r in p.rows}
    assert by["chat"].bytes_per_token == by["code"].bytes_per_token == 4 * 576 * 2 + 5
    assert by["chat"].features_bytes == by["chat"].budget * 4613
    assert by["code"].disk_budget == 500_000_000 and by["chat"].disk_budget == 3_500_000_000
    assert [t["hidden"] for t in p.disk_table] == [576, 4096, 7168]
    assert p.disk_table[2]["bf16_per_token"] == 57349 and p.disk_table[0]["model"]
    text = format_plan(p)
    assert "chat: 4,613 bytes/token" in text and "disk budget 3.50 GB" in text
    assert "7168        57,349" in text


def _cfg(tmp_path, names_weights, max_bytes="8000"):
    raw = {"redis_url": "redis://127.0.0.1:1/0", "server": {"urls": ["http://127.0.0.1:9"]},
           "features": {"max_bytes": max_bytes},
           "datasets": [{"name": n, "path": str(tmp_path / "a.jsonl"), "budget": "1k", "weight": w}
                        for n, w in names_weights]}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(raw))
    return load_config(tmp_path / "c.yaml")


def test_a_pass_over_some_datasets_splits_only_what_the_run_has_left(tmp_path, conn):
    """One features.max_bytes for the run: a pass over A holds B's weighted share (B has not started), counts
    what B wrote (another pass, another process: Redis), and gets the rest once B is done."""
    from budgetq.hidden_states.collect.byte_budget import ByteBudget

    cfg = _cfg(tmp_path, [("A", 1), ("B", 3)])
    a = ByteBudget(cfg, conn, ["A"])
    a.sync("A", 0, 0, opening=True)
    a.resplit({"A": 0}, set())
    assert a.shares == {"A": 2000}, "B has not started: its weighted share is held for it"
    assert conn.hget(keys.features_bytes_key("A"), "share") == b"2000"
    b = ByteBudget(cfg, conn, ["B"])       # a second pass (a process of its own in production)
    b.sync("B", 6500, 10, opening=True)   # B wrote past its weighted share: A's share shrinks by as much
    a.resplit({"A": 0}, set())
    assert a.shares == {"A": 1500}
    b.resplit({"B": 6500}, set())
    assert b.shares == {"B": 6500} and sum(a.shares.values()) + 6500 == 8000
    b.sync("B", 1000, 10)                 # (reopened with less on disk) then done: it keeps what it wrote
    b.resplit({"B": 1000}, {"B"})
    assert conn.hget(keys.features_bytes_key("B"), "done") == b"1"
    a.resplit({"A": 0}, set())
    assert a.shares == {"A": 7000}, "a done dataset keeps what it wrote, the rest is A's"
    # a dataset this config never names, registered by another pass of the run, is held its share too
    conn.sadd(keys.FEATURES_BUDGET_DATASETS, "C")
    conn.hset(keys.features_bytes_key("C"), mapping={"written": 0, "weight": 4})
    a.resplit({"A": 0}, set())
    assert a.shares == {"A": 7000 // 5}


def _disk(root, name) -> int:
    d = features_dir(root, name)
    return sum(p.stat().st_size for p in d.glob("*.safetensors")) if d.is_dir() else 0


def _largest_sample(root, names) -> int:
    """The largest sample's bytes on disk (its tensors, ids and mask; its part of the shard header)."""
    biggest = 0
    for name in names:
        d = features_dir(root, name)
        rows = index_rows(d / "index.jsonl") if (d / "index.jsonl").exists() else []
        for r in rows:
            n = r["shape"][0]
            biggest = max(biggest, n * (2 * r["shape"][1] + 5) + SAMPLE_HEADER_BYTES)
    return biggest


def test_passes_one_after_the_other_share_one_max_bytes(tmp_path, redis_url, conn, sim_factory):
    """`features --dataset A` then `features --dataset B`: together within features.max_bytes (+ a sample), not
    max_bytes each; A's share is 2000 (B's 6000 held for it), B's what A left."""
    sim = sim_factory("--instant", "--enable-return-hidden-states", "--hidden-size", str(HIDDEN))
    cfg, root = _two_datasets(tmp_path, redis_url, sim, store=False)
    write_rows(tmp_path / "out", "A", 40)
    write_rows(tmp_path / "out", "B", 60)
    res = run_features_with_a_worker(cfg, tmp_path, "--dataset", "A")
    assert res.returncode == 1 and "dataset A: disk budget reached: its share is 2000 bytes" in res.stderr, res.stderr
    a = _disk(root, "A")
    res = run_features_with_a_worker(cfg, tmp_path, "--dataset", "B")
    assert res.returncode == 1 and "dataset B: disk budget reached" in res.stderr, res.stderr
    b = _disk(root, "B")
    seen = features_bytes.read(conn, ["A", "B"])
    assert seen["B"]["max_bytes"] == 8000 - max(a, 2000), "B splits what A left, not the whole max_bytes"
    assert 0 < a and b > a
    assert a + b <= 8000 + _largest_sample(root, ["A", "B"]), (a, b)


def test_a_done_dataset_leaves_the_rest_to_a_later_pass(tmp_path, redis_url, conn, sim_factory):
    """`features -d A` captures all of A's rows under its share: A is done (Redis says so), and a later
    `features -d B` gets max_bytes less what A wrote, not B's weighted share."""
    sim = sim_factory("--instant", "--enable-return-hidden-states", "--hidden-size", str(HIDDEN))
    cfg, root = _two_datasets(tmp_path, redis_url, sim, store=False)
    write_rows(tmp_path / "out", "A", 1)     # all captured (~1.3 KB), under its 2000: done
    write_rows(tmp_path / "out", "B", 60)
    res = run_features_with_a_worker(cfg, tmp_path, "--dataset", "A")
    assert res.returncode == 0, res.stdout + res.stderr
    a = _disk(root, "A")
    assert 0 < a < 2000 and conn.hget(keys.features_bytes_key("A"), "done") == b"1"
    res = run_features_with_a_worker(cfg, tmp_path, "--dataset", "B")
    assert res.returncode == 1, res.stderr
    assert features_bytes.read(conn, ["B"])["B"]["max_bytes"] == 8000 - a
    assert a + _disk(root, "B") <= 8000 + _largest_sample(root, ["A", "B"])


def test_two_passes_at_once_share_one_max_bytes(tmp_path, redis_url, conn, sim_factory):
    """`features --dataset A` and `features --dataset B` running at the same time (two processes)."""
    sim = sim_factory("--instant", "--enable-return-hidden-states", "--hidden-size", str(HIDDEN))
    cfg, root = _two_datasets(tmp_path, redis_url, sim, store=False)
    write_rows(tmp_path / "out", "A", 60)
    write_rows(tmp_path / "out", "B", 60)
    procs = Procs(cfg, tmp_path)
    try:
        procs.start("features-worker")
        passes = [subprocess.Popen([*PY, "features", "-c", str(cfg), "--dataset", n], cwd=ROOT, text=True,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE) for n in ("A", "B")]
        outs = [p.communicate(timeout=120) for p in passes]
    finally:
        procs.stop_all()
    for p, (_out, err) in zip(passes, outs, strict=True):
        assert p.returncode == 1 and "disk budget reached" in err, err
    a, b = _disk(root, "A"), _disk(root, "B")
    assert a > 0 and b > a
    assert a + b <= 8000 + _largest_sample(root, ["A", "B"]), (a, b)
