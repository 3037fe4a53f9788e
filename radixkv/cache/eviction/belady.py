"""``belady``: evict the leaf whose next use lies farthest ahead (Belady's MIN), the clairvoyant reference.

No engine could run it: it ``needs_future``, the whole workload in advance (``FutureUses``, which only the
simulator builds and ``make_cache(..., future=...)`` hands it). It ranks a radix tree's leaves: whenever a
leaf becomes a candidate and whenever a match touches it, its priority is minus the arrival rank of the first
not-yet-served request that matches through its first page (-inf when none will), so the farthest next use
goes first. O(depth) Python steps plus copying the leaf's whole prefix (O(prefix tokens)) per push.
"""

from __future__ import annotations

from typing import Any

from radixkv.cache.eviction.base import Entry, EvictionPolicy

_ITEM = 8  # bytes per token id in a radix key


class Belady(EvictionPolicy):
    """Farthest next use first, from ``future`` (see the module doc). Radix tree only."""

    name = "belady"
    needs_future = True

    def __init__(self, future: Any = None):  # a cache.future.FutureUses (which imports the tree, which imports us)
        self.future = future
        super().__init__()

    def bind(self, cache: Any, live: Any = None) -> EvictionPolicy:
        if not hasattr(self.future, "next_use"):  # a FutureUses (imported by nothing here: it imports the tree)
            raise ValueError("eviction policy 'belady' needs future=FutureUses(...), which only the simulator has")
        if not hasattr(cache, "namespace_of"):  # ranks a tree's leaves by their place in it
            raise ValueError("eviction_policy='belady' is implemented for the radix cache only")
        if self.future.tree.page_size != cache.page_size:
            raise ValueError("the future uses and the cache must have the same page_size")
        return super().bind(cache, live)

    def priority(self, entry: Entry) -> float:
        path, root = entry.parent.path()  # the nodes above the leaf's edge, and its tree's root
        prefix = b"".join([node.key for node in path] + [entry.key[: _ITEM * self.cache.page_size]])
        return -self.future.next_use(prefix, self.cache.namespace_of(root))
