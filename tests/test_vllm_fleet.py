"""budgetq in front of a real vLLM (its CPU build serving SmolLM2-135M, tests/vllm_server.py): the
worker finds it is vLLM (no /server_info, /v1/models owned_by "vllm"), names its one model without
``server.model``, sizes ``concurrency: auto`` from its Prometheus /metrics, and sends each attempt's
rid as ``X-Request-Id``, which vLLM takes as its request id (its log names ``chatcmpl-<rid>``);
``budgetq status`` shows the server's kind, model and load, ``budgetq check`` the model it resolved.
A few hundred generated tokens in all.
"""

from __future__ import annotations

import json
import re
import subprocess

import pytest

from budgetq.shared.identity import job_id
from tests.helpers import PY, ROOT, Procs, rows, wait_for, write_config, write_dataset
from tests.metrics_proxy import MetricsProxy
from tests.vllm_server import MODEL_NAME

# The per-test limit counts the test's own work, not the shared server's start (its own bounded wait,
# tests/vllm_server.py START_TIMEOUT_S), which takes minutes on a loaded machine.
pytestmark = pytest.mark.timeout(300, func_only=True)

PROMPTS, MAX_TOKENS = 8, 16


def _status(cfg, *flags: str) -> str:
    done = subprocess.run([*PY, "status", "-c", str(cfg), *flags], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_an_auto_worker_reads_vllms_metrics_names_its_model_and_its_rids_reach_vllms_log(
        tmp_path, redis_url, conn, vllm):
    ids = write_dataset(tmp_path / "V.jsonl", PROMPTS)
    cfg = write_config(tmp_path, redis_url, vllm.url,      # no server.model: vLLM refuses "default" (404)
                       [{"name": "V", "path": str(tmp_path / "V.jsonl"), "budget": 10**9,
                         "sampling": {"max_tokens": MAX_TOKENS, "temperature": 0.0}}],
                       worker={"concurrency": "auto", "capacity_interval_s": 0.3, "control_interval_s": 0.2},
                       producer={"progress": "off"})
    check = subprocess.run([*PY, "check", "-c", str(cfg)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert f"server {vllm.url}: OK, serves {MODEL_NAME} (vLLM); requests name '{MODEL_NAME}' (server.model unset)" \
        in check.stdout, check.stdout + check.stderr
    procs = Procs(cfg, tmp_path)
    try:
        worker = procs.worker()

        def seen_by_status():
            (ep,) = json.loads(_status(cfg, "--json"))["endpoints"]
            return ep["kind"] == "vllm" and ep["load"] is not None and ep

        ep = wait_for(seen_by_status, 300, "status showing the vLLM endpoint's kind and load")
        assert ep["model"] == MODEL_NAME and ep["url"] == vllm.url
        load = ep["load"]
        assert load["running"] >= 0 and load["waiting"] >= 0 and 0.0 <= load["kv_cache_use"] <= 1.0
        assert load["slots"] >= 1 and load["read_at"] > 0
        assert f"vLLM {MODEL_NAME}" in _status(cfg)          # the text view: the endpoint's server column

        producer = procs.producer()
        assert producer.wait(600) == 0, Procs.log(producer)[-3000:]
        log = Procs.log(worker)
    finally:
        procs.stop_all()
    out = rows(tmp_path / "out" / "V.jsonl")
    assert sorted(r["id"] for r in out) == sorted(ids)
    assert {r["model"] for r in out} == {MODEL_NAME}                 # resolved, not "default"
    assert all(0 < r["completion_tokens"] <= MAX_TOKENS for r in out)
    assert "is vLLM, not SGLang (no /server_info)" in log and f"model '{MODEL_NAME}' (its /v1/models)" in log
    # vLLM's request id is chatcmpl-<X-Request-Id> (entrypoints/openai/chat_completion/serving.py):
    # every prompt's attempt rid, <job id>.<12 hex>, is in its log (--enable-log-requests)
    received = set(re.findall(r"Received request chatcmpl-(\S+?)\.[0-9a-f]{12}\b", vllm.log()))
    assert {job_id("V", i) for i in ids} <= received


def test_a_fixed_concurrency_worker_shows_vllms_load_in_status(tmp_path, redis_url, conn, vllm):
    """Nothing is sized from vLLM's /metrics with a fixed concurrency, but the worker still reads them for
    ``budgetq status`` (worker/vllm_load.py read_loads)."""
    ids = write_dataset(tmp_path / "F.jsonl", 4)
    cfg = write_config(tmp_path, redis_url, vllm.url,
                       [{"name": "F", "path": str(tmp_path / "F.jsonl"), "budget": 10**9,
                         "sampling": {"max_tokens": 8, "temperature": 0.0}}],
                       worker={"concurrency": 2, "capacity_interval_s": 0.3, "control_interval_s": 0.2},
                       producer={"progress": "off"})
    procs = Procs(cfg, tmp_path)
    try:
        procs.worker()
        producer = procs.producer()

        def seen_by_status():
            (ep,) = json.loads(_status(cfg, "--json"))["endpoints"]
            return ep["kind"] == "vllm" and ep["load"] is not None and ep

        ep = wait_for(seen_by_status, 120, "status showing the vLLM endpoint's load (fixed concurrency)")
        load = ep["load"]
        assert load["running"] >= 0 and load["waiting"] >= 0 and 0.0 <= load["kv_cache_use"] <= 1.0, load
        assert load["slots"] is None and load["read_at"] > 0, load    # nothing sized from it
        assert producer.wait(300) == 0, Procs.log(producer)[-3000:]
    finally:
        procs.stop_all()
    assert sorted(r["id"] for r in rows(tmp_path / "out" / "F.jsonl")) == sorted(ids)


def test_two_vllm_endpoints_are_routed_by_their_gauges(tmp_path, redis_url, conn, vllm):
    """Two vLLM endpoints under ``concurrency: auto``: the run's server itself, and the same server behind
    tests/metrics_proxy.py, whose /metrics is vLLM's own with 64 more requests waiting for room (other clients
    filling it). The worker reads both, sizes the busy one at its short queue and sends it a small part of the
    requests; with equal gauges the two would get about half each (least-loaded routing, equal weights)."""
    n = 24
    ids = write_dataset(tmp_path / "R.jsonl", n)
    proxy = MetricsProxy(vllm.url, extra_waiting=64)
    try:
        cfg = write_config(tmp_path, redis_url, [vllm.url, proxy.url],
                           [{"name": "R", "path": str(tmp_path / "R.jsonl"), "budget": 10**9,
                             "sampling": {"max_tokens": 12, "temperature": 0.0}}],
                           worker={"concurrency": "auto", "capacity_interval_s": 0.3, "control_interval_s": 0.2},
                           server={"model": MODEL_NAME}, producer={"progress": "off"})
        procs = Procs(cfg, tmp_path)
        try:
            worker = procs.worker()

            def both_read():
                eps = {e["url"]: e for e in json.loads(_status(cfg, "--json"))["endpoints"]}
                return all(eps[u]["kind"] == "vllm" and eps[u]["load"] for u in (vllm.url, proxy.url)) and eps

            eps = wait_for(both_read, 120, "the worker reading both endpoints' gauges")
            assert eps[proxy.url]["load"]["waiting"] >= 64 > eps[vllm.url]["load"]["waiting"], eps
            producer = procs.producer()
            assert producer.wait(300) == 0, Procs.log(producer)[-3000:]
            log = Procs.log(worker)
        finally:
            procs.stop_all()
    finally:
        proxy.stop()
    out = rows(tmp_path / "out" / "R.jsonl")
    assert sorted(r["id"] for r in out) == sorted(ids)
    via = {u: sum(r["endpoint"] == u for r in out) for u in (vllm.url, proxy.url)}
    print(f"rows by endpoint: {via}; proxy /metrics read {proxy.metrics_reads} times")
    # the busy-looking endpoint's share is its short queue (2) beside the other's slots (8 or more): ~1/6
    assert via[proxy.url] <= n // 3 and via[vllm.url] >= 2 * via[proxy.url], (via, log[-3000:])
    assert proxy.metrics_reads >= 2
