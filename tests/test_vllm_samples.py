"""samples: N in front of a real engine: vLLM's CPU build (the run's shared server, tests/conftest.py ``vllm``).

Every answer is its own request with its own seed, so a burst of them is a burst of seeded requests. vLLM's CPU
build dies on a seeded request whose prompt it prefills in chunks ("CPU Generator does not use offset",
docs/vllm.md: serve it with ``--no-enable-chunked-prefill``; ``python bench/samples_n.py --engine vllm
--chunked-prefill`` shows the crash). The suite's shared server runs with vLLM's defaults, which the other vLLM
tests' timings were measured with, so the prompts here are short: 16 of them at once fit one engine step and
none is split.
"""

from __future__ import annotations

import json
import re

import pytest

from budgetq.shared.identity import answer_id, answer_seed, job_id
from budgetq.shared.ledger import read_ledger
from tests.helpers import check_invariants, rows, run_to_completion, write_config, write_dataset
from tests.vllm_server import MODEL_NAME

pytestmark = pytest.mark.timeout(300, func_only=True)

PROMPT = "Story {i}. You are a careful writer: write the story."
SAMPLES = 4


def test_every_answer_reaches_vllm_with_its_own_seed_and_the_engine_survives_a_seeded_burst(
        tmp_path, redis_url, conn, vllm):
    path = tmp_path / "S.jsonl"
    ids = write_dataset(path, 4)
    path.write_text("".join(json.dumps({"id": i, "prompt": PROMPT.format(i=i)}) + "\n" for i in ids))
    spec = {"name": "S", "path": str(path), "id_field": "id", "budget": "10M", "samples": SAMPLES,
            "prior_mean_tokens": 20, "sampling": {"max_tokens": 16, "temperature": 0.9, "seed": 3}}
    cfg = write_config(tmp_path, redis_url, [vllm.url], [spec], worker={"concurrency": 16},
                       server={"model": MODEL_NAME, "backoff_base_s": 0.05, "health_interval_s": 0.3})
    log_start = len(vllm.log())
    run_to_completion(cfg, tmp_path)
    want = [str(answer_id(p, k)) for p in ids for k in range(1, SAMPLES + 1)]
    states = check_invariants(conn, tmp_path / "out", "S", want)
    assert states["committed"] == len(want) == 16 and states["failed"] == 0
    kept = {str(r["id"]): r for r in rows(tmp_path / "out" / "S.jsonl")}
    assert sorted(kept) == sorted(want)
    for p in ids:     # the answers of a prompt are independent draws, not one answer written four times
        texts = {kept[str(answer_id(p, k))]["conversations"][-1]["content"] for k in range(1, SAMPLES + 1)}
        assert len(texts) >= 3, (p, texts)
    assert read_ledger(conn, "S")["balanced"]
    # vLLM's own log (--enable-log-requests): each answer's request carried the answer's seed
    log = vllm.log()[log_start:]
    assert "EngineCore encountered" not in log and "CPU Generator does not use offset" not in log
    by_job = {job_id("S", a): a for a in want}
    seen: dict[str, set[int]] = {}
    for rid, seed in re.findall(r"Received request \S*?(S--[^.\s]+)\.[0-9a-f]+(?:-\S*)?: params: .*?\bseed=(\d+)", log):
        if rid in by_job:
            seen.setdefault(by_job[rid], set()).add(int(seed))
    assert sorted(seen) == sorted(want), [line for line in log.splitlines() if "Received request" in line][:3]
    for a, seeds in seen.items():
        prompt, _, k = a.partition("#")
        assert seeds == {answer_seed(3, "S", prompt, int(k) if k else 1)}, a
