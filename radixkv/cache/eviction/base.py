"""``EvictionPolicy``: what a prefix cache asks when it must free memory, and the classical policies.

A policy object serves one cache (``bind``). The cache hands it **candidates**: ``push(entry)`` whenever an
entry may be evicted next (an unlocked radix leaf, an unlocked hash block) or its statistics changed while
it may; ``pop(live)`` returns the next victim among the pushed entries that are still ``live`` (the cache's
own test: still a leaf, still unlocked). Entries are the caches' own records (``RadixNode``, ``Block``), and a
policy reads only what every entry carries:

* ``last_access`` / ``created``: ticks of the cache's logical clock (one per match, insert or release);
* ``hit_count``: matches through the entry (SGLang counts them the same way, per lookup);
* ``depth``: cached tokens before the entry (its prefix); ``len(entry)``: its own tokens;
* ``user``: the ``CacheHints.request`` of the last request that used it, for policies that count reuse
  per request (``reused``);
* ``state``: a slot the policy owns (a segment, a hold time, a learned feature), None until it writes it;
* ``stamp``: the policy's bookkeeping for its lazy heaps.

A policy that needs more than these (``observes = True``) is also told what happens to entries, with the
request's ``CacheHints`` and the cache's ``clock`` (seconds): ``inserted`` (a new entry), ``touched`` (the
entries of a matched or inserted path, root side first), ``split`` (a radix edge cut in two: the new upper
entry and the old lower one) and ``evicted`` (an entry leaving, still in place). That is all it ever sees:
no policy here but Belady's reference knows a future request.

Costs: ``push`` O(log n); ``pop`` O(log n) amortized (stale heap entries are skipped, each paid for by the
push that made it); a policy's hooks say their own.
"""

from __future__ import annotations

import heapq
import operator
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import Any, Protocol

import numpy as np

from radixkv.cache.base import CacheHints


class Entry(Protocol):
    """What a cache hands its policy, a ``RadixNode`` or a ``Block``: the fields the module doc lists."""

    last_access: int
    created: int
    hit_count: int
    depth: int
    user: Hashable
    state: Any
    stamp: int

    def __len__(self) -> int: ...


class EntryCache(Protocol):
    """The cache as its policy sees it (``bind``): every method a policy calls on it."""

    total_size: int
    page_size: int

    def key_of(self, entry: Entry) -> Hashable:
        """A key naming the entry's whole prefix, stable after it leaves (ghost lists)."""

    def parent_of(self, entry: Entry) -> Entry | None:
        """The entry its prefix continues from; None for a first one."""

    def is_last_child(self, entry: Entry) -> bool:
        """Whether the entry is its parent's only cached child."""


Live = Callable[[Entry], bool]

CLOCK_SPAN = float(1 << 40)  # logical clocks stay below this, so class * span + clock orders by class first


class LazyHeap:
    """Entries ordered by a number, smallest first, ties by push order. Re-pushing an entry makes its older
    heap items stale (its ``stamp`` moves on); stale and no-longer-live items are dropped as they surface.
    The ``stamp`` counter is shared by every heap of one policy, so an entry lives in one heap at a time.
    Where the policy was bound with its cache's liveness test, a heap that doubled past its live items since
    it last compacted compacts itself on a push (amortized O(1) per push)."""

    def __init__(self, owner: EvictionPolicy):
        self.items: list[tuple[float, int, Entry]] = []
        self._owner = owner
        self.limit = 64  # items past which a push compacts: 2 x the live ones at the last compaction, + 64

    def __len__(self) -> int:
        return len(self.items)

    def push(self, entry: Entry, key: float) -> None:  # O(log n)
        heapq.heappush(self.items, (key, self._owner.next_stamp(entry), entry))
        if len(self.items) > self.limit and self._owner.live is not None:
            self.compact(self._owner.live)

    @staticmethod
    def _current(item: tuple[float, int, Entry], live: Live) -> bool:
        """Whether ``item`` is its entry's newest and the entry is still ``live``."""
        return item[2].stamp == item[1] and live(item[2])

    def pop(self, live: Live) -> tuple[float, Entry] | None:
        """The smallest live item (its key and entry), removed; None when none is left. O(log n) amortized."""
        items, heappop = self.items, heapq.heappop
        while items:
            item = heappop(items)
            if item[2].stamp == item[1] and live(item[2]):  # _current, inlined: the caches' hottest loop
                return item[0], item[2]
        return None

    def peek_key(self, live: Live) -> float | None:
        """The smallest live key without removing it (stale items on top are dropped); None when empty."""
        items = self.items
        while items and not self._current(items[0], live):
            heapq.heappop(items)
        return items[0][0] if items else None

    def compact(self, live: Live) -> None:  # O(n): keeps the heap within a constant of the live entries
        self.items[:] = [i for i in self.items if i[2].stamp == i[1] and live(i[2])]  # _current, inlined
        heapq.heapify(self.items)
        self.limit = 2 * len(self.items) + 64

    def entries(self) -> Iterable[Entry]:
        return (i[2] for i in self.items if i[2].stamp == i[1])


class Ghosts:
    """Keys of evicted entries, oldest first, each with its size and what the policy keeps of it (its ``record``),
    at most ``limit`` tokens in all (``add``'s: the cache's capacity, or a multiple of it)."""

    def __init__(self) -> None:
        self.keys: OrderedDict[Hashable, tuple[int, Any]] = OrderedDict()  # key -> (size, record)
        self.tokens = 0

    def add(self, key: Hashable, size: int, limit: int, record: Any = True) -> None:  # O(1) amortized
        self.take(key)
        self.keys[key] = size, record
        self.tokens += size
        while self.tokens > limit and self.keys:
            self.tokens -= self.keys.popitem(last=False)[1][0]

    def take(self, key: Hashable) -> Any:
        """The record remembered under ``key`` (forgetting it); None if there is none. O(1)."""
        size, record = self.keys.pop(key, (0, None))
        self.tokens -= size
        return record

    def counted(self) -> bool:
        """Whether ``tokens`` is the sum of the remembered sizes (for ``check_invariants``). O(keys)."""
        return self.tokens == sum(size for size, _ in self.keys.values())


# ``clock = policy_clock`` in a cache class whose ``policy`` is an EvictionPolicy: the cache's clock is its policy's
policy_clock = property(lambda cache: cache.policy.clock, lambda cache, clock: setattr(cache.policy, "clock", clock),
                        doc="Seconds, for time-aware policies: the policy's clock (the simulator sets its own).")


class EvictionPolicy:
    """Least recently used first (SGLang's and vLLM's default). Subclasses change ``priority`` (one heap, the
    smallest evicted first) or the candidate structure (``push`` / ``pop``), and the hooks they observe."""

    name = "lru"
    # What the policy needs or allows, which the caches and the stack read instead of its name:
    observes = False  # it watches every access: the cache calls inserted / touched / split / evicted
    needs_future = False  # it is handed the workload's future (``FutureUses``): only the simulator builds it
    keeps_order_under_demotion = False  # ``demote`` ranks entries first without fighting its order (lru)
    release_order = False  # it ranks by release order alone: vLLM's O(1) free queue serves it (lru)
    params: tuple[str, ...] = ()  # the constructor's parameters (kept as attributes), which ``describe`` records

    def __init__(self) -> None:
        self.clock: Callable[[], float] = time.monotonic
        self.cache: EntryCache | None = None
        self.live: Live | None = None
        self._seq = 0
        self.reset()

    def bind(self, cache: EntryCache, live: Live | None = None) -> EvictionPolicy:
        """Serve ``cache``; ``ValueError`` if it already serves another (its heaps hold one cache's entries).
        ``live``: the cache's test of a candidate, with which the heaps compact themselves (None: the cache
        compacts them, ``compact``)."""
        if self.cache is not None and self.cache is not cache:
            raise ValueError(f"this {self.name} policy already serves another cache: make one per cache")
        self.cache, self.live = cache, live
        return self

    def reset(self) -> None:
        """Forget every candidate and everything learned (the cache was emptied)."""
        self.heap = LazyHeap(self)
        self._peak = 0

    def capacity(self) -> int:
        """The most tokens the cache has held since ``reset``: its capacity once it has filled, which bounds
        ghost lists (the cache itself is told no budget)."""
        self._peak = max(self._peak, self.cache.total_size)
        return self._peak

    def next_stamp(self, entry: Entry) -> int:
        self._seq += 1
        entry.stamp = self._seq
        return self._seq

    # -------------------------------------------------------------- candidates
    # The entry's rank when pushed, smallest evicted first: its last access (a C getter: LRU pays no Python call)
    priority: Callable[[Entry], float] = operator.attrgetter("last_access")

    def push(self, entry: Entry) -> None:
        """``entry`` may be evicted from now on, or its statistics changed while it may. O(log n)."""
        self._seq += 1
        entry.stamp = self._seq  # LazyHeap.push, inlined: every cache call pushes
        heap = self.heap
        heapq.heappush(heap.items, (self.priority(entry), self._seq, entry))
        if len(heap.items) > heap.limit and self.live is not None:
            heap.compact(self.live)

    def pop(self, live: Live) -> Entry | None:
        """The next victim among the pushed, still ``live`` entries, removed from the candidates; None if none."""
        items, heappop = self.heap.items, heapq.heappop  # LazyHeap.pop, inlined: a cache's eviction loop
        while items:
            _, stamp, entry = heappop(items)
            if entry.stamp == stamp and live(entry):
                return entry
        return None

    def heaps(self) -> Sequence[LazyHeap]:
        return (self.heap,)

    def heap_size(self) -> int:
        """Items in the heaps, stale ones included (the cache compacts past 2 x its entries)."""
        return sum(len(h) for h in self.heaps())

    def compact(self, live: Live) -> None:
        for heap in self.heaps():
            heap.compact(live)

    def candidates(self) -> set[int]:
        """ids of the entries with a current heap item, for ``check_invariants``. O(heap)."""
        return {id(e) for heap in self.heaps() for e in heap.entries()}

    # ------------------------------------------------------------------- hooks
    def inserted(self, entry: Entry, hints: CacheHints) -> None:
        """A new entry joined the cache (before it is pushed)."""

    def touched(self, entries: Sequence[Entry], hints: CacheHints, hit: bool) -> None:
        """The entries of one matched (``hit``) or inserted path, root side first, after their statistics."""

    def split(self, upper: Entry, lower: Entry) -> None:
        """A radix edge was cut: ``upper`` is new, above ``lower``; both hold the old entry's history."""
        upper.state, upper.user = lower.state, lower.user

    def evicted(self, entry: Entry) -> None:
        """``entry`` is leaving the cache (still in place: its prefix can be read)."""

    def describe(self) -> dict[str, Any]:
        """The policy's name and parameters (``params``), as experiments record them."""
        return {"name": self.name, **{param: getattr(self, param) for param in self.params}}

    def check_invariants(self, entries: Sequence[Entry], require: Callable[..., None]) -> None:
        """The policy's own books against the cache's ``entries`` (every one it holds); ``require(ok, what,
        detail)`` fails. The caches' ``check_invariants`` call it. O(entries)."""


class LRU(EvictionPolicy):
    """Least recently used first: the base order, and the one whose caches take their fast paths."""

    keeps_order_under_demotion = True
    release_order = True


class PriorityPolicy(EvictionPolicy):
    """One heap ordered by ``priority_fn(entry)`` (the classical policies; Belady's clairvoyant reference)."""

    def __init__(self, name: str, priority_fn: Callable[[Entry], float]):
        self.name = name
        self.priority = priority_fn  # the entry's rank when pushed (in place of the class's)
        super().__init__()


MAX_CLASS = 4096  # class * CLOCK_SPAN + clock stays exact in a float (2**52) for |class| up to this


def ranked(cls: int, clock: float) -> float:
    """``cls`` first, then ``clock``, as one float (heaps compare plain numbers fastest); ``cls`` is clamped to
    +-``MAX_CLASS`` so the clock keeps its precision."""
    return max(-MAX_CLASS, min(cls, MAX_CLASS)) * CLOCK_SPAN + clock


CLASSICAL: dict[str, Callable[[Entry], float]] = {
    "lfu": lambda e: ranked(e.hit_count, e.last_access),  # fewest hits first, ties by recency
    "fifo": lambda e: e.created,  # oldest created first
    "mru": lambda e: -e.last_access,  # most recently used first
    "filo": lambda e: -e.created,  # newest created first
}


class SLRU(EvictionPolicy):
    """Segmented LRU as SGLang ships it: an entry hit at least ``protected_threshold`` times is protected;
    every unprotected one goes first, each segment least recently used first. O(log n) per push and pop.

    Args:
        protected_threshold: hits (``hit_count``) that promote an entry, an integer >= 1 (default 2).
    """

    name = "slru"
    params = ("protected_threshold",)

    def __init__(self, protected_threshold: int = 2):
        check_param("slru", "protected_threshold", protected_threshold, 1, integer=True)
        self.protected_threshold = protected_threshold
        super().__init__()

    def priority(self, entry: Entry) -> float:
        return ranked(entry.hit_count >= self.protected_threshold, entry.last_access)


def reused(entry: Entry, hints: CacheHints) -> bool:
    """Whether a match of ``entry`` with ``hints`` is a reuse: by another request than the last one that used
    it (``entry.user``), or by an anonymous one (every anonymous lookup counts)."""
    return hints.request is None or entry.user != hints.request


def check_param(policy: str, name: str, value: object, minimum: float, integer: bool = False) -> None:
    """``ValueError`` unless ``value`` is a (finite, or integer) number >= ``minimum``."""
    ok_type = isinstance(value, int | np.integer) if integer else isinstance(value, int | float | np.number)
    if isinstance(value, bool) or not ok_type or not (value == value and abs(value) != float("inf")) or value < minimum:
        kind = "an integer" if integer else "a finite number"
        raise ValueError(f"{policy}: {name} must be {kind} >= {minimum}, got {value!r}")
