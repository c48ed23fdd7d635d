"""Budgets in what the operator has, on the real pipeline (simulator at a known capacity):
a deadline split by weight, a total split by weight with one dataset short of prompts, and a
fleet that loses half its speed mid-run.

Time is scaled: the simulator runs SPEEDUP x faster than the wall clock, so a 60 s deadline of
simulated time is 60 / SPEEDUP wall seconds. The simulator works in its linear regime
(--half-batch far above the requests in flight): each request decodes at the same speed
whatever the batch, so the fleet's tok/s is proportional to the requests in flight, and
stopping one of two workers halves it.
"""

from __future__ import annotations

import json
import signal
import subprocess
import time

from budgetq.shared import keys, run_plan
from budgetq.shared.identity import job_id
from tests.helpers import PY, Procs, rows, sim_get, wait_for, write_config, write_dataset

SPEEDUP = 10
DEADLINE_SIM_S = 60
# ~120 tokens/s per request (simulated), ~300-token answers: ~2.5 s (simulated) per response
SIM = ("--speedup", str(SPEEDUP), "--half-batch", "1000", "--peak-tok-s", "122000", "--length-mean", "300",
       "--length-sigma", "0.5", "--max-running-requests", "512", "--seed", "3")
FAST_WORKER = {"heartbeat_ttl_s": 3, "maintenance_interval_s": 0.5, "control_interval_s": 0.05, "grace_s": 0}
FAST_RUN = {"control_interval_s": 0.1, "rate_window_s": 2.0, "tail_quantile": 0.95}


def _datasets(tmp_path, weights: dict[str, float], rows_each: dict[str, int], **extra) -> list[dict]:
    out = []
    for name, w in weights.items():
        write_dataset(tmp_path / f"{name}.jsonl", rows_each[name])
        out.append({"name": name, "path": str(tmp_path / f"{name}.jsonl"), "id_field": "id", "weight": w,
                    "sampling": {"max_tokens": 1200}, "prior_mean_tokens": 300, **extra})
    return out


def _used(conn, ds: str) -> int:
    return int(conn.get(keys.used_key(ds)) or 0)


def _run(tmp_path, redis_url, sim: str, datasets: list[dict], run: dict, workers: int = 1, concurrency: int = 16,
         during=None, timeout_s: float = 90) -> Procs:
    cfg = write_config(tmp_path, redis_url, [sim], datasets, run={**FAST_RUN, **run},
                       worker={"concurrency": concurrency, **FAST_WORKER},
                       producer={"poll_interval_s": 0.02, "progress": "off"})
    procs = Procs(cfg, tmp_path)
    for _ in range(workers):
        procs.worker()
    try:
        producer = procs.producer()
        if during is not None:
            during(procs)
        producer = next(p for p in reversed(procs.procs) if "produce" in p.args)  # a restarted one, if any
        assert producer.wait(timeout_s) == 0, Procs.log(producer)
    finally:
        procs.stop_all()
    return procs


def _finished_rows(sim: str, out, names) -> list[float]:
    """Finish times (server side, wall clock) of the responses that became rows."""
    kept = {job_id(n, r["id"]) for n in names for r in rows(out / f"{n}.jsonl")}
    return [r["finished"] for r in sim_get(sim, "/sim/requests")
            if r["finish"] in ("stop", "length") and r["rid"].rsplit(".", 1)[0] in kept]


def _deadline(conn) -> float:
    d = run_plan.read_settings(conn).deadline
    assert d is not None
    return d


def _check_deadline_run(conn, sim: str, out, weights: dict[str, float],
                        span: float = DEADLINE_SIM_S / SPEEDUP) -> dict[str, int]:
    """The last row before deadline + 5% of the run's ``span`` (s), shares within 5% of the weights,
    waste under 2%."""
    deadline = _deadline(conn)
    finished = _finished_rows(sim, out, weights)
    assert finished, "no row was written"
    assert max(finished) <= deadline + 0.05 * span, f"last row {max(finished) - deadline:+.2f} s after the deadline"
    used = {n: _used(conn, n) for n in weights}
    total = sum(used.values())
    print(f"deadline run: {total:,} tokens; share vs weight: " + ", ".join(
        f"{n} {used[n] / total / (w / sum(weights.values())) - 1:+.1%}" for n, w in weights.items()))
    for n, w in weights.items():
        share, want = used[n] / total, w / sum(weights.values())
        assert abs(share / want - 1) <= 0.05, (n, used, share, want)
    stats = sim_get(sim, "/sim/stats")
    at_deadline = sum(r["completion_tokens"] for r in sim_get(sim, "/sim/requests")
                      if r["finish"] == "abort" and r["finished"] >= deadline)
    assert at_deadline <= 0.02 * stats["generated_tokens"], (at_deadline, stats)
    return stats


def _log(conn) -> list[dict[str, str]]:
    """People's actions and the producer's automatic moves (its own log), in the order they came."""
    entries = [*conn.xrange(keys.CONTROL_LOG), *conn.xrange(keys.CONTROL_AUTO_LOG)]
    entries.sort(key=lambda e: tuple(int(p) for p in e[0].split(b"-")))
    return [{k.decode(): v.decode() for k, v in e[1].items()} for e in entries]


def test_deadline_over_three_weighted_datasets(tmp_path, redis_url, conn, sim_factory):
    sim = sim_factory(*SIM)
    weights = {"A": 1.0, "B": 2.0, "C": 3.0}
    datasets = _datasets(tmp_path, weights, {n: 4000 for n in weights})
    # Twice the others' deadline: A's sixth of a 6 s run was ~40 answers on a loaded machine (40-80k
    # tokens in all), and the few in flight at the drain moved its share by up to 7.7%, past the 5%.
    span = 2 * DEADLINE_SIM_S / SPEEDUP
    _run(tmp_path, redis_url, sim, datasets, {"deadline": f"{span}s"})
    stats = _check_deadline_run(conn, sim, tmp_path / "out", weights, span)
    assert stats["aborted_tokens"] <= 0.02 * stats["generated_tokens"], stats  # nor anything else wasted
    # every change of a limit is in the control log, with its reason; a steady fleet makes few
    moves = [e for e in _log(conn) if e["action"] == "budget_deadline"]
    # pace steps: ~0.7 a dataset per control interval (0.1 s here), under 50 a dataset per 6 s of run
    assert moves and len(moves) < 50 * len(weights) * span / (DEADLINE_SIM_S / SPEEDUP), len(moves)
    assert {e["who"] for e in moves} == {"producer (deadline pacing)"}  # the producer's, not a person's


def test_fleet_halved_mid_run_moves_the_budgets_and_still_meets_the_deadline(tmp_path, redis_url, conn,
                                                                              sim_factory):
    sim = sim_factory(*SIM)
    weights = {"A": 1.0, "B": 1.0, "C": 2.0}
    datasets = _datasets(tmp_path, weights, {n: 4000 for n in weights})
    halved: dict[str, float] = {}

    def halve(procs: Procs) -> None:
        # once the rate is measured, one of the two workers stops: half the requests in flight
        wait_for(lambda: (run_plan.read_state(conn) or {}).get("tok_s"), 30, "a measured rate")
        time.sleep(0.15 * DEADLINE_SIM_S / SPEEDUP)
        halved["rate"] = run_plan.read_state(conn)["tok_s"]
        halved["at"] = time.time()
        procs.procs[0].send_signal(signal.SIGTERM)

    _run(tmp_path, redis_url, sim, datasets, {"deadline": f"{DEADLINE_SIM_S / SPEEDUP}s"}, workers=2,
         concurrency=12, during=halve)
    _check_deadline_run(conn, sim, tmp_path / "out", weights)
    # the budgets came down after the fleet slowed: a lower total than projected before
    before = [int(e["old"]) for e in _log(conn) if e["action"] == "budget_deadline" and float(e["ts"]) >= halved["at"]
              and int(e["old"]) < 10**14]
    after = [int(e["new"]) for e in _log(conn) if e["action"] == "budget_deadline" and float(e["ts"]) >= halved["at"]]
    assert before and min(after) < 0.9 * max(before), (before, after)


def test_total_split_by_weight_gives_what_a_short_dataset_cannot_use_to_the_others(tmp_path, redis_url, conn,
                                                                                      sim_factory):
    sim = sim_factory("--speedup", "200", "--length-mean", "2000", "--length-sigma", "0.3", "--seed", "5")
    weights = {"A": 1.0, "B": 1.0, "C": 1.0}
    # C has prompts for about 100k tokens (50 x ~2,000), A and B for far more than their share
    datasets = _datasets(tmp_path, weights, {"A": 400, "B": 400, "C": 50})
    for d in datasets:
        d["sampling"] = {"max_tokens": 6000}
        d["prior_mean_tokens"] = 2000
    _run(tmp_path, redis_url, sim, datasets, {"total_budget": "600k"}, concurrency=32)
    used = {n: _used(conn, n) for n in weights}
    assert len(rows(tmp_path / "out" / "C.jsonl")) == 50   # C ran out of prompts ...
    assert 80_000 <= used["C"] <= 125_000, used
    # ... and the others shared what it left: near 250k each, the total landing on 600k (soft)
    total = sum(used.values())
    assert 600_000 <= total < 600_000 + 6000 * 3, used
    for n in ("A", "B"):
        assert abs(used[n] - (600_000 - used["C"]) / 2) <= 6000, used
    moves = [e for e in _log(conn) if e["action"] == "budget_total"]
    assert any(e["dataset"] == "A" and int(e["new"]) > int(e["old"]) for e in moves), moves


def test_what_runs_at_the_deadline_is_aborted_and_a_later_run_sends_it_again(tmp_path, redis_url, conn,
                                                                            sim_factory):
    # answers of ~1 s against a 1.5 s deadline: the response times are barely known when it comes,
    # so requests are still running at it
    sim = sim_factory("--speedup", "1", "--length-mean", "100", "--length-sigma", "0.6", "--half-batch", "1000",
                      "--peak-tok-s", "100000", "--seed", "11")
    weights = {"A": 1.0}
    datasets = _datasets(tmp_path, weights, {"A": 40})
    procs = _run(tmp_path, redis_url, sim, datasets, {"deadline": "1.5s"}, concurrency=8)
    first = _deadline(conn)
    # a deadline is an end (exit 0, docs/cli.md), named as what ended the run, with the prompts it left
    assert "run complete: every dataset reached its end (deadline)" in Procs.log(procs.procs[-1])
    (a,) = json.loads(subprocess.run([*PY, "status", "--json", "-c", str(procs.cfg)], capture_output=True,
                                     check=True, timeout=60).stdout)["datasets"]
    assert a["stop"] == "deadline" and a["ledger"]["skipped"] > 0, a  # prompts left, never answered
    cut = {r["rid"].rsplit(".", 1)[0] for r in sim_get(sim, "/sim/requests")
           if r["finish"] == "abort" and r["finished"] >= first}
    assert cut, "nothing was running at the deadline"
    done_before = {job_id("A", r["id"]) for r in rows(tmp_path / "out" / "A.jsonl")}
    assert not cut & done_before
    assert not any(conn.sismember(keys.done_key("A"), j) for j in cut)
    # a later run (a new deadline, from another shell) sends them again; no prompt is written twice
    conn.hset(keys.PLAN, "deadline", f"{time.time() + 30:.3f}")
    _run(tmp_path, redis_url, sim, datasets, {"deadline": "1.5s"}, concurrency=8)
    kept = [job_id("A", r["id"]) for r in rows(tmp_path / "out" / "A.jsonl")]
    assert len(kept) == len(set(kept)) == 40
    assert cut <= set(kept)


def test_a_live_deadline_change_and_a_producer_restart_keep_the_run_on_its_deadline(tmp_path, redis_url, conn,
                                                                                     sim_factory):
    """The deadline moved from another shell while the producer runs, then the producer restarted:
    the new one keeps that deadline and the fleet's last rate (its budgets never open up while it
    measures again), and the run still ends on the deadline with the shares of the weights."""
    sim = sim_factory(*SIM)
    weights = {"A": 1.0, "B": 2.0}
    # Prompts to spare: the run lasts the wait for a rate, two CLI calls, the restart and `span`, and a
    # dataset that ran out of prompts (600 each: B did, ~180k tokens) gives its share away, as it should.
    # Before the change the shares must bind, or A runs ahead unpaced: a dataset held at its cap (what
    # its prompts allow, ~1.4M for 4,000 prompts) is not paced, and with the first deadline 100 x span
    # away both were, each at half the tokens until the change (~8 s under load, ~180k tokens: A then
    # had more than its third of the whole run, and ended +5.1..+6.8%). With 12,000 prompts (~4.1M) and
    # the first deadline 20 x span away (at most ~3.5M tokens at the simulator's ~29k tok/s), neither is.
    datasets = _datasets(tmp_path, weights, {n: 12_000 for n in weights})
    span = DEADLINE_SIM_S / SPEEDUP
    marks: dict[str, float] = {}

    def change_then_restart(procs: Procs) -> None:
        wait_for(lambda: (run_plan.read_state(conn) or {}).get("tok_s"), 30, "a measured rate")
        snap = json.loads(subprocess.run([*PY, "status", "--json", "-c", str(procs.cfg)], capture_output=True,
                                         text=True, check=True, timeout=60).stdout)
        plan = snap["plan"]
        assert plan["phase"] == "run" and plan["deadline_in_s"] > 10 * span and plan["tok_s"] > 0, plan
        assert {n: plan["datasets"][n]["weight"] for n in weights} == weights, plan
        assert all(plan["datasets"][n]["projected_finish"] for n in weights), plan
        # from another shell: the deadline comes in to `span` seconds from now
        out = subprocess.run([*PY, "budget", "deadline", f"{span:g}s", "-c", str(procs.cfg)], capture_output=True,
                             text=True, check=True, timeout=60).stdout
        assert "deadline" in out and "->" in out, out
        marks["changed"] = time.time()
        time.sleep(0.3 * span)
        first = procs.procs[-1]
        first.send_signal(signal.SIGTERM)
        assert first.wait(60) == 3, Procs.log(first)  # stopped before the end (docs/cli.md)
        marks["restarted"] = time.time()
        procs.producer()  # _run waits for this one

    _run(tmp_path, redis_url, sim, datasets, {"deadline": f"{20 * span:g}s"}, workers=2, concurrency=12,
         during=change_then_restart, timeout_s=120)
    deadline = _deadline(conn)
    assert marks["changed"] < deadline <= marks["changed"] + span + 1  # the live change, kept by the restart
    written = {n: len(rows(tmp_path / "out" / f"{n}.jsonl")) for n in weights}
    assert all(k < 12_000 for k in written.values()), written  # nobody out of prompts: the shares are the pacing's
    _check_deadline_run(conn, sim, tmp_path / "out", weights)
    after = [e for e in _log(conn) if e["action"] == "budget_deadline" and float(e["ts"]) >= marks["restarted"]]
    assert all(int(e["new"]) < 10**14 for e in after), after  # never unlimited while the rate was re-measured
