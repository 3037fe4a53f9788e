"""A clairvoyant radix tree: evict the leaf whose next use lies farthest ahead (Belady's MIN).

It is a reference, not a policy an engine could run: it is given the whole
workload in advance. ``FutureUses`` indexes, for every position of every
prompt, which requests will match through it; the cache asks it, whenever a
leaf becomes an eviction candidate, which not-yet-served request reaches that
leaf's first page soonest (in arrival order).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import numpy as np

from radixkv.cache.radix import RadixCache, RadixNode

_ITEM = 8


class FutureUses:
    """For each tree position, the requests (by arrival rank) whose cacheable prefix passes through it.

    Built from ``(tokens, namespace)`` per request in arrival order, where
    ``tokens`` is what the request will match. ``served(rank)`` marks a request
    as no longer in the future. Building is O(total tokens) memcmp work plus
    O(depth) per request.
    """

    def __init__(self, prefixes: Sequence[tuple[np.ndarray, Hashable]], page_size: int = 1):
        self.tree = RadixCache(page_size=page_size)
        slot = 0
        for tokens, ns in prefixes:
            self.tree.insert(tokens, np.arange(slot, slot + len(tokens)), ns)
            slot += len(tokens)
        self.uses: dict[int, list[int]] = {}
        for rank, (tokens, ns) in enumerate(prefixes):
            node = self.tree.match_prefix(tokens, ns).node  # every prefix end is a node boundary
            while node.parent is not None:
                self.uses.setdefault(id(node), []).append(rank)
                node = node.parent
        self._served: set[int] = set()

    def served(self, rank: int) -> None:
        self._served.add(rank)

    def next_use(self, prefix: bytes, namespace: Hashable) -> float:
        """Arrival rank of the first unserved request matching through ``prefix``'s last page; inf if none."""
        node = self.tree.root_of(namespace)
        if node is None:
            return float("inf")
        pb, off = _ITEM * self.tree.page_size, 0
        while off < len(prefix):
            node = node.children.get(prefix[off : off + pb])
            if node is None or prefix[off : off + len(node.key)] != node.key[: len(prefix) - off]:
                return float("inf")
            off += len(node.key)
        ranks = self.uses.get(id(node), ())
        i = next((i for i, rank in enumerate(ranks) if rank not in self._served), len(ranks))
        if i > 8:  # drop the served head once it grows, keeping lookups short
            del ranks[:i]
            i = 0
        return ranks[i] if i < len(ranks) else float("inf")


class BeladyRadixCache(RadixCache):
    """``RadixCache`` whose eviction order is Belady's: farthest next use first.

    A leaf's priority (``farthest_first``, passed to ``RadixCache`` as its
    ``priority``) is computed from ``future`` when it becomes a candidate and
    again whenever a match touches it; O(depth) Python steps plus copying the
    leaf's whole prefix (O(prefix tokens)) per computation.
    """

    def __init__(self, future: FutureUses, page_size: int = 1):
        if future.tree.page_size != page_size:
            raise ValueError("FutureUses and the cache must use the same page_size")
        self.future = future
        super().__init__(page_size=page_size, eviction_policy="belady", priority=self.farthest_first)

    def farthest_first(self, node: RadixNode) -> float:
        """The eviction priority of leaf ``node``: minus the arrival rank of the first unserved request that
        will match through its first page (-inf when none will), so the farthest next use goes first."""
        parts = [node.key[: _ITEM * self.page_size]]
        walk = node.parent
        while walk.parent is not None:
            parts.append(walk.key)
            walk = walk.parent
        prefix = b"".join(reversed(parts))
        return -self.future.next_use(prefix, self.namespace_of(walk))
