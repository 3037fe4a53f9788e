"""``learned``: evict what is least likely to be reused, as learned online from the cache's own history.

The anchors are LPC (NeurIPS'25), which learns whether a conversation continues, and Learning Relaxed Belady
(NSDI'20), which learns from what it evicted. Here each entry gets a class when it is inserted, from what the
cache saw of its prefix, and each class's reuse probability is counted as requests come:

* **shared**: an entry where at least ``shared_matches`` matches have ended (a system prompt, a few-shot
  header);
* **tail**: an entry below one the same request inserted earlier (what a request adds at its finish after its
  prefill was cached: its output and last partial page; a conversation's next turn rarely reuses it);
* **turn 1**: below a root or a shared entry (a conversation's first turn);
* **turn 2** and **turn 3+**, each by how long its parent had been cached when it arrived (``gap_edges``, in
  ticks of the cache's logical clock): below an entry another request inserted, i.e. a conversation continued.
  An entry whose key matches a ghost (an entry evicted earlier, remembered by key) continues that one's turn.
* **finished**: what a request adds at its finish when its hints say how its answer ended (``CacheHints.stop``:
  an agent's ``tool_use`` or ``end_turn``, or any other reason), one class per stop reason x the session's
  depth (its conversation turn: < 8, < 64, more; ``DEPTH_EDGES``) x its context length (< 32k, < 128k tokens,
  more; ``LENGTH_EDGES``), in place of **tail**: after a tool call the session comes back in seconds, after
  the end of a turn only if a human answers. Without stop hints (Mooncake's and the synthetic workloads)
  no entry is in these classes and the policy decides as before.

A class's reuse probability p = (reuses + k x pooled) / (starts + k): its entries inserted (starts), the
matches by another request ending at one of its entries (reuses, ``reused``), including a re-insert of an
evicted entry's key (a reuse the eviction lost, learned all the same), shrunk toward the pooled rate with
``prior`` pseudo-entries; refitted every ``refit_every`` reuses. An evicted entry's parent, left a leaf,
takes over its class (a turn's, not a finished one), so the rest of a conversation's path keeps its latest
turn's. The eviction rank is

    priority = last_access + horizon x ln(max(p, 0.001))

so an entry of a class half as likely to be reused goes ``horizon x ln 2`` ticks earlier than LRU would send
it. O(log n) per push and pop, O(1) per inserted or touched entry plus ``key_of`` (O(page) for the radix
tree) at inserts and evictions; the refit is O(classes).

On Mooncake's conversation trace (one radix cache, page 512, ``simulate``'s defaults) it raises the hit rate
over LRU by about 10% of the way to Belady at 1M and 4M tokens: docs/eviction.md has the figures and the
command.

Args:
    horizon: ticks of recency one e-fold of reuse probability is worth, > 0 (default 2,300).
    gap_edges: tick edges of the parent-age buckets, increasing (default 400, 1,200, 3,200).
    shared_matches: matches ending at an entry that make it shared, >= 1 (default 3).
    prior: pseudo-entries toward the pooled rate, >= 0 (default 20).
    refit_every: reuses between refits, >= 1 (default 100).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Sequence

from radixkv.cache.base import CacheHints
from radixkv.cache.eviction.base import Entry, EvictionPolicy, Ghosts, check_param, reused
from radixkv.sessions import AWAITED

SHARED, TAIL, TURN1 = 0, 1, 2  # then turn 2 x gap bucket, turn 3+ x gap bucket, then the finished classes
STOPS = AWAITED  # a tool call, a turn's end; then any other finish
DEPTH_EDGES, LENGTH_EDGES = (8, 64), (32_768, 131_072)  # turns, tokens


class Record:
    """What ``learned`` keeps per entry: its class, conversation turn, insertion tick, the request that inserted
    it, and how many matches ended there."""

    __slots__ = ("cls", "turn", "born", "owner", "matches")

    def __init__(self, cls: int, turn: int, born: int, owner: Hashable = None, matches: int = 0):
        self.cls, self.turn, self.born, self.owner, self.matches = cls, turn, born, owner, matches

    def copy(self) -> Record:
        return Record(self.cls, self.turn, self.born, self.owner, self.matches)


class Learned(EvictionPolicy):
    __doc__ = __doc__

    name = "learned"
    observes = True
    params = ("horizon", "gap_edges", "shared_matches", "prior", "refit_every")

    def __init__(self, horizon: float = 2300.0, gap_edges: Sequence[int] = (400, 1200, 3200),
                 shared_matches: int = 3, prior: float = 20.0, refit_every: int = 100):
        check_param("learned", "horizon", horizon, 1e-9)
        check_param("learned", "shared_matches", shared_matches, 1, integer=True)
        check_param("learned", "prior", prior, 0.0)
        check_param("learned", "refit_every", refit_every, 1, integer=True)
        edges = list(gap_edges) if isinstance(gap_edges, list | tuple) else None
        if not edges or any(isinstance(e, bool) or not isinstance(e, int | float) or not 0 <= e < math.inf
                            for e in edges) or edges != sorted(set(edges)):
            raise ValueError(f"learned: gap_edges must be increasing finite numbers >= 0, got {gap_edges!r}")
        self.horizon, self.gap_edges, self.shared_matches = float(horizon), edges, shared_matches
        self.prior, self.refit_every = float(prior), refit_every
        super().__init__()

    def reset(self) -> None:
        super().reset()
        self._finished_base = 3 + 2 * (len(self.gap_edges) + 1)
        n = self._finished_base + (len(STOPS) + 1) * (len(DEPTH_EDGES) + 1) * (len(LENGTH_EDGES) + 1)
        self.starts, self.reuses = [0] * n, [0] * n
        self.shift = [0.0] * n  # horizon x ln p per class: 0 (LRU) until the first refit
        self.ghosts = Ghosts()  # evicted entries' records, at most 8 x the cache's tokens
        self._pending = 0

    # ------------------------------------------------------------------ ranking
    def _class_of(self, record: Record) -> int:
        return SHARED if record.matches >= self.shared_matches else record.cls

    def priority(self, entry: Entry) -> float:
        return entry.last_access + self.shift[self._class_of(entry.state)]

    def _count_reuse(self, cls: int) -> None:
        self.reuses[cls] += 1
        self._pending += 1
        if self._pending >= self.refit_every:
            self._pending = 0
            pooled = sum(self.reuses) / max(sum(self.starts), 1)
            k = self.prior
            for c, (r, s) in enumerate(zip(self.reuses, self.starts, strict=True)):
                p = (r + k * pooled) / (s + k) if s + k > 0 else pooled
                self.shift[c] = self.horizon * math.log(max(p, 1e-3))

    # -------------------------------------------------------------------- hooks
    def _turn_class(self, turn: int, gap: float) -> int:
        bucket = sum(gap >= e for e in self.gap_edges)
        return 3 + bucket + (len(self.gap_edges) + 1) * (turn > 2)

    def _finished_class(self, stop: str, turn: int, entry: Entry) -> int:
        """The class of what a request that ended with ``stop`` adds at its finish."""
        depth = sum(turn >= e for e in DEPTH_EDGES)
        length = sum(entry.depth + len(entry) >= e for e in LENGTH_EDGES)
        kind = STOPS.index(stop) if stop in STOPS else len(STOPS)
        return self._finished_base + (kind * (len(DEPTH_EDGES) + 1) + depth) * (len(LENGTH_EDGES) + 1) + length

    def inserted(self, entry: Entry, hints: CacheHints) -> None:
        now = entry.created
        parent = self.cache.parent_of(entry)
        ghost = self.ghosts.take(self.cache.key_of(entry))
        if parent is not None and parent.created == now:  # the same insert's chain (hash blocks): one class
            record = Record(parent.state.cls, parent.state.turn, now)
        elif ghost is not None:  # it was here before: a continuation the eviction lost
            self._count_reuse(ghost.cls)
            record = Record(self._turn_class(ghost.turn + 1, now - ghost.born), ghost.turn + 1, now)
        elif parent is None or self._class_of(parent.state) == SHARED:
            record = Record(TURN1, 1, now)
        elif hints.request is not None and parent.state.owner == hints.request:
            turn = parent.state.turn
            record = Record(self._finished_class(hints.stop, turn, entry) if hints.stop else TAIL, turn, now)
        else:
            turn = parent.state.turn + 1
            record = Record(self._turn_class(turn, now - parent.state.born), turn, now)
        record.owner = hints.request
        entry.state, entry.user = record, hints.request
        if parent is None or parent.created != now:
            self.starts[record.cls] += 1

    def touched(self, entries: Sequence[Entry], hints: CacheHints, hit: bool) -> None:
        if hit and entries and reused(entries[-1], hints):
            end = entries[-1].state
            self._count_reuse(self._class_of(end))
            end.matches += 1
        for entry in entries:
            entry.user = hints.request

    def split(self, upper: Entry, lower: Entry) -> None:
        upper.state, upper.user = lower.state.copy(), lower.user

    def evicted(self, entry: Entry) -> None:
        record = entry.state
        if record.cls == TAIL or self._class_of(record) == SHARED:
            return
        self.ghosts.add(self.cache.key_of(entry), len(entry), 8 * max(self.capacity(), 1), record)
        parent = self.cache.parent_of(entry)
        if parent is not None and self.cache.is_last_child(entry):  # the path's rest keeps its latest class
            above = parent.state  # not a finished class: on the agentic trace that cost a third of LRU's hits
            passes_up = record.cls < self._finished_base and record.turn >= above.turn
            if passes_up and above.cls != TAIL and self._class_of(above) != SHARED:
                above.cls, above.turn, above.born = record.cls, record.turn, record.born
                self.push(parent)  # its rank changed (the hash cache would keep its old heap item)

    def check_invariants(self, entries: Sequence[Entry], require: Callable[..., None]) -> None:
        require(all(isinstance(e.state, Record) for e in entries), "learned: every entry has its record")
        require(self.ghosts.counted(), "learned: ghost tokens")
