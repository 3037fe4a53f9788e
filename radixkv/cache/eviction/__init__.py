"""Eviction policies by name: ``make_policy("arc")`` builds one for a cache; ``POLICIES`` lists them.

Every policy is an :class:`EvictionPolicy` (:mod:`radixkv.cache.eviction.base` says what a cache tells it
and asks it). Each class's docstring gives its rule and its costs:

=========  ==========================================================================================
lru        least recently used first (the default)
lfu        fewest hits first, ties by recency
fifo       oldest created first
mru        most recently used first
filo       newest created first
slru       SGLang's segmented LRU: entries hit ``protected_threshold`` times go last
arc        Adaptive Replacement Cache: recency and frequency lists, sized by ghost hits
s3fifo     S3-FIFO: a small probation queue, a main queue and ghosts
priority   the requests' priority (``CacheHints.priority``), then recency
ttl        what a request leaves is held ``ttl`` seconds, then recency
tlru       SGLang's T-LRU: entries that cannot help the TTFT tail go first
cost       GreedyDual-Size-Frequency over the prefill time an entry saves
learned    an online estimate of each entry's reuse, learned from the cache's own history
=========  ==========================================================================================

``belady`` (the clairvoyant reference) is not here: it needs the future, which only the simulator has
(:mod:`radixkv.cache.belady`).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from radixkv.cache.eviction.adaptive import ARC, S3FIFO
from radixkv.cache.eviction.base import CLASSICAL, SLRU, EvictionPolicy, PriorityPolicy, policy_clock
from radixkv.cache.eviction.learned import Learned
from radixkv.cache.eviction.requests import TLRU, TTL, Priority
from radixkv.cache.eviction.value import Cost


def _classical(name: str) -> Callable[[], EvictionPolicy]:
    return lambda: PriorityPolicy(name, CLASSICAL[name])


POLICIES: dict[str, Callable[..., EvictionPolicy]] = {
    "lru": EvictionPolicy,
    **{name: _classical(name) for name in CLASSICAL},
    "slru": SLRU,
    "arc": ARC,
    "s3fifo": S3FIFO,
    "priority": Priority,
    "ttl": TTL,
    "tlru": TLRU,
    "cost": Cost,
    "learned": Learned,
}


def make_policy(name: str | EvictionPolicy, **params: Any) -> EvictionPolicy:
    """A fresh policy by name with its parameters (``ValueError`` for an unknown name or a bad parameter);
    a policy object is returned as it is (it must not serve two caches)."""
    if isinstance(name, EvictionPolicy):
        if params:
            raise ValueError("parameters go with a policy name, not with a ready policy object")
        return name
    if not isinstance(name, str) or name not in POLICIES:
        raise ValueError(f"unknown eviction policy {name!r}; choose one of {sorted(POLICIES)}")
    try:
        inspect.signature(POLICIES[name]).bind(**params)
    except TypeError as e:  # an unknown parameter name
        raise ValueError(f"eviction policy {name!r}: {e}") from None
    return POLICIES[name](**params)


__all__ = ["POLICIES", "EvictionPolicy", "PriorityPolicy", "make_policy", "policy_clock"]
