"""Queues of unreferenced cache entries, from which eviction takes its victims.

``FreeQueue`` is vLLM's free block queue: entries leave from the head in the
order they were released (least recently released first), O(1) per
operation. ``PriorityFreeQueue`` orders entries by an eviction-policy priority
(:mod:`radixkv.cache.eviction`) with a lazy binary heap, for the other
policies. Both take batches "reversed": a chain's last entry is queued first,
so on equal standing a chain's tail is evicted before its head.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any


class FreeQueue:
    """Insertion-ordered queue (least recently released at the head). All operations O(1)."""

    ranks_by_stats = False  # the order is release order: lookups do not move entries

    def __init__(self) -> None:
        self._items: OrderedDict[Any, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, item: Any) -> bool:
        return item in self._items

    def push_reversed(self, items: Sequence[Any]) -> None:
        """Append ``items`` at the tail, last item first."""
        queue = self._items
        for item in reversed(items):
            queue[item] = None

    def refresh(self, items: Sequence[Any]) -> None:
        """Nothing: the order is release order, which a lookup does not change (vLLM's free queue)."""

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

    def pop_many(self, n: int) -> list[Any]:
        """Up to ``n`` items from the head, removed, head first."""
        popitem = self._items.popitem
        return [popitem(last=False)[0] for _ in range(min(n, len(self._items)))]


class PriorityFreeQueue:
    """Entries ordered by ``priority(entry)`` (smallest first), ties by push order.

    A lazy heap: re-prioritizing pushes a new entry and stale ones are skipped
    when they surface; the heap is rebuilt from the live entries when it holds
    more than 2 x live + 64. Push, pop and remove cost O(log n) amortized. Entries need a writable
    ``stamp`` attribute.
    """

    ranks_by_stats = True  # entries must be re-ranked when their statistics change

    def __init__(self, priority: Callable[[Any], float]):
        self._priority = priority
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

    def remove(self, item: Any) -> None:
        self._members.discard(item)

    def remove_many(self, items: Sequence[Any]) -> None:
        self._members.difference_update(items)

    def pop_many(self, n: int) -> list[Any]:
        out = []
        while len(out) < n:
            item = self.pop()
            if item is None:
                break
            out.append(item)
        return out

    def pop(self) -> Any | None:
        heap = self._heap
        while heap:
            _, seq, item = heapq.heappop(heap)
            if item.stamp == seq and item in self._members:
                self._members.remove(item)
                return item
        return None
