"""One request's whole life against a prefix cache, without a model.

The steps every user of a cache repeats (the simulator and engine do the same
with time in between): match with the at-least-one-token rule, lock, allocate
the rest (evicting when short), insert prompt plus output, free the duplicates
and whatever the cache did not take, unlock.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import numpy as np

from radixkv.cache.base import NO_HINTS, CacheHints, PrefixCache, TokenSeq, match_for_prefill
from radixkv.memory import SlotAllocator


def commit_prefix(cache: PrefixCache, allocator: SlotAllocator, tokens: TokenSeq, slots: np.ndarray,
                  cached: int, node: Any, namespace: Hashable = None,
                  hints: CacheHints = NO_HINTS) -> tuple[Any, int, np.ndarray]:
    """Cache the KV a running request has computed so far, keeping the request's lock on it.

    ``tokens`` are the request's leading tokens whose KV sits at
    ``slots[:len(tokens)]``; the first ``cached`` slots are already the
    cache's (locked through ``node``). Inserts them, frees the slots the cache
    already held a copy of, re-matches so the request uses the cache's
    canonical slots from now on (it never points at freed duplicates) and
    moves the lock to the new node. Returns ``(node, cached, slots)``.
    """
    already = cache.insert(tokens, slots[: len(tokens)], namespace, hints)
    allocator.free(slots[cached:already])
    m = cache.match_prefix(tokens, namespace, hints)
    cache.lock(m.node)
    cache.unlock(node)
    return m.node, m.length, np.concatenate([m.indices, slots[m.length :]])


def release_sequence(cache: PrefixCache, allocator: SlotAllocator, tokens: TokenSeq, slots: np.ndarray,
                     cached: int, node: Any, namespace: Hashable = None, hints: CacheHints = NO_HINTS) -> None:
    """A finished request's last step: cache ``tokens`` (KV at ``slots``), free what the cache did not take, unlock.

    The first ``cached`` slots are the cache's; of the rest, the duplicates of
    blocks the cache already held and the tail it does not keep (a partial
    page or block, or everything for ``NoPrefixCache``) go back to ``allocator``.
    """
    already = cache.insert(tokens, slots, namespace, hints)
    allocator.free(slots[cached:already])  # duplicates of what the cache already held
    allocator.free(slots[max(cache.cacheable_length(len(tokens)), cached) :])  # what it did not take
    cache.unlock(node)


def serve_once(
    cache: PrefixCache,
    allocator: SlotAllocator,
    prompt: TokenSeq,
    output: Sequence[int] = (),
    namespace: Hashable = None,
    hints: CacheHints = NO_HINTS,
) -> int:
    """Serve one request to completion and return how many prompt tokens hit the cache.

    What is inserted is the prompt plus all but the last output token (the
    last one's KV is never computed). Raises ``OutOfSlotsError`` when the
    request cannot fit even after evicting everything evictable; the cache
    and allocator are left as they were apart from that eviction and the
    match's access statistics (recency, hit counts, and for hash blocks the
    released blocks' place in the free queue).
    """
    prompt = np.asarray(prompt, dtype=np.int64).reshape(-1)
    m = match_for_prefill(cache, prompt, namespace, hints)
    cache.lock(m.node)
    seq = np.concatenate([prompt, np.asarray(output[:-1], dtype=np.int64)]) if len(output) else prompt
    need = len(seq) - m.length
    try:
        if allocator.num_free < need:
            allocator.free(cache.evict(need - allocator.num_free))
        slots = np.concatenate([m.indices, allocator.alloc(need)])
    except BaseException:
        cache.unlock(m.node)
        raise
    release_sequence(cache, allocator, seq, slots, m.length, m.node, namespace, hints)
    return m.length
