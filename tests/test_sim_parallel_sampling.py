"""The simulator's /generate with ``sampling_params.n`` > 1, as SGLang runs it (tokenizer_manager
``_handle_batch_request``): each prompt is first prefilled once by a max_new_tokens=0 request (its radix-cache
warm-up), then expanded prompt-major into n requests with fresh rids, sample j of a seeded request seeded
seed + j (``_seed_for_parallel_sample``); the answer is a list even for one prompt. bench/samples_n.py measures
this against N requests (docs/benchmarks.md)."""

from __future__ import annotations

from budgetq.simulator.prefix_cache import CHUNK_TOKENS
from tests.test_simulator import get, post, run_sim, sse

IDS = list(range(1000, 1200))   # 200 prompt ids: 12 whole chunks of 16 can be cached (< 199)


def test_n_answers_of_one_prompt_prefill_it_once_and_get_fresh_rids_and_seeds():
    async def scenario(c, u):
        status, body = await post(c, u + "/generate", {"input_ids": IDS, "rid": "mine", "sampling_params": {
            "n": 3, "max_new_tokens": 40, "temperature": 0.8, "sampling_seed": 5}})
        _, recs = await get(c, u + "/sim/requests")
        return status, body, recs

    status, body, recs = run_sim(scenario, radix_cache=True, instant=True)
    assert status == 200 and isinstance(body, list) and len(body) == 3
    ids = [b["meta_info"]["id"] for b in body]
    assert len(set(ids)) == 3 and "mine" not in ids                   # the client's rid names none of them
    assert [b["meta_info"]["cached_tokens"] for b in body] == [12 * CHUNK_TOKENS] * 3   # prefilled once
    assert all(b["meta_info"]["completion_tokens"] == 40 for b in body)
    assert len(recs) == 4                                             # the warm-up, then the 3 samples
    warm, samples = recs[0], recs[1:]
    assert warm["rid"] not in ids and warm["completion_tokens"] == 0 and warm["cached_tokens"] == 0
    by_rid = {r["rid"]: r for r in samples}
    assert [by_rid[i]["sampling"]["sampling_seed"] for i in ids] == [5, 6, 7]
    assert all("n" not in by_rid[i]["sampling"] for i in ids)


def test_a_batch_with_n_is_expanded_prompt_major_and_mixed_n_is_refused():
    async def scenario(c, u):
        _, batch = await post(c, u + "/generate", {"input_ids": [IDS, IDS[:50]], "sampling_params": {
            "n": 2, "max_new_tokens": 8, "temperature": 1.0}})
        bad = await post(c, u + "/generate", {"input_ids": [IDS, IDS[:50]], "sampling_params": [
            {"n": 2, "max_new_tokens": 8}, {"n": 3, "max_new_tokens": 8}]})
        events = await sse(c, u + "/generate", {"text": "a prompt", "stream": True, "sampling_params": {
            "n": 2, "max_new_tokens": 300}})
        return batch, bad, events

    # Each sample gets a fresh rid, so its length is a fresh draw: a mean far past max_new_tokens makes both
    # run to 300 (at the default 1,500 one draw in a few hundred stopped short: CI saw 118)
    batch, (bad_status, bad), events = run_sim(scenario, radix_cache=True, instant=True, length_mean=1e6)
    assert [b["meta_info"]["prompt_tokens"] for b in batch] == [200, 200, 50, 50]
    assert bad_status == 400
    assert bad["error"]["message"] == "The parallel_sample_num should be the same for all samples in sample params."
    assert events[-1] == "[DONE]"
    finals = {e["index"]: e["meta_info"]["completion_tokens"] for e in events[:-1]
              if e["meta_info"]["finish_reason"] is not None}
    assert finals == {0: 300, 1: 300}                                 # two streams, each with its index
