"""``kvflow``: KVFlow's workflow-aware eviction (Pan et al., "KVFlow: Efficient Prefix Caching for Accelerating
LLM-Based Multi-Agent Workflows", arXiv 2507.07400), as itself, on agent sessions.

The paper's rule: each agent's prefix gets its **steps-to-execution**, how far ahead in the workflow the agent
runs next, and the cache evicts the prefix whose next execution is farthest first; a prefix several agents
share takes the nearest of their next executions. With it, KVFlow prefetches the prefixes of the agents due
next from the host back to the device before they run (``radixkv.scheduling.prefetch``, the ``prefetch``
setting, which this policy is meant to run beside over a host tier).

Agent sessions have no workflow graph; a stream's next execution is its predicted return, in seconds, from
the scheduler's sessions book (``radixkv.sessions``): when a request finishes, the path it leaves is due at
its finish plus the expected pause of its kind (``Pauses.expected``: the geometric mean of the pauses seen
after the same kind of finish from the same kind of stream, the same tool where seen). So:

* a path is ranked by when it is next due, the **latest first**;
* a path whose finish says nothing of a return (a prefill chunk, a length, a stop sequence) or whose kind of
  pause was never seen is due never: it goes before every predicted one, least recently used first;
* a path touched by another request's finish is due at the nearest of the two (shared prefixes);
* a match (a request running on it) makes it due now, until that request's own finish says when next.

As every policy here it is soft: a due path is evicted when nothing else is left. O(log n) per push and pop.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from radixkv.cache.base import CacheHints
from radixkv.cache.eviction.base import Entry, EvictionPolicy, ranked
from radixkv.sessions import AWAITED, Sessions, pause_key

NEVER = math.inf


class KVFlow(EvictionPolicy):
    """See the module doc."""

    name = "kvflow"
    observes = True

    def __init__(self):
        self.sessions = Sessions()  # the scheduler's, once ``build_stack`` hands it over
        super().__init__()

    def priority(self, entry: Entry) -> float:
        due = NEVER if entry.state is None else entry.state
        # the never-due first (by recency), then the latest due first
        return ranked(0, entry.last_access) if due == NEVER else ranked(1, -due)

    def _due(self, hints: CacheHints) -> float:
        """When the path a finish with these hints leaves is next used, seconds on the clock (NEVER: no sign)."""
        if hints.stop not in AWAITED or hints.session is None:
            return NEVER
        pause = self.sessions.pauses.expected(pause_key(hints))
        return NEVER if pause is None else self.clock() + pause

    def inserted(self, entry: Entry, hints: CacheHints) -> None:
        entry.state = self._due(hints)

    def touched(self, entries: Sequence[Entry], hints: CacheHints, hit: bool) -> None:
        due = self.clock() if hit else self._due(hints)
        for entry in entries:
            old = NEVER if entry.state is None else entry.state
            entry.state = due if hit or old < self.clock() else min(old, due)

    def describe(self) -> dict:
        return {"name": self.name}
