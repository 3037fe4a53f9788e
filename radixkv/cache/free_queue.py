"""Queues of unlocked cache entries, from which eviction takes its victims.

``FreeQueue`` is vLLM's free block queue: entries leave from the head in the
order they were released (least recently released first), O(1) per
operation. ``PriorityFreeQueue`` orders entries by an eviction-policy priority
(:mod:`radixkv.cache.eviction`) with a lazy binary heap, for the other
policies. Both take batches "reversed": a chain's last entry is queued first,
so on equal standing a chain's tail is evicted before its head.

A cache whose entries form chains (``HashBlockCache``) must never evict an
entry while an entry that chains from it is still cached. ``FreeQueue``
leaves that to the order in which the cache queues entries (children ahead of
their parents; its head then never has a child). ``PriorityFreeQueue`` ranks
entries by their own statistics, which need not respect the chain, so it
takes a ``waits`` predicate: an entry that still has children is passed over
when it surfaces, stays queued, and is ranked again by ``ready`` once it may
leave.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from typing import Any

_PASSED_OVER = 0  # the stamp of an entry pop() passed over: never a heap sequence number (they start at 1)


class FreeQueue:
    """Insertion-ordered queue (least recently released at the head). All operations O(1)."""

    ranks_by_stats = False  # the order is release order: lookups do not move entries

    def __init__(self) -> None:
        self._items: OrderedDict[Any, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, item: Any) -> bool:
        return item in self._items

    def __iter__(self) -> Iterator[Any]:
        """The queued items, head (next to leave) first."""
        return iter(self._items)

    def push_reversed(self, items: Sequence[Any]) -> None:
        """Append ``items`` at the tail, last item first (one already queued keeps its place)."""
        self._items.update(dict.fromkeys(reversed(items)))

    def refresh(self, items: Sequence[Any]) -> None:
        """Nothing: the order is release order, which a lookup does not change (vLLM's free queue)."""

    def ready(self, item: Any) -> None:
        """Nothing: ``item``'s children were queued ahead of it, so it is already where it can leave."""

    def remove(self, item: Any) -> None:
        """Take ``item`` out if it is queued."""
        self._items.pop(item, None)

    def remove_many(self, items: Sequence[Any]) -> None:
        """Take every queued one of ``items`` out."""
        pop = self._items.pop
        for item in items:
            pop(item, None)

    def pop(self) -> Any | None:
        """The head item, removed; None when empty."""
        return self._items.popitem(last=False)[0] if self._items else None


class PriorityFreeQueue:
    """Entries ordered by ``priority(entry)`` (smallest first), ties by push order.

    A lazy heap: re-prioritizing pushes a new entry and stale ones are skipped
    when they surface; the heap is rebuilt from the live entries when it holds
    more than 2 x live + 64. Push, pop and remove cost O(log n) amortized. Entries need a writable
    ``stamp`` attribute.

    ``waits(entry)``, when given, holds an entry back: ``pop`` passes over it
    (it stays queued, without a heap entry) and ``ready`` ranks it again.
    Each pass-over costs one O(log n) pop, paid again only after ``ready``
    or ``refresh`` pushed the entry anew.
    """

    ranks_by_stats = True  # entries must be re-ranked when their statistics change

    def __init__(self, priority: Callable[[Any], float], waits: Callable[[Any], Any] | None = None):
        self._priority = priority
        self._waits = waits
        self._heap: list[tuple[float, int, Any]] = []
        self._members: set[Any] = set()
        self._seq = 0

    def __len__(self) -> int:
        return len(self._members)

    def __contains__(self, item: Any) -> bool:
        return item in self._members

    def _push(self, item: Any) -> None:
        self._seq += 1
        item.stamp = self._seq
        heapq.heappush(self._heap, (self._priority(item), self._seq, item))

    def push_reversed(self, items: Sequence[Any]) -> None:
        for item in reversed(items):
            self._members.add(item)
            self._push(item)
        if len(self._heap) > 2 * len(self._members) + 64:
            self._heap = [e for e in self._heap if e[2].stamp == e[1] and e[2] in self._members]
            heapq.heapify(self._heap)

    def refresh(self, items: Sequence[Any]) -> None:
        """Re-rank the queued ones among ``items`` after their statistics changed (a lookup hit them)."""
        self.push_reversed([item for item in items if item in self._members])

    def ready(self, item: Any) -> None:
        """Rank ``item`` again if ``pop`` passed over it (it may leave now); otherwise nothing. O(log n)."""
        if item.stamp == _PASSED_OVER and item in self._members:
            self._push(item)

    def remove(self, item: Any) -> None:
        self._members.discard(item)

    def remove_many(self, items: Sequence[Any]) -> None:
        self._members.difference_update(items)

    def pop(self) -> Any | None:
        """The queued item of smallest priority that does not wait, removed; None when there is none."""
        heap, waits = self._heap, self._waits
        while heap:
            _, seq, item = heapq.heappop(heap)
            if item.stamp == seq and item in self._members:
                if waits is not None and waits(item):
                    item.stamp = _PASSED_OVER  # its only live entry is gone: ready() pushes it again
                    continue
                self._members.remove(item)
                return item
        return None

    def ranked(self) -> set[Any]:
        """The queued items that have a live heap entry (those ``pop`` can reach). O(heap), for checks."""
        return {item for _, seq, item in self._heap if item.stamp == seq and item in self._members}
