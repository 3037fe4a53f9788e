"""``FutureUses``: what a clairvoyant eviction policy is handed, every request's prefix in the order served.

Only the simulator can build it (it knows the whole workload in advance); a policy that ``needs_future``
(:mod:`radixkv.cache.eviction`) is handed one by ``make_cache(..., future=...)``.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import numpy as np

from radixkv.cache.radix import RadixCache

_ITEM = 8


class FutureUses:
    """For each tree position, the requests (by the rank they will be served in) whose cacheable prefix passes
    through it.

    Built from ``(tokens, namespace)`` per request in arrival order, where ``tokens`` is what the request will
    match, and ``order``: the requests' indices in the order they will be served (None: arrival order; a
    reordering scheduler serves another, which ``radixkv.sim.served`` finds). ``served(index)`` marks a
    request as no longer in the future. Building is O(total tokens) memcmp work plus O(depth) per request.
    """

    def __init__(self, prefixes: Sequence[tuple[np.ndarray, Hashable]], page_size: int = 1,
                 order: Sequence[int] | None = None):
        self.tree = RadixCache(page_size=page_size)
        slot = 0
        for tokens, ns in prefixes:
            self.tree.insert(tokens, np.arange(slot, slot + len(tokens)), ns)
            slot += len(tokens)
        ends = [self.tree.match_prefix(tokens, ns).node for tokens, ns in prefixes]  # prefix ends are boundaries
        order = range(len(ends)) if order is None else [int(i) for i in order]
        if not isinstance(order, range) and sorted(order) != list(range(len(ends))):
            raise ValueError(f"order must hold each of the {len(ends)} requests' indices once")
        self.rank = np.empty(len(ends), dtype=np.int64)  # index -> its rank in the served order
        self.rank[list(order)] = np.arange(len(ends))
        self.uses: dict[int, list[int]] = {}
        for rank, index in enumerate(order):
            node = ends[index]
            while node.parent is not None:
                self.uses.setdefault(id(node), []).append(rank)
                node = node.parent
        self._served: set[int] = set()

    def served(self, index: int) -> None:
        self._served.add(int(self.rank[index]))

    def next_use(self, prefix: bytes, namespace: Hashable) -> float:
        """The rank of the first unserved request matching through ``prefix``'s last page; inf if none."""
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
