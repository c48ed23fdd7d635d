"""The pipeline in front of a real continuous-batching engine: vLLM's CPU build serving
SmolLM2-135M-Instruct (tests/vllm_server.py; the ``vllm`` session fixture).

Everything else in the suite meets budgetq's own simulator or llama.cpp's server; here the
scheduler, the token counts and the abort rules are vLLM's own. Each test ends with every prompt in
exactly one place, ``used`` equal to the rows' tokens and the ledger balanced. Token counts are kept
small (a few hundred a test, ~2,000 for the pause test): on a loaded 2-core machine vLLM generates
~10-250 tok/s. Every pytest process of the run shares the one server (tests/conftest.py ``vllm``).
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from budgetq.shared import keys
from budgetq.shared.stats import Conf
from tests.helpers import (
    PY,
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

# The per-test limit counts the test's own work, not the shared server's start (tests/vllm_server.py
# START_TIMEOUT_S bounds that), which takes minutes on a loaded machine.
pytestmark = pytest.mark.timeout(300, func_only=True)

FAST = {"heartbeat_ttl_s": 3, "maintenance_interval_s": 0.5, "control_interval_s": 0.2, "concurrency": 8}
PROMPT = "Write a short poem about the number {i}."
# The pause test's answers, each exactly this long (min_tokens): seconds each even on an idle machine, so they still
# run when `budgetq pause`, a new process (2-3 s to start on a loaded machine), lands. Its budgets: 5 and 7 answers.
PAUSE_T = 200
STOP_S = 1.0  # docs/vllm.md: the engine stops the aborted requests within this of the pause reaching Redis


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


def _running_until_zero(vllm, timeout_s: float = 30) -> list[tuple[float, float, float]]:
    """Looks at vLLM's num_requests_running, one after the other, until one finds none: (began, ended, running)."""
    looks: list[tuple[float, float, float]] = []
    deadline = time.monotonic() + timeout_s
    while not looks or looks[-1][2] > 0:
        assert time.monotonic() < deadline, f"vLLM still runs requests {timeout_s:.0f} s after the pause: {looks[-3:]}"
        began = time.monotonic()
        running = _metric(vllm, "vllm:num_requests_running")
        looks.append((began, time.monotonic(), running))
    return looks


def test_pause_abort_in_flight_stops_the_engines_requests_then_resume_and_raise(tmp_path, redis_url, conn,
                                                                             vllm_fp32):
    # A server of its own: it reads the engine's own num_requests_running (no other test's requests on it),
    # and in float32, whose steps on a CPU without AVX-512 BF16 are short enough for the 1 s bound (in the
    # shared bf16 server one full suite saw 1.07 s: conftest.py vllm_fp32)
    vllm = vllm_fp32
    spec, ids = _dataset(tmp_path, "A", 60, budget=5 * PAUSE_T,
                         sampling={"max_tokens": PAUSE_T, "extra": {"min_tokens": PAUSE_T}})
    cfg = _config(tmp_path, redis_url, vllm, [spec], producer={"progress": "off"})
    procs = Procs(cfg, tmp_path)
    producer = procs.producer()
    procs.worker()
    try:
        wait_for(lambda: _metric(vllm, "vllm:num_requests_running") >= 4 and conn.hlen(keys.resv_key("A")) >= 4,
                 120, "4 requests running at vLLM")
        log_before = len(vllm.log())
        cli = subprocess.Popen([*PY, "pause", "A", "--abort-in-flight", "-c", str(cfg)], cwd=ROOT,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        # The clock starts when the pause is in Redis (the command's own start takes seconds on a loaded machine,
        # and it aborts right after): the worker drops the connections, vLLM aborts a request whose client
        # disconnects, and nothing of the dataset runs at the engine any more within STOP_S. Asserted on what a
        # look can prove on a loaded machine, where a look may itself take a while: the last look that still saw a
        # request running began less than STOP_S after the pause (a later one would have seen it too).
        paused_at = wait_for(lambda: conn.hget(keys.conf_key("A"), Conf.PAUSED) == b"1" and time.monotonic(), 60,
                             "the pause in Redis", every_s=0.005)
        looks = _running_until_zero(vllm)
        out, err = cli.communicate(timeout=60)
        assert cli.returncode == 0, out + err
        aborted = int(re.search(r"aborted (\d+) requests in flight", out).group(1))
        assert aborted >= 4, out
        last_running = max((b for b, _e, r in looks if r > 0), default=paused_at) - paused_at
        stopped_by = looks[-1][1] - paused_at
        engine_aborts = re.findall(r"Aborted request", vllm.log()[log_before:])
        print(f"pause --abort-in-flight: {aborted} aborted; vLLM last seen running {last_running:.2f} s after the "
              f"pause reached Redis, 0 running by {stopped_by:.2f} s ({len(looks)} looks); {len(engine_aborts)} "
              "aborts in its log")
        assert last_running < STOP_S, [(round(b - paused_at, 3), round(e - paused_at, 3), r) for b, e, r in looks]
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
        assert skipped > 0 and 5 * PAUSE_T <= int(conn.get(keys.used_key("A"))) < 6 * PAUSE_T
        # raised after the end: the skipped prompts are requeued and a new produce collects them
        out = cli_out(cfg, "budget", "set", "A", str(7 * PAUSE_T))
        assert f"requeued {skipped} skipped jobs" in out, out
        producer = procs.producer()
        assert producer.wait(300) == 0, Procs.log(producer)
    finally:
        procs.stop_all()
    states = check_invariants(conn, tmp_path / "out", "A", ids)
    assert 7 * PAUSE_T <= states["used"] < 8 * PAUSE_T and states["failed"] == 0, states
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
