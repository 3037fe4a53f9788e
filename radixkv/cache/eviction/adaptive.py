"""Policies that keep entries in queues and remember what they evicted: ARC and S3-FIFO.

Both count queue sizes in tokens over every entry the cache holds (locked and inner ones too), and remember
evicted entries by their prefix key (``cache.key_of``: the radix tree's page-hash state through the entry's
first page, a hash block's chained key) in ghost lists holding at most as many tokens as the cache can (``capacity``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from radixkv.cache.base import CacheHints
from radixkv.cache.eviction.base import Entry, EvictionPolicy, Ghosts, LazyHeap, Live, check_param, reused


class ARC(EvictionPolicy):
    """Adaptive Replacement Cache (Megiddo and Modha, FAST'03), as vLLM's CPU offloading tier runs it, over a
    prefix cache's entries.

    T1 holds entries not reused since they entered, T2 entries reused (a match by another request than the
    last one to use it, ``CacheHints.request``, moves an entry to T2; anonymous lookups all count); each is
    least recently used first. B1 and B2 remember the keys of entries evicted from each. ``p``, T1's target
    in tokens, grows when an inserted entry is found in B1 (by its size x max(1, |B2| / |B1|)) and shrinks
    when found in B2; such an entry enters T2. Eviction takes T1's least recent while T1 holds more than
    ``p`` tokens, otherwise T2's (the other list when one has no candidate). O(log n) per push and pop,
    O(1) per hook plus ``key_of`` (O(page) for the radix tree: each node keeps its prefix state) at inserts
    and evictions.
    """

    name = "arc"
    observes = True

    def reset(self) -> None:
        super().reset()
        self.lists = (LazyHeap(self), LazyHeap(self))  # T1, T2 candidates
        self.sizes = [0, 0]  # tokens held in T1, T2
        self.ghosts = (Ghosts(), Ghosts())  # B1, B2
        self.p = 0.0

    def heaps(self) -> Sequence[LazyHeap]:
        return self.lists

    def push(self, entry: Entry) -> None:
        self.lists[entry.state].push(entry, entry.last_access)

    def pop(self, live: Live) -> Entry | None:
        first = 0 if self.sizes[0] > self.p else 1
        item = self.lists[first].pop(live) or self.lists[1 - first].pop(live)
        return None if item is None else item[1]

    def inserted(self, entry: Entry, hints: CacheHints) -> None:
        key, size, (b1, b2) = self.cache.key_of(entry), len(entry), self.ghosts
        ratio = b2.tokens / max(b1.tokens, 1), b1.tokens / max(b2.tokens, 1)  # before the hit leaves its list
        if b1.take(key):
            self.p = min(float(self.capacity()), self.p + size * max(1.0, ratio[0]))
            entry.state = 1
        elif b2.take(key):
            self.p = max(0.0, self.p - size * max(1.0, ratio[1]))
            entry.state = 1
        else:
            entry.state = 0
        self.sizes[entry.state] += size
        entry.user = hints.request

    def touched(self, entries: Sequence[Entry], hints: CacheHints, hit: bool) -> None:
        for entry in entries:
            if hit and entry.state == 0 and reused(entry, hints):
                entry.state = 1
                self.sizes[0] -= len(entry)
                self.sizes[1] += len(entry)
            entry.user = hints.request

    def evicted(self, entry: Entry) -> None:
        self.sizes[entry.state] -= len(entry)
        self.ghosts[entry.state].add(self.cache.key_of(entry), len(entry), self.capacity())

    def check_invariants(self, entries: Sequence[Entry], require: Callable[..., None]) -> None:
        counted = [sum(len(e) for e in entries if e.state == i) for i in (0, 1)]
        require(counted == self.sizes, "arc: T1 and T2 sizes", f"counted {counted}, recorded {self.sizes}")
        require(all(e.state in (0, 1) for e in entries), "arc: every entry in T1 or T2")
        require(all(g.counted() for g in self.ghosts), "arc: ghost sizes")


class S3FIFO(EvictionPolicy):
    """S3-FIFO (Yang et al., SOSP'23): a small FIFO queue for new entries, a main one, and a ghost queue.

    New entries enter the small queue S (the main queue M if their key is a ghost's). A reuse (a match by
    another request than the last to use it, as ARC counts them) raises an entry's frequency (at most 3).
    While S holds at least ``small_ratio`` of the cache's tokens, eviction looks at S's oldest candidate:
    reused since it entered, it moves to M; otherwise it is evicted and its key becomes a ghost. Otherwise
    M's oldest: reused, it goes back to M's tail with its frequency lowered by one; otherwise it is evicted.
    O(log n) per push; a pop also pays for the moves it makes (each entry moves at most once per reuse);
    ``key_of`` at inserts and evictions.

    Args:
        small_ratio: the small queue's share of the cache's tokens, in (0, 1) (default 0.1).
    """

    name = "s3fifo"
    observes = True
    params = ("small_ratio",)

    def __init__(self, small_ratio: float = 0.1):
        check_param("s3fifo", "small_ratio", small_ratio, 0.0)
        if not 0 < small_ratio < 1:
            raise ValueError(f"s3fifo: small_ratio must be in (0, 1), got {small_ratio!r}")
        self.small_ratio = float(small_ratio)
        super().__init__()

    def reset(self) -> None:
        super().reset()
        self.queues = (LazyHeap(self), LazyHeap(self))  # S, M candidates by queue position
        self.sizes = [0, 0]
        self.ghosts = Ghosts()
        self._position = 0

    def heaps(self) -> Sequence[LazyHeap]:
        return self.queues

    def _enqueue(self, entry: Entry, queue: int, freq: int) -> None:
        self._position += 1
        entry.state = (queue, freq, self._position)

    def push(self, entry: Entry) -> None:
        queue, _, position = entry.state
        self.queues[queue].push(entry, position)

    def pop(self, live: Live) -> Entry | None:
        while True:
            small = self.sizes[0] >= self.small_ratio * self.cache.total_size
            item = self.queues[0 if small else 1].pop(live) or self.queues[1 if small else 0].pop(live)
            if item is None:
                return None
            entry = item[1]
            queue, freq, _ = entry.state
            if freq == 0:
                return entry
            if queue == 0:  # hit while small: promote
                self.sizes[0] -= len(entry)
                self.sizes[1] += len(entry)
            self._enqueue(entry, 1, 0 if queue == 0 else freq - 1)
            self.push(entry)

    def inserted(self, entry: Entry, hints: CacheHints) -> None:
        queue = 1 if self.ghosts.take(self.cache.key_of(entry)) else 0
        self._enqueue(entry, queue, 0)
        self.sizes[queue] += len(entry)
        entry.user = hints.request

    def touched(self, entries: Sequence[Entry], hints: CacheHints, hit: bool) -> None:
        for entry in entries:
            if hit and reused(entry, hints):
                queue, freq, position = entry.state
                entry.state = (queue, min(freq + 1, 3), position)
            entry.user = hints.request

    def evicted(self, entry: Entry) -> None:
        queue = entry.state[0]
        self.sizes[queue] -= len(entry)
        if queue == 0:
            self.ghosts.add(self.cache.key_of(entry), len(entry), self.capacity())

    def check_invariants(self, entries: Sequence[Entry], require: Callable[..., None]) -> None:
        counted = [sum(len(e) for e in entries if e.state[0] == q) for q in (0, 1)]
        require(counted == self.sizes, "s3fifo: S and M sizes", f"counted {counted}, recorded {self.sizes}")
        require(all(0 <= e.state[1] <= 3 for e in entries), "s3fifo: frequencies in [0, 3]")
        require(self.ghosts.counted(), "s3fifo: ghost size")
