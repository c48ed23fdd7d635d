"""What the worker sends and keeps: generate mode with input_ids, reasoning, thinking, sampling."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Mapping

import pytest
from transformers import AutoTokenizer

from budgetq.shared.identity import job_id
from budgetq.worker.sglang_wire import job_id_of_rid
from tests.helpers import PY, ROOT, rows, sim_get, write_config, write_dataset
from tests.tiny_tokenizer import make_tiny_tokenizer


def _run(cfg) -> None:
    prod = subprocess.Popen([*PY, "produce", "-c", str(cfg)], cwd=ROOT)
    try:
        subprocess.run([*PY, "worker", "--burst", "-c", str(cfg)], cwd=ROOT, check=True, timeout=60)
        # a second burst worker picks up whatever the producer enqueued after the first one left
        while prod.poll() is None:
            subprocess.run([*PY, "worker", "--burst", "-c", str(cfg)], cwd=ROOT, check=True, timeout=60)
    finally:
        assert prod.wait(60) == 0


def test_generate_mode_sends_the_templated_input_ids(tmp_path, redis_url, conn, sim_factory):
    tok_path = make_tiny_tokenizer(tmp_path / "tok", words=[f"p{i}" for i in range(10)])
    sim = sim_factory("--speedup", "100", "--length-mean", "40", "--seed", "6")
    write_dataset(tmp_path / "D.jsonl", 10)
    cfg = write_config(tmp_path, redis_url, [sim], [{
        "name": "D", "path": str(tmp_path / "D.jsonl"), "budget": "1M", "id_field": "id",
        "system_prompt": "you are a helpful assistant .", "chat_template_kwargs": {"enable_thinking": False},
        "sampling": {"max_tokens": 100, "temperature": 0.3, "top_k": 20, "seed": 7, "stop": ["</s>"],
                     "repetition_penalty": 1.1, "extra": {"min_new_tokens": 1}}}],
        server={"api": "generate", "tokenizer": tok_path})
    _run(cfg)
    tok = AutoTokenizer.from_pretrained(tok_path)
    out = rows(tmp_path / "out" / "D.jsonl")
    assert len(out) == 10
    by_job = {job_id_of_rid(r["rid"]): r for r in sim_get(sim, "/sim/requests")}
    for row in out:
        msgs = row["conversations"][:-1]
        want = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, enable_thinking=False)
        want = want["input_ids"] if isinstance(want, Mapping) else want
        rec = by_job[job_id("D", row["id"])]
        assert rec["endpoint"] == "generate"
        assert rec["input_ids_head"] == list(want[:8]) and rec["prompt_tokens"] == len(want)
        assert row["prompt_tokens"] == len(want)  # the server's count of what we sent
        assert row["conversations"][0] == {"role": "system", "content": "you are a helpful assistant ."}


@pytest.mark.parametrize("thinking", ["separate", "inline", "drop"])
@pytest.mark.parametrize("parser", [True, False])
def test_reasoning_is_kept_apart_inline_or_dropped(tmp_path, redis_url, conn, sim_factory, thinking, parser):
    args = ["--speedup", "200", "--length-mean", "60", "--reasoning-tokens-frac", "0.5"]
    if parser:
        args += ["--reasoning-parser", "qwen3"]  # the server separates reasoning_content
    sim = sim_factory(*args)
    write_dataset(tmp_path / "D.jsonl", 5)
    cfg = write_config(tmp_path, redis_url, [sim], [{
        "name": "D", "path": str(tmp_path / "D.jsonl"), "budget": "1M", "id_field": "id", "thinking": thinking,
        "sampling": {"max_tokens": 4000}}])
    _run(cfg)
    out = rows(tmp_path / "out" / "D.jsonl")
    assert len(out) == 5
    for row in out:
        reply = row["conversations"][-1]
        content = reply["content"]
        assert "reasoning_content" not in row  # on the assistant message only (SpecForge's layout)
        if thinking == "separate":
            assert reply["reasoning_content"], row
            assert "<think>" not in content and reply["reasoning_content"] not in content
        else:  # inline carries it once, in the content; drop nowhere
            assert "reasoning_content" not in reply
            assert ("<think>" in content) == (thinking == "inline")


def test_specforge_layout(tmp_path, redis_url, conn, sim_factory):
    sim = sim_factory("--speedup", "200", "--length-mean", "30")
    path = tmp_path / "D.jsonl"
    path.write_text(json.dumps({"id": "c1", "messages": [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": "old answer"},
        {"role": "user", "content": "and now?"}, {"role": "assistant", "content": "old answer 2"}]}) + "\n")
    cfg = write_config(tmp_path, redis_url, [sim], [{"name": "D", "path": str(path), "budget": "1M",
                                                     "id_field": "id", "messages_field": "messages"}])
    _run(cfg)
    (row,) = rows(tmp_path / "out" / "D.jsonl")
    # SpecForge reads id and conversations; the last assistant turn was regenerated
    assert row["id"] == "c1"
    assert [m["role"] for m in row["conversations"]] == ["user", "assistant", "user", "assistant"]
    assert row["conversations"][1]["content"] == "old answer"
    assert row["conversations"][-1]["content"] != "old answer 2"
    assert row["status"] == "success"
    assert set(row) >= {"id", "dataset", "conversations", "status", "prompt_tokens",
                        "completion_tokens", "finish_reason", "model", "endpoint", "latency_s"}
