"""The run-level budget commands from another shell, `budgetq plan`, and a restarted producer."""

from __future__ import annotations

import json
import subprocess

from budgetq.shared import keys, run_plan
from tests.helpers import PY, ROOT, Procs, wait_for, write_config, write_dataset


def _cli(cfg, *args: str, rc: int = 0) -> subprocess.CompletedProcess:
    out = subprocess.run([*PY, *args, "-c", str(cfg)], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == rc, (out.stdout, out.stderr)
    return out


def _limits(conn) -> dict[str, int]:
    return {n: int(conn.hget(keys.conf_key(n), "limit") or 0) for n in ("A", "B", "C")}


def test_live_total_weight_and_deadline_and_a_restart_keeps_them(tmp_path, redis_url, conn):
    datasets = []
    for n in ("A", "B", "C"):
        write_dataset(tmp_path / f"{n}.jsonl", 200)   # all read at once: each can spend 200 x 1,000
        datasets.append({"name": n, "path": str(tmp_path / f"{n}.jsonl"), "id_field": "id", "prior_mean_tokens": 1000,
                         "sampling": {"max_tokens": 4000}})
    datasets[2]["budget"] = "10k"   # C's own cap
    cfg = write_config(tmp_path, redis_url, ["http://127.0.0.1:9"], datasets,
                       run={"total_budget": "90k", "deadline": "2h", "control_interval_s": 0.1},
                       producer={"progress": "off"})
    procs = Procs(cfg, tmp_path)
    try:
        procs.producer()   # no worker: nothing is spent, the limits are the split itself
        wait_for(lambda: _limits(conn) == {"A": 40_000, "B": 40_000, "C": 10_000}, 30, "the total split, C capped")
        deadline = run_plan.read_settings(conn).deadline
        assert "-> 4" in _cli(cfg, "budget", "weight", "A", "4").stdout
        wait_for(lambda: _limits(conn) == {"A": 64_000, "B": 16_000, "C": 10_000}, 30, "the new weight applied")
        assert "-> 60.00k" in _cli(cfg, "budget", "total", "60k").stdout
        wait_for(lambda: _limits(conn) == {"A": 40_000, "B": 10_000, "C": 10_000}, 30, "the new total applied")
        shown = _cli(cfg, "budget", "show").stdout
        assert "total budget 60.00k" in shown, shown
        row = next(line.split() for line in shown.splitlines() if line.startswith("A "))
        assert row[:8] == ["A", "40.00k", "0", "0.0%", "soft", "completion", "open", "4"], shown
        plan = _cli(cfg, "plan", "--tok-s", "100").stdout.splitlines()
        row = next(line.split() for line in plan if line.startswith("A "))
        assert row[:6] == ["A", "4", "40.00k", "0", "1,000", "40"] and row[6] == "200", plan
        procs.stop_all()
        # a restarted producer: the same deadline (fixed at the first start), the live weight and total
        procs.producer()
        wait_for(lambda: (run_plan.read_state(conn) or {}).get("at", 0) > 0, 30, "the restarted budget loop")
        s = run_plan.read_settings(conn)
        assert (s.deadline, s.total_budget, s.weight("A")) == (deadline, 60_000, 4.0)
        wait_for(lambda: _limits(conn) == {"A": 40_000, "B": 10_000, "C": 10_000}, 30, "the same split")
    finally:
        procs.stop_all()
    log = [e[1][b"action"].decode() for e in conn.xrange(keys.CONTROL_LOG)]
    assert {"weight_set", "total_set", "deadline_set"} <= set(log) and "budget_total" not in log
    # the producer's own moves: in their own log, by the producer, never a person's user@host
    auto = [(e[1][b"action"], e[1][b"who"]) for e in conn.xrange(keys.CONTROL_AUTO_LOG)]
    assert auto and set(auto) == {(b"budget_total", b"producer (total split)")}, auto


def test_budget_show_lists_every_datasets_budget_without_a_deadline_or_total(tmp_path, redis_url, conn):
    """docs/budget.md: `budget show` lists the per-dataset budgets, also when the run has neither a
    deadline nor a total (it printed only `deadline none; total budget none`)."""
    from budgetq.shared import budget as bq_budget
    from budgetq.shared.budget import register_dataset
    from budgetq.shared.config import DatasetConfig
    from budgetq.shared.control import set_paused
    from budgetq.shared.scripts import run

    register_dataset(conn, DatasetConfig(name="A1", path="x", budget="150k", sampling={"max_tokens": 100}))
    register_dataset(conn, DatasetConfig(name="B2", path="x", budget="300k", mode="strict",
                                         sampling={"max_tokens": 100}))
    run(conn, bq_budget.reserve("A1", "j1", 100))
    run(conn, bq_budget.commit("A1", "j1", 0, 1500, "stop", "{}"))
    set_paused(conn, "B2", True)
    cfg = write_config(tmp_path, redis_url, ["http://127.0.0.1:9"], [])
    out = _cli(cfg, "budget", "show")
    assert out.returncode == 0, out.stderr
    head, cols, a1, b2 = out.stdout.splitlines()
    assert head == "deadline none; total budget none; per-dataset budgets", out.stdout
    assert cols.split() == ["dataset", "budget", "used", "used", "%", "mode", "count", "state"], out.stdout
    assert a1.split() == ["A1", "150.00k", "1.50k", "1.0%", "soft", "completion", "open"], out.stdout
    assert b2.split() == ["B2", "300.00k", "0", "0.0%", "strict", "completion", "paused"], out.stdout
    shown = json.loads(_cli(cfg, "budget", "show", "--json").stdout)
    assert [(d["dataset"], d["budget"], d["used"], d["paused"]) for d in shown["datasets"]] == \
        [("A1", 150_000, 1500, False), ("B2", 300_000, 0, True)]


def test_bad_values_are_one_line_errors(tmp_path, redis_url, conn):
    write_dataset(tmp_path / "A.jsonl", 3)
    cfg = write_config(tmp_path, redis_url, ["http://127.0.0.1:9"],
                       [{"name": "A", "path": str(tmp_path / "A.jsonl"), "budget": "1k"}])
    conn.sadd(keys.DATASETS, "A")
    for args, words in ((("budget", "deadline", "soon"), "deadline 'soon'"),
                        (("budget", "total", "lots"), "not a token count"),
                        (("budget", "weight", "A", "-2"), "weight '-2'"),
                        (("budget", "weight", "Z", "2"), "not registered")):
        err = _cli(cfg, *args, rc=2).stderr
        assert words in err and err.count("\n") == 1, err
    assert "-> none" in _cli(cfg, "budget", "deadline", "none").stdout
