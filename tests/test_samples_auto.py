"""samples: auto: a dataset short of prompts draws further answers, in rounds, to its budget or max_samples."""

from __future__ import annotations

import json
import signal
import subprocess
from collections import Counter

from budgetq.shared import keys
from budgetq.shared.identity import job_id
from budgetq.shared.ledger import read_ledger
from tests.helpers import CLI, ROOT, Procs, rows, run_to_completion, wait_for, write_config, write_dataset

FAST = {"heartbeat_ttl_s": 2, "maintenance_interval_s": 0.5, "control_interval_s": 0.2}


def _spec(tmp_path, name: str, n: int, budget: str | None, max_samples: int, mean: int = 100, **extra) -> dict:
    write_dataset(tmp_path / f"{name}.jsonl", n)
    spec = {"name": name, "path": str(tmp_path / f"{name}.jsonl"), "id_field": "id", "samples": "auto",
            "max_samples": max_samples, "sampling": {"max_tokens": 400, "temperature": 0.9},
            "prior_mean_tokens": mean, **extra}
    if budget is not None:
        spec["budget"] = budget
    return spec


def _by_sample(path) -> Counter:
    return Counter(r.get("sample", 1) for r in rows(path))


def test_auto_fills_a_short_dataset_to_its_budget_in_rounds_through_a_killed_producer(tmp_path, redis_url, conn,
                                                                                       sim_factory):
    # 30 prompts of ~100 tokens: a 7.5k budget needs ~2.5 answers a prompt
    sim = sim_factory("--speedup", "20", "--seed", "2", "--length-mean", "100", "--length-sigma", "0.2")
    spec = _spec(tmp_path, "A", 30, "7500", 5)
    cfg = write_config(tmp_path, redis_url, sim, [spec], worker={"concurrency": 8, **FAST})
    check = subprocess.run([*CLI, "check", "-c", str(cfg)], cwd=ROOT, capture_output=True, text=True)
    assert "samples: auto (max_samples 5): the budget needs ~2.50 answers per prompt" in check.stdout, check.stdout
    assert "the cap binds" not in check.stdout
    plan = subprocess.run([*CLI, "plan", "-c", str(cfg), "--tok-s", "100"], cwd=ROOT, capture_output=True, text=True)
    assert "A: samples: auto: ~2.50 answers per prompt at mean 100" in plan.stdout, plan.stdout + plan.stderr
    assert "the cap binds" not in plan.stdout
    out = tmp_path / "out" / "A.jsonl"
    procs = Procs(cfg, tmp_path)
    procs.worker()
    first = procs.producer()
    try:
        # kill -9 the producer in round 2, then let a new one finish the run
        wait_for(lambda: _by_sample(out)[2] >= 5, 90, "second answers on disk")
        first.send_signal(signal.SIGKILL)
        first.wait()
        second = procs.producer()
        assert second.wait(120) == 0, procs.log(second)
    finally:
        procs.stop_all()
    kept = rows(out)
    used = int(conn.get(keys.used_key("A")))
    assert 7500 <= used < 7500 + 400                         # soft: the budget reached, by one answer at most
    assert used == sum(r["completion_tokens"] for r in kept)  # counted once each (I1)
    ids = [r["id"] for r in kept]
    assert len(ids) == len(set(ids))                          # each (prompt, sample) once (I2)
    per = _by_sample(out)
    # rounds: every prompt its 2nd answer before any its 3rd; the budget ended it in round 3
    assert per[1] == 30 and per[2] == 30 and 0 < per[3] < 30 and per[4] == 0, per
    for r in kept:
        prompt, _, k = r["id"].partition("#")
        assert r["sample"] == (int(k) if k else 1) and r["conversations"][0]["content"] == f"question {prompt}"
    ledger = read_ledger(conn, "A")
    assert ledger["samples"] == 5 and ledger["rows"] == len(kept) and ledger["balanced"]


def test_auto_stops_at_max_samples_and_check_says_the_cap_binds(tmp_path, redis_url, conn, sim_factory):
    sim = sim_factory("--speedup", "200", "--seed", "3", "--length-mean", "100")
    spec = _spec(tmp_path, "C", 20, "1M", 3)
    cfg = write_config(tmp_path, redis_url, sim, [spec], worker={"concurrency": 16})
    check = subprocess.run([*CLI, "check", "-c", str(cfg)], cwd=ROOT, capture_output=True, text=True)
    assert "the cap binds: 3 answers a prompt end it short of its budget" in check.stdout, check.stdout
    plan = subprocess.run([*CLI, "plan", "-c", str(cfg), "--tok-s", "100"], cwd=ROOT, capture_output=True, text=True)
    assert "C: samples: auto: ~500.00 answers per prompt at mean 100; the cap binds (max_samples 3)" in plan.stdout, \
        plan.stdout + plan.stderr
    run_to_completion(cfg, tmp_path)
    per = _by_sample(tmp_path / "out" / "C.jsonl")
    assert per == Counter({1: 20, 2: 20, 3: 20})
    ledger = read_ledger(conn, "C")
    assert (ledger["rows"], ledger["unread"], ledger["entered"]) == (60, 0, 60) and ledger["balanced"]


# name: (mean response tokens in the simulator, prompts in the file, samples): ten datasets of equal weight,
# the case: two of them short of prompts (S1's give ~6k a round, S2's ~8k) with samples: auto
SHARES = {"A": (150, 1000, 1), "B": (300, 600, 1), "C": (500, 400, 1), "D": (200, 800, 1), "E": (250, 700, 1),
          "F": (120, 1200, 1), "G": (400, 500, 1), "H": (350, 500, 1), "S1": (100, 60, "auto"), "S2": (200, 40, "auto")}
TOTAL = 1_000_000   # 100k each


def test_a_short_dataset_with_auto_keeps_its_weighted_share_of_a_total(tmp_path, redis_url, conn, sim_factory):
    flags = ["--speedup", "600", "--length-sigma", "0.4", "--seed", "7", "--length-mean", "300"]
    for name, (mean, _n, _s) in SHARES.items():
        flags += ["--length-mean-for", f"{name}-={mean}"]
    sim = sim_factory(*flags)
    datasets = []
    for name, (mean, n, samples) in SHARES.items():
        write_dataset(tmp_path / f"{name}.jsonl", n)
        spec = {"name": name, "path": str(tmp_path / f"{name}.jsonl"), "id_field": "id", "samples": samples,
                "sampling": {"max_tokens": 1200, "temperature": 0.9}, "prior_mean_tokens": mean}
        if samples == "auto":
            spec["max_samples"] = 40
        datasets.append(spec)
    cfg = write_config(tmp_path, redis_url, [sim], datasets, run={"total_budget": TOTAL, "control_interval_s": 0.1},
                       worker={"concurrency": 24, "heartbeat_ttl_s": 3, "maintenance_interval_s": 0.5,
                               "control_interval_s": 0.05, "grace_s": 0},
                       producer={"poll_interval_s": 0.02, "progress": "off"})
    run_to_completion(cfg, tmp_path, timeout_s=400)
    out = tmp_path / "out"
    used = {n: int(conn.get(keys.used_key(n)) or 0) for n in SHARES}
    for n in SHARES:
        got = rows(out / f"{n}.jsonl")
        ids = [job_id(n, r["id"]) for r in got]
        assert len(ids) == len(set(ids)), n
        assert sum(r["completion_tokens"] for r in got) == used[n], n
    share = TOTAL / len(SHARES)
    print("used by dataset (10 datasets, total 1M, share 100k each): " + ", ".join(
        f"{n} {used[n]:,} ({used[n] / share - 1:+.2%}, {max(_by_sample(out / f'{n}.jsonl'))} answers/prompt at most)"
        for n in SHARES))
    for n in SHARES:
        assert abs(used[n] / share - 1) <= 0.01, (n, used)
    for n in ("S1", "S2"):   # the short ones drew further answers, in rounds
        per = _by_sample(out / f"{n}.jsonl")
        assert max(per) > 5 and all(per[k] == SHARES[n][1] for k in range(1, max(per) - 1)), (n, per)


def test_auto_needs_max_samples_and_max_samples_needs_auto(tmp_path):
    write_dataset(tmp_path / "X.jsonl", 2)
    for extra, msg in (({"samples": "auto"}, "samples: auto needs max_samples"),
                       ({"samples": 2, "max_samples": 4}, "max_samples 4 is samples: auto's cap"),
                       ({"samples": "auto", "max_samples": 3, "sampling": {"max_tokens": 8, "temperature": 0}},
                        "samples: auto with temperature 0")):
        cfg = write_config(tmp_path, "redis://127.0.0.1:1/0", "http://127.0.0.1:1",
                           [{"name": "X", "path": str(tmp_path / "X.jsonl"), "budget": "1k", **extra}])
        proc = subprocess.run([*CLI, "check", "-c", str(cfg), "--json"], cwd=ROOT, capture_output=True, text=True)
        assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr
        assert msg in proc.stderr and "dataset X" in proc.stderr, proc.stderr
        assert not json.loads(proc.stdout or "{}").get("ok", False)
