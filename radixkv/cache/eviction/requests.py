"""Policies driven by what requests say or need: their priority, a hold time, their TTFT budget (T-LRU)."""

from __future__ import annotations

from collections.abc import Sequence

from radixkv.cache.base import CacheHints
from radixkv.cache.eviction.base import Entry, EvictionPolicy, LazyHeap, Live, check_param, ranked


class Priority(EvictionPolicy):
    """The requests' own priority (``CacheHints.priority``, from ``SamplingParams(priority=...)`` or the
    request's field): lower-priority prefixes go first, ties least recently used first (SGLang's
    ``priority``). An entry keeps the highest priority of the requests that matched or inserted it, so a
    prefix shared with an important request is kept as long as its own. O(log n) per push and pop, O(1) per
    entry of a touched path.
    """

    name = "priority"
    observes = True

    def priority(self, entry: Entry) -> float:
        return ranked(entry.state or 0, entry.last_access)

    def inserted(self, entry: Entry, hints: CacheHints) -> None:
        entry.state = hints.priority

    def touched(self, entries: Sequence[Entry], hints: CacheHints, hit: bool) -> None:
        for entry in entries:
            entry.state = max(entry.state or 0, hints.priority)


class TTL(EvictionPolicy):
    """Hold what a request leaves for a while (Continuum's idea for agents between tool calls).

    Every insert by a request (its prefill chunks, its whole sequence when it finishes) holds the inserted
    path until ``clock() + ttl`` seconds, the request's ``CacheHints.ttl`` if it gives one, else ``ttl``;
    a match does not extend a hold. A held entry is evicted only when no unheld one is left (then the
    earliest hold end first); unheld ones go least recently used first, and before all a lower tier's
    copies of what a nearer tier holds (``demote``d), so such a tier stays nearly exclusive of the device, as
    under ``lru``. With one hold time for every request it is close to LRU (what was inserted last is held
    longest); it is meant for requests that hold for different times, as an agent framework that knows its
    tool calls would ask. O(log n) per push; a pop also moves the entries whose hold lapsed to the unheld
    heap (each once per hold).

    Args:
        ttl: seconds, a finite number >= 0 (default 30).
    """

    name = "ttl"
    observes = True
    keeps_order_under_demotion = True  # a demoted entry goes unheld, below every other: a tier's spare copy
    params = ("ttl",)

    def __init__(self, ttl: float = 30.0):
        check_param("ttl", "ttl", ttl, 0.0)
        self.ttl = float(ttl)
        super().__init__()

    def reset(self) -> None:
        super().reset()
        self.unheld, self.held = LazyHeap(self), LazyHeap(self)

    def heaps(self) -> Sequence[LazyHeap]:
        return self.unheld, self.held

    def push(self, entry: Entry) -> None:
        until = entry.state or 0.0
        if until > self.clock() and entry.last_access >= 0:  # a demoted copy (below zero) is never held
            self.held.push(entry, until)
        else:
            self.unheld.push(entry, entry.last_access)

    def pop(self, live: Live) -> Entry | None:
        now = self.clock()
        while (until := self.held.peek_key(live)) is not None and until <= now:
            entry = self.held.pop(live)[1]
            self.unheld.push(entry, entry.last_access)  # lapsed: unheld from now on
        item = self.unheld.pop(live) or self.held.pop(live)
        return None if item is None else item[1]

    def inserted(self, entry: Entry, hints: CacheHints) -> None:
        entry.state = self.clock() + (self.ttl if hints.ttl is None else hints.ttl)

    def touched(self, entries: Sequence[Entry], hints: CacheHints, hit: bool) -> None:
        if not hit:
            until = self.clock() + (self.ttl if hints.ttl is None else hints.ttl)
            for entry in entries:
                entry.state = max(entry.state or 0.0, until)


class TLRU(EvictionPolicy):
    """Tail-optimized LRU (Zhang et al., arXiv:2510.15152), as SGLang defines it.

    A conversation whose branch has reached L tokens (an entry's high-water ``reach``: the deepest end of any
    path that went through it) and whose next prompt adds about ``next_prompt_estimate`` tokens keeps its next
    prefill within the TTFT budget (``threshold`` tokens prefilled) as long as L + estimate - threshold
    tokens stay cached. An entry whose prefix (``depth``) already covers that is "TEL-safe": evicting it
    cannot hurt the tail. TEL-safe entries go first, then the rest, each least recently used first.
    O(log n) per push and pop, O(1) per entry of a touched path.

    Args:
        threshold: tokens a prefill may compute within the TTFT target (default 4,096; SGLang's default 0
            makes nothing TEL-safe, i.e. LRU).
        next_prompt_estimate: tokens a conversation's next prompt adds (default 512).
    """

    name = "tlru"
    observes = True
    params = ("threshold", "next_prompt_estimate")

    def __init__(self, threshold: int = 4096, next_prompt_estimate: int = 512):
        check_param("tlru", "threshold", threshold, 0, integer=True)
        check_param("tlru", "next_prompt_estimate", next_prompt_estimate, 0, integer=True)
        self.threshold, self.next_prompt_estimate = threshold, next_prompt_estimate
        super().__init__()

    def priority(self, entry: Entry) -> float:
        budget = max((entry.state or 0) + self.next_prompt_estimate - self.threshold, 0)
        return ranked(-(entry.depth >= budget), entry.last_access)

    def inserted(self, entry: Entry, hints: CacheHints) -> None:
        entry.state = entry.depth + len(entry)

    def touched(self, entries: Sequence[Entry], hints: CacheHints, hit: bool) -> None:
        if entries:
            end = entries[-1].depth + len(entries[-1])
            for entry in entries:
                entry.state = max(entry.state or 0, end)
