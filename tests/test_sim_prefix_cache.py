"""The simulator's radix cache (simulator/model.py PrefixCache), reported like SGLang 0.5.x:
chat usage.prompt_tokens_details.cached_tokens only with --enable-cache-report
(usage_processor.calculate_response_usage), /generate meta_info.cached_tokens always."""

from __future__ import annotations

from budgetq.simulator.prefix_cache import CHUNK_TOKENS, PrefixCache
from tests.test_simulator import CHAT, get, post, run_sim

SYSTEM = "You are a careful assistant. " * 40    # 1,160 characters: 18 whole chunks of 64


def _chat(question: str) -> dict:
    return {"model": "m", "max_tokens": 4, "messages": [{"role": "system", "content": SYSTEM},
                                                        {"role": "user", "content": question}]}


def test_chat_reports_cached_prefix_tokens_and_prefill_skips_them():
    async def scenario(c, u):
        _, first = await post(c, u + CHAT, _chat("What is a token?"))
        _, second = await post(c, u + CHAT, _chat("What is a budget?"))
        _, stats = await get(c, u + "/sim/stats")
        return first["usage"], second["usage"], stats

    first, second, stats = run_sim(scenario, radix_cache=True, enable_cache_report=True, instant=True)
    assert first["prompt_tokens_details"] == {"cached_tokens": 0}
    cached = second["prompt_tokens_details"]["cached_tokens"]
    assert cached == (len(SYSTEM) // 64) * CHUNK_TOKENS           # the shared system prompt, chunk-aligned
    assert cached < second["prompt_tokens"]
    assert stats["cached_tokens"] == cached


def test_chat_usage_has_no_details_without_cache_report_and_generate_meta_always_has_them():
    async def scenario(c, u):
        _, chat = await post(c, u + CHAT, _chat("q"))
        ids = list(range(100))
        _, g1 = await post(c, u + "/generate", {"input_ids": ids, "sampling_params": {"max_new_tokens": 2}})
        _, g2 = await post(c, u + "/generate", {"input_ids": ids, "sampling_params": {"max_new_tokens": 2}})
        return chat["usage"], g1["meta_info"], g2["meta_info"]

    usage, g1, g2 = run_sim(scenario, radix_cache=True, instant=True)
    assert usage["prompt_tokens_details"] is None
    assert g1["cached_tokens"] == 0 and g2["cached_tokens"] == 96   # 6 whole chunks of 16 ids (< 100 - 1)


def test_without_radix_cache_nothing_is_cached():
    async def scenario(c, u):
        for _ in range(2):
            _, body = await post(c, u + CHAT, _chat("same"))
        return body["usage"]

    assert run_sim(scenario, enable_cache_report=True, instant=True)["prompt_tokens_details"] == {"cached_tokens": 0}


def test_lru_evicts_least_recently_used_prefixes_past_capacity():
    cache = PrefixCache(capacity_tokens=4 * CHUNK_TOKENS)   # 4 chunks
    a, b = list(range(64)), list(range(1000, 1064))         # 4 chunks each
    assert cache.match_insert(a, 64) == 0
    assert cache.match_insert(a, 64) == 63                   # all cached, minus the last token
    assert cache.match_insert(b, 64) == 0                    # b evicts a
    assert cache.match_insert(a, 64) == 0
    assert cache.match_insert(a[:32] + [7] * 32, 64) == 2 * CHUNK_TOKENS   # shares 2 leading chunks
