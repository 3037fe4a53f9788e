"""What a router believes each replica caches, built from the requests it routed (no events).

One ``RadixCache`` per replica holds the token sequences the router sent there (slot values are
placeholders: nothing is allocated). SGLang's router keeps the same kind of approximate tree, over text.
"""

from __future__ import annotations

from collections.abc import Hashable

import numpy as np

from radixkv.cache.radix import RadixCache


class ReplicaTrees:
    """An approximate prefix tree per replica; ``capacity`` (tokens, None: unbounded) trims each to its
    least recently used leaves after every insert, so a tree can follow a replica's KV budget.
    Match and insert are O(n) memcmp work + O(depth) Python steps per replica."""

    def __init__(self, replicas: int, capacity: int | None = None):
        self.trees = [RadixCache(page_size=1) for _ in range(replicas)]
        self.capacity = capacity

    def __len__(self) -> int:
        return len(self.trees)

    def grow(self, replicas: int) -> None:
        """Make room for ``replicas`` replicas (a router learns N from its first views); trees kept."""
        self.trees += [RadixCache(page_size=1) for _ in range(replicas - len(self.trees))]

    def match(self, tokens: np.ndarray, namespace: Hashable = None) -> list[int]:
        """How many leading tokens of ``tokens`` each replica is believed to cache (refreshes their recency)."""
        return [t.match_prefix(tokens, namespace).length for t in self.trees]

    def insert(self, replica: int, tokens: np.ndarray, namespace: Hashable = None) -> None:
        self.trees[replica].insert(tokens, np.zeros(len(tokens), dtype=np.int64), namespace)
        if self.capacity is not None:
            self.trim(replica, self.capacity)

    def trim(self, replica: int, max_size: int) -> None:
        """Evict least recently used leaves of one tree until it holds at most ``max_size`` tokens."""
        tree = self.trees[replica]
        if tree.total_size > max_size:
            tree.evict(tree.total_size - max_size)

    def sizes(self) -> list[int]:
        return [t.total_size for t in self.trees]

    def clear(self, replica: int) -> None:
        self.trees[replica].reset()
