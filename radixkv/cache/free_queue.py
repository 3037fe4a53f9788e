"""Queues of unlocked cache entries, from which eviction takes its victims.

``FreeQueue`` is vLLM's free block queue: entries leave from the head in the
order they were released (least recently released first), O(1) per
operation. ``PolicyFreeQueue`` lets an eviction policy (:mod:`radixkv.cache.eviction`) order them, for
the other policies. Both take batches "reversed": a chain's last entry is queued first,
so on equal standing a chain's tail is evicted before its head.

A cache whose entries form chains (``HashBlockCache``) must never evict an
entry while an entry that chains from it is still cached. ``FreeQueue``
leaves that to the order in which the cache queues entries (children ahead of
their parents; its head then never has a child). ``PolicyFreeQueue`` ranks
entries by their own statistics, which need not respect the chain, so it
takes a ``waits`` predicate: an entry that still has children is passed over
when it surfaces, stays queued, and is ranked again by ``ready`` once it may
leave.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from radixkv.cache.eviction import EvictionPolicy

_PASSED_OVER = 0  # the stamp of an entry pop() passed over: never a policy's stamp (they start at 1)


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

    def demote(self, chain: Sequence[Any]) -> None:
        """Move the tail of ``chain`` (entries root side first, each chaining from the one before) to the head,
        last entry first, as far up as each queued entry chains to nothing but the next (``num_children``):
        an entry with another child stays behind that child."""
        movable = []
        for item in reversed(chain):  # the chain's last entry has no child, each other one the next entry
            if item not in self._items or item.num_children != (1 if movable else 0):
                break
            movable.append(item)
        for item in reversed(movable):  # root side first: the chain's last entry ends at the head
            self._items.move_to_end(item, last=False)

    def put_back(self, item: Any) -> None:
        """Queue ``item``, which ``pop`` just took, at the head again."""
        self._items[item] = None
        self._items.move_to_end(item, last=False)

    def remove_many(self, items: Sequence[Any]) -> None:
        """Take every queued one of ``items`` out."""
        pop = self._items.pop
        for item in items:
            pop(item, None)

    def pop(self) -> Any | None:
        """The head item, removed; None when empty."""
        return self._items.popitem(last=False)[0] if self._items else None


class PolicyFreeQueue:
    """The unlocked entries, ordered by an eviction policy (:mod:`radixkv.cache.eviction`).

    The policy keeps the candidates (its lazy heaps); this queue keeps which entries are queued, so a removed
    entry's heap items go stale. Push, pop and remove cost the policy's O(log n) amortized.

    ``waits(entry)``, when given, holds an entry back: ``pop`` passes over it
    (it stays queued, without a heap item) and ``ready`` ranks it again.
    Each pass-over costs one O(log n) pop, paid again only after ``ready``
    or ``refresh`` pushed the entry anew.
    """

    ranks_by_stats = True  # entries must be re-ranked when their statistics change

    def __init__(self, policy: EvictionPolicy, waits: Callable[[Any], Any] | None = None):
        self._policy = policy
        self._waits = waits
        self._members: set[Any] = set()

    def __len__(self) -> int:
        return len(self._members)

    def __contains__(self, item: Any) -> bool:
        return item in self._members

    def _live(self, item: Any) -> bool:
        if item not in self._members:
            return False
        if self._waits is not None and self._waits(item):
            item.stamp = _PASSED_OVER  # its only live heap item is gone: ready() pushes it again
            return False
        return True

    def push_reversed(self, items: Sequence[Any]) -> None:
        policy = self._policy
        for item in reversed(items):
            self._members.add(item)
            policy.push(item)
        if policy.heap_size() > 2 * len(self._members) + 64:
            policy.compact(self._live)

    def refresh(self, items: Sequence[Any]) -> None:
        """Re-rank the queued ones among ``items`` after their statistics changed (a lookup hit them)."""
        self.push_reversed([item for item in items if item in self._members])

    def ready(self, item: Any) -> None:
        """Rank ``item`` again if ``pop`` passed over it (it may leave now); otherwise nothing. O(log n)."""
        if item.stamp == _PASSED_OVER and item in self._members:
            self._policy.push(item)

    def demote(self, chain: Sequence[Any]) -> None:
        """Re-rank the queued entries of ``chain`` (their ``last_access`` just dropped)."""
        self.refresh(chain)

    def put_back(self, item: Any) -> None:
        """Queue ``item``, which ``pop`` just took, again (ranked as before)."""
        self.push_reversed([item])

    def remove_many(self, items: Sequence[Any]) -> None:
        self._members.difference_update(items)

    def pop(self) -> Any | None:
        """The policy's next victim among the queued items that do not wait, removed; None when there is none."""
        item = self._policy.pop(self._live)
        if item is not None:
            self._members.remove(item)
        return item

    def ranked(self) -> set[Any]:
        """The queued items that have a live heap item (those ``pop`` can reach). O(heap), for checks."""
        ids = self._policy.candidates()
        return {item for item in self._members if id(item) in ids}
