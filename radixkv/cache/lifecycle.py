"""One request's whole life against a prefix cache, without a model.

The steps every user of a cache repeats (the simulator and engine do the same
with time in between): match with the at-least-one-token rule, lock, allocate
the rest (evicting when short), insert prompt plus output, free the duplicates
and whatever the cache did not take, unlock.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import numpy as np

from radixkv.cache.base import PrefixCache, TokenSeq, match_for_prefill
from radixkv.memory import SlotAllocator


def serve_once(
    cache: PrefixCache,
    allocator: SlotAllocator,
    prompt: TokenSeq,
    output: Sequence[int] = (),
    namespace: Hashable = None,
) -> int:
    """Serve one request to completion and return how many prompt tokens hit the cache.

    What is inserted is the prompt plus all but the last output token (the
    last one's KV is never computed). Raises ``OutOfSlotsError`` when the
    request cannot fit even after evicting everything evictable; the cache
    and allocator are left as they were apart from that eviction.
    """
    prompt = np.asarray(prompt, dtype=np.int64).reshape(-1)
    m = match_for_prefill(cache, prompt, namespace)
    cache.lock(m.node)
    try:
        seq = np.concatenate([prompt, np.asarray(output[:-1], dtype=np.int64)]) if len(output) else prompt
        need = len(seq) - m.length
        if allocator.num_free < need:
            allocator.free(cache.evict(need - allocator.num_free))
        slots = np.concatenate([m.indices, allocator.alloc(need)])
        already = cache.insert(seq, slots, namespace)
        allocator.free(slots[m.length : already])  # duplicates of what the cache already held
        allocator.free(slots[max(cache.cacheable_length(len(seq)), m.length) :])  # what it did not take
    finally:
        cache.unlock(m.node)
    return m.length
