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

from budgetq.shared.identity import job_id
from tests.helpers import PY, ROOT, Procs, rows, wait_for, write_config, write_dataset
from tests.vllm_server import MODEL_NAME

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
