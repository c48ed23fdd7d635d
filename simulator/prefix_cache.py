"""The simulator's prefix (radix) cache: how many leading prompt tokens a server already holds."""

from __future__ import annotations

from collections import OrderedDict

CHUNK_TOKENS = 16     # the cache's unit (SGLang's radix tree matches token by token; 16 is close enough)
CHARS_PER_TOKEN = 4   # texts.estimate_tokens' ratio: a text chunk of 64 characters is 16 tokens


class PrefixCache:
    """SGLang's radix cache, as far as the time model needs it: how many leading prompt tokens
    were seen before (mem_cache/radix_cache.py RadixCache.match_prefix), with LRU eviction
    when the cached tokens pass the KV pool (evict(), leaves least recently used first).

    A prompt is cut into chunks of CHUNK_TOKENS tokens (64 characters of text, or 16 ids); each
    chunk is keyed by a hash chained over the chunks before it, so a key stands for the whole
    prefix up to its end, like a path in the radix tree. A prompt matches as many leading chunks
    as are cached, then all of its chunks are inserted (SGLang inserts after prefill; inserting
    at arrival means two same-prefix requests arriving together both hit, as an in-batch prefix
    share would make them). SGLang always computes the last token, so at most prompt_tokens - 1
    are cached.
    """

    def __init__(self, capacity_tokens: int) -> None:
        self.capacity_chunks = max(1, capacity_tokens // CHUNK_TOKENS)
        self._lru: OrderedDict[int, None] = OrderedDict()

    def match_insert(self, prompt: str | list[int], prompt_tokens: int) -> int:
        """Cached tokens of ``prompt`` (before this request), and ``prompt`` cached from now on."""
        step = CHUNK_TOKENS * CHARS_PER_TOKEN if isinstance(prompt, str) else CHUNK_TOKENS
        h, matched, missed = 0, 0, False
        for at in range(0, len(prompt) - step + 1, step):   # whole chunks only
            chunk = prompt[at:at + step]
            h = hash((h, chunk if isinstance(chunk, str) else tuple(chunk)))
            if not missed and h in self._lru:
                matched += 1
                self._lru.move_to_end(h)
                continue
            missed = True
            self._lru[h] = None
        while len(self._lru) > self.capacity_chunks:
            self._lru.popitem(last=False)
        return max(0, min(prompt_tokens - 1, matched * CHUNK_TOKENS))

    def clear(self) -> None:
        self._lru.clear()
