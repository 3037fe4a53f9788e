"""Eviction policies as priority functions: the smallest priority is evicted first.

A policy is a pure function of the fields every cache entry carries
(``last_access`` and ``created`` are ticks of the cache's logical clock,
``hit_count`` counts matches), so a new policy is one line here and every
cache implementation picks it up. Ties are broken by the caches themselves in
the order entries became evictable, so eviction order is deterministic.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol


class _HasStats(Protocol):
    last_access: int
    hit_count: int
    created: int


Priority = Callable[[_HasStats], float]

# Priorities are plain numbers, not tuples: heaps compare them on every push and pop.
_CLOCK_SPAN = 1 << 48  # logical clocks stay below this, so hit_count * span + clock orders by hits first

POLICIES: dict[str, Priority] = {
    # least recently used first (SGLang's and vLLM's default)
    "lru": lambda e: e.last_access,
    # fewest hits first, ties by recency
    "lfu": lambda e: e.hit_count * _CLOCK_SPAN + e.last_access,
    # oldest created first
    "fifo": lambda e: e.created,
    # most recently used first
    "mru": lambda e: -e.last_access,
    # newest created first
    "filo": lambda e: -e.created,
}


def get_policy(name: str) -> Priority:
    """The priority function for a policy name; ``ValueError`` for unknown names."""
    try:
        return POLICIES[name]
    except (KeyError, TypeError):
        raise ValueError(
            f"unknown eviction policy {name!r}; choose one of {sorted(POLICIES)}"
        ) from None
