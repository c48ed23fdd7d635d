"""The pipeline in front of a real continuous-batching engine: vLLM's CPU build serving
SmolLM2-135M-Instruct (tests/vllm_server.py; the ``vllm`` session fixture).

Everything else in the suite meets budgetq's own simulator or llama.cpp's server; here the
scheduler, the token counts and the abort rules are vLLM's own. Each test ends with every prompt in
exactly one place, ``used`` equal to the rows' tokens and the ledger balanced. Token counts are kept
small (a few hundred a test): on a loaded 2-core machine vLLM generates ~10-250 tok/s. Every
pytest process of the run shares the one server (tests/conftest.py ``vllm``).
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
import urllib.request

from budgetq.shared import control, keys
from tests.helpers import (
    ROOT,
    Procs,
    check_invariants,
    cli_out,
    dataset_status,
    holders,
    rows,
    run_to_completion,
    wait_for,
    write_config,
    write_dataset,
)
from tests.vllm_server import MODEL_NAME

FAST = {"heartbeat_ttl_s": 3, "maintenance_interval_s": 0.5, "control_interval_s": 0.2, "concurrency": 8}
PROMPT = "Write a short poem about the number {i}."
MAX_T = 120  # the pause test's longest answer


def _dataset(tmp_path, name: str, n: int, **spec) -> tuple[dict, list[str]]:
    path = tmp_path / f"{name}.jsonl"
    ids = write_dataset(path, n)
    # Prompts that make the model talk for a while (write_dataset's "question N" often gets one line).
    path.write_text("".join(json.dumps({"id": i, "prompt": PROMPT.format(i=i)}) + "\n" for i in ids))
    sampling = {"max_tokens": 32, **spec.pop("sampling", {})}
    return {"name": name, "path": str(path), "id_field": "id", "prior_mean_tokens": 24, "sampling": sampling,
            **spec}, ids


def _config(tmp_path, redis_url, vllm, datasets: list[dict], worker: dict | None = None, **extra):
    return write_config(tmp_path, redis_url, [vllm.url], datasets, worker={**FAST, **(worker or {})},
                        server={"model": MODEL_NAME, "backoff_base_s": 0.05, "health_interval_s": 0.3},
                        **extra)


def _metric(vllm, name: str) -> float:
    """A vLLM Prometheus gauge or counter, summed over its label sets (engines, finish reasons)."""
    with urllib.request.urlopen(vllm.url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") or line.startswith(name + " "))


def _balanced(cfg, ds: str) -> dict:
    led = dataset_status(cfg, ds)["ledger"]
    assert led["balanced"] and led["unaccounted"] == 0 and led["queued"] == led["running"] == 0, led
    return led


def test_soft_and_strict_budgets_land_and_the_rows_sum_to_used(tmp_path, redis_url, conn, vllm):
    soft, soft_ids = _dataset(tmp_path, "S", 40, budget=240)
    strict, strict_ids = _dataset(tmp_path, "T", 40, budget=160, mode="strict")
    cfg = _config(tmp_path, redis_url, vllm, [soft, strict])
    generated_before = _metric(vllm, "vllm:generation_tokens_total")
    run_to_completion(cfg, tmp_path, timeout_s=300)
    out = tmp_path / "out"
    s = check_invariants(conn, out, "S", soft_ids)
    t = check_invariants(conn, out, "T", strict_ids)
    # soft: within one response of the budget; strict: never over it, and short of it by less than one
    assert 240 <= s["used"] < 240 + 32, s
    assert 160 - 32 < t["used"] <= 160, t
    for ds in ("S", "T"):
        _balanced(cfg, ds)
        for r in rows(out / f"{ds}.jsonl"):
            assert r["model"] == MODEL_NAME and r["endpoint"] == vllm.url
            assert 0 < r["completion_tokens"] <= 32 and r["finish_reason"] in ("stop", "length")
    # The engine generated at least what was counted (aborted and wasted tokens are its own too).
    assert _metric(vllm, "vllm:generation_tokens_total") - generated_before >= s["used"] + t["used"]


def test_pause_abort_in_flight_stops_the_engines_requests_then_resume_and_raise(tmp_path, redis_url, conn,
                                                                             vllm_alone):
    vllm = vllm_alone  # it reads the engine's own num_requests_running: no other test's requests on it
    # Answers of up to 120 tokens (seconds each here): still running when the pause command lands, ~1 s after
    # they were seen running (with 32 they had finished by then on an idle machine).
    spec, ids = _dataset(tmp_path, "A", 60, budget=600, sampling={"max_tokens": MAX_T})
    cfg = _config(tmp_path, redis_url, vllm, [spec], producer={"progress": "off"})
    procs = Procs(cfg, tmp_path)
    producer = procs.producer()
    procs.worker()
    try:
        wait_for(lambda: _metric(vllm, "vllm:num_requests_running") >= 4 and conn.hlen(keys.resv_key("A")) >= 4,
                 120, "4 requests running at vLLM")
        log_before = len(vllm.log())
        # What `budgetq pause A --abort-in-flight` calls, in this process: the CLI's own start (2-3 s on a loaded
        # machine) once let every answer finish first (its output is tested in test_ledger_live.py)
        change = control.set_paused(conn, "A", True, abort_in_flight=True)
        paused_at = time.monotonic()
        aborted = change.aborted
        assert aborted >= 4, change
        # At the engine: nothing of the dataset runs any more (the worker dropped the connections;
        # vLLM aborts a request whose client disconnects), and its log names each abort.
        wait_for(lambda: _metric(vllm, "vllm:num_requests_running") == 0, 30, "vLLM to stop the aborted requests")
        stopped_s = time.monotonic() - paused_at
        engine_aborts = re.findall(r"Aborted request", vllm.log()[log_before:])
        print(f"pause --abort-in-flight: {aborted} aborted; vLLM running 0 after {stopped_s:.2f} s; "
              f"{len(engine_aborts)} aborts in its log")
        assert len(engine_aborts) >= aborted
        wait_for(lambda: conn.hlen(keys.resv_key("A")) == 0 and conn.zcard(keys.rq_wip_key("A")) == 0, 30,
                 "the aborted requests to settle")
        d = dataset_status(cfg, "A")
        assert d["state"] == "paused" and d["counts"]["aborted"] == aborted, d
        assert d["ledger"]["balanced"] and d["ledger"]["queued"] >= aborted, d["ledger"]
        # resume: the aborted prompts run again and the run ends at its budget
        cli_out(cfg, "resume", "A")
        assert producer.wait(300) == 0, Procs.log(producer)
        led = _balanced(cfg, "A")
        skipped = led["skipped"]
        assert skipped > 0 and 600 <= int(conn.get(keys.used_key("A"))) < 600 + MAX_T
        # raised after the end: the skipped prompts are requeued and a new produce collects them
        out = cli_out(cfg, "budget", "set", "A", "960")
        assert f"requeued {skipped} skipped jobs" in out, out
        producer = procs.producer()
        assert producer.wait(300) == 0, Procs.log(producer)
    finally:
        procs.stop_all()
    states = check_invariants(conn, tmp_path / "out", "A", ids)
    assert 960 <= states["used"] < 960 + MAX_T and states["failed"] == 0, states
    _balanced(cfg, "A")


def test_a_worker_sigkilled_mid_run_loses_nothing_and_counts_nothing_twice(tmp_path, redis_url, conn, vllm):
    spec, ids = _dataset(tmp_path, "K", 60, budget=200)
    cfg = _config(tmp_path, redis_url, vllm, [spec], worker={"concurrency": 4})
    procs = Procs(cfg, tmp_path)
    victim = procs.worker()
    procs.worker()
    try:
        producer = procs.producer()
        wait_for(lambda: holders(conn, "K", victim.pid), 120, "the victim to hold requests at vLLM")
        victim.send_signal(signal.SIGKILL)
        victim.wait()
        # its jobs run again one lease later, on the other worker, and the run ends at its budget
        assert producer.wait(300) == 0, Procs.log(producer)
    finally:
        procs.stop_all()
    states = check_invariants(conn, tmp_path / "out", "K", ids)
    assert 200 <= states["used"] < 200 + 32 and states["failed"] == 0, states
    assert int(conn.hget(keys.stats_key("K"), "recovered") or 0) > 0  # requeued by the maintenance pass
    _balanced(cfg, "K")


def test_a_deadline_run_ends_by_its_deadline(tmp_path, redis_url, conn, vllm):
    # Short answers: a deadline shorter than a few response times aborts what runs at it (docs/budget.md),
    # and on a loaded machine one vLLM response of 16 tokens can take several seconds.
    spec, ids = _dataset(tmp_path, "D", 400, budget="1M", sampling={"max_tokens": 16})
    cfg = _config(tmp_path, redis_url, vllm, [spec],
                  run={"deadline": "45s", "control_interval_s": 0.2, "rate_window_s": 3.0},
                  producer={"progress": "off"})
    started = time.time()
    run_to_completion(cfg, tmp_path, timeout_s=300)
    ended = time.time()
    states = check_invariants(conn, tmp_path / "out", "D", ids)
    # the deadline stopped it (far short of 1M tokens and of its 400 prompts), and not long after it:
    # admissions stop early enough for the last responses (<= 16 tokens) to finish by then
    assert 0 < states["used"] < 1_000_000 and states["committed"] < 400, states
    print(f"deadline run: {states['committed']} rows, {states['used']} tokens; ended {ended - started:.1f} s "
          f"after start (deadline 45 s)")
    assert ended - started < 45 + 30, "the run went on long past its deadline"
    _balanced(cfg, "D")


def test_the_vllm_bench_runs_and_prints_its_ratio(vllm_alone):
    """bench/vllm_pipeline_vs_direct.py --smoke against the run's server (no second vLLM), alone on it:
    it measures with the engine's own counters."""
    vllm = vllm_alone
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "vllm_pipeline_vs_direct.py"), "--url", vllm.url,
                           "--smoke"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    sys.path.insert(0, str(ROOT / "bench"))
    from _common import number, parse_md_tables

    last = parse_md_tables(proc.stdout)[-1]
    assert number(last[0]["ratio pipeline / direct"]) > 0, last
