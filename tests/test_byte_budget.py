"""Disk as a budget for hidden states: features.max_bytes split across the datasets by weight (water-filled
as the token budgets are), bytes per token from the model's config, bytes written counted once in Redis, and
a real `budgetq features` pass whose datasets stop capturing at their shares."""

from __future__ import annotations

import json
import subprocess

import pytest
import yaml

from budgetq.hidden_states.store.shards import features_dir, index_rows
from budgetq.producer.run.allocation import byte_shares
from budgetq.shared import features_bytes, keys
from budgetq.shared.config_load import load_config
from budgetq.shared.scripts import run
from tests.helpers import PY, ROOT
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
