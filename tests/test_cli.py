"""The operator commands, run as a user would (subprocess) against a real Redis."""

import json
import subprocess
import sys
from pathlib import Path

import yaml

from shared import budget, keys
from shared.budget import register_dataset
from shared.config import DatasetConfig
from shared.scripts import run

ROOT = Path(__file__).resolve().parent.parent


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "budgetq.cli", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)


def test_status_budget_pause_resume(tmp_path, redis_url, conn):
    register_dataset(conn, DatasetConfig(name="B2", path="x", budget="10M", sampling={"max_tokens": 100},
                                         prior_mean_tokens=50))
    run(conn, budget.reserve("B2", "j1", 100))
    run(conn, budget.commit("B2", "j1", 3, 77, "stop", "{}"))
    out = _cli("status", "--redis-url", redis_url, "--json")
    assert out.returncode == 0, out.stderr
    (row,) = json.loads(out.stdout)["datasets"]
    assert row["dataset"] == "B2" and row["budget"] == 10_000_000 and row["used"] == 77 and not row["paused"]

    assert _cli("budget", "set", "B2", "12.5M", "--redis-url", redis_url).returncode == 0
    assert int(conn.hget(keys.conf_key("B2"), "limit")) == 12_500_000
    assert _cli("pause", "B2", "--redis-url", redis_url).returncode == 0
    assert run(conn, budget.reserve("B2", "j2", 100)).status.value == "PAUSED"
    assert _cli("resume", "B2", "--redis-url", redis_url).returncode == 0
    assert run(conn, budget.reserve("B2", "j2", 100)).status.value == "ADMIT"

    bad = _cli("pause", "NOPE", "--redis-url", redis_url)
    assert bad.returncode == 2 and "'NOPE' is not registered" in bad.stderr
    bad = _cli("budget", "set", "B2", "lots", "--redis-url", redis_url)
    assert bad.returncode == 2 and "not a token count: 'lots'" in bad.stderr


def test_bad_config_is_a_clear_error(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({"datasets": [{"name": "A", "path": "a.jsonl", "budget": "x1"}]}))
    out = _cli("produce", "-c", str(cfg))
    assert out.returncode == 2 and "datasets.0.budget" in out.stderr and "x1" in out.stderr
