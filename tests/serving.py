"""The request lifecycle used by the cache tests, with the checks every step must keep."""

from __future__ import annotations

from radixkv import SlotAllocator
from radixkv.cache.lifecycle import serve_once


def serve(cache, alloc: SlotAllocator, prompt, output=(), namespace=None) -> int:
    """``serve_once`` plus the invariants and slot conservation after it."""
    hit = serve_once(cache, alloc, list(prompt), list(output), namespace)
    cache.check_invariants()
    assert alloc.num_free + cache.evictable_size + cache.protected_size == alloc.capacity
    return hit
