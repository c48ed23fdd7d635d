"""Streaming in front of the real engine: vLLM's CPU build serving SmolLM2-135M-Instruct (the ``vllm``
session fixture, tests/vllm_server.py), at temperature 0, where some prompts fall into an exact cycle.

A streaming worker with the default guard cuts such an answer at the engine (vLLM's log says the
request was aborted: the worker dropped the connection) soon after its onset, the prompt ends
discarded as ``loop``; the answers that do not loop are kept whole; the rows' tokens are what the
budget counted.
"""

from __future__ import annotations

import json

import pytest

from budgetq.shared import keys
from budgetq.shared.identity import job_id
from budgetq.worker.degeneration import scan
from tests.helpers import dataset_status, rows, run_to_completion, write_config
from tests.vllm_server import MODEL_NAME

# Probed on this engine (SmolLM2-135M-Instruct, vLLM CPU, temperature 0, max_tokens 1200): "a" fell into
# a 2-token cycle at ~49 tokens and the poem into a 76-token one at ~197; the others ended by themselves.
LOOPING = {"a": "Write the letter a over and over.", "poem": "Write a poem about the sea."}
ORDINARY = {"paris": "What is the capital of France?", "count": "Count from 1 to 1000, one number per line.",
            "recursion": "Explain recursion."}
MAX_TOKENS = 1200
# The limit counts the test's own work, not the shared server's start (tests/vllm_server.py bounds that).
pytestmark = pytest.mark.timeout(600, func_only=True)


# Up to 1,200 tokens an answer at ~10-250 tok/s on a loaded machine (an answer not cut runs to the end).
def test_a_looping_answer_is_cut_at_vllm_and_the_others_are_kept_whole(tmp_path, redis_url, conn, vllm):
    path = tmp_path / "L.jsonl"
    prompts = {**LOOPING, **ORDINARY}
    path.write_text("".join(json.dumps({"id": k, "prompt": p}) + "\n" for k, p in prompts.items()))
    cfg = write_config(tmp_path, redis_url, [vllm.url],
                       [{"name": "L", "path": str(path), "id_field": "id", "budget": "1M",
                         "sampling": {"max_tokens": MAX_TOKENS, "temperature": 0.0}}],
                       worker={"heartbeat_ttl_s": 3, "maintenance_interval_s": 0.5, "control_interval_s": 0.2,
                               "concurrency": 8},
                       server={"model": MODEL_NAME, "backoff_base_s": 0.05, "health_interval_s": 0.3})
    run_to_completion(cfg, tmp_path, timeout_s=600)
    out = tmp_path / "out"
    kept = {r["id"]: r for r in rows(out / "L.jsonl")}
    discarded = {r["id"]: r for r in rows(out / "L.discarded.jsonl")}
    assert set(kept) | set(discarded) == set(prompts) and not set(kept) & set(discarded)
    # The 2-token loop is unmistakable; every answer cut is a loop cut soon after its onset, at the engine.
    assert "a" in discarded, (kept.get("a", {}).get("conversations"), discarded)
    log = vllm.log()
    for pid, row in discarded.items():
        cut = row["discard"]
        assert cut["reason"] == "loop", cut
        d = cut["details"]
        assert d["onset_tokens"] < d["cut_tokens"] <= d["onset_tokens"] + 700 < MAX_TOKENS, d
        assert row["completion_tokens"] < MAX_TOKENS
        assert f"Aborted request(s) chatcmpl-{job_id('L', pid)}." in log, pid
    # What was kept ended by itself (stop, or max_tokens) and holds no loop the guard would have cut.
    for pid, row in kept.items():
        answer = row["conversations"][-1]["content"]
        assert row["finish_reason"] in ("stop", "length") and scan(answer, row["completion_tokens"]) is None, pid
    assert int(conn.get(keys.used_key("L")) or 0) == sum(r["completion_tokens"] for r in kept.values())
    led = dataset_status(cfg, "L")["ledger"]
    assert led["balanced"] and led["unaccounted"] == 0, led
