"""Eviction policies by name: ``make_policy("arc")`` builds one for a cache; ``POLICIES`` lists the online ones,
``REFERENCES`` those a simulation alone can run, ``EVERY_POLICY`` both.

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
session    an agent session's path: held through a tool call (learned pause), cold after a turn's end
continuum  Continuum's pins: a tool call's path held for the TTL its ``continuum`` schedule policy chose
kvflow     KVFlow's steps-to-execution: the path whose stream is next due latest goes first
infercept  InferCept's preserve / discard / swap per tool call, as its ``infercept`` schedule policy chose
belady     the clairvoyant reference: farthest next use first; it ``needs_future``, which only the simulator
           has (``make_policy(name, future=FutureUses(...))``)
=========  ==========================================================================================

What a policy needs or allows is declared on its class (``observes``, ``needs_future``,
``keeps_order_under_demotion``, ``release_order``: :class:`EvictionPolicy`); callers read those, never a name.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from functools import partial
from typing import Any

from radixkv.cache.eviction.adaptive import ARC, S3FIFO
from radixkv.cache.eviction.base import CLASSICAL, LRU, SLRU, EvictionPolicy, PriorityPolicy, policy_clock
from radixkv.cache.eviction.belady import Belady
from radixkv.cache.eviction.continuum import ContinuumPins
from radixkv.cache.eviction.infercept import InferCeptRetention
from radixkv.cache.eviction.kvflow import KVFlow
from radixkv.cache.eviction.learned import Learned
from radixkv.cache.eviction.requests import TLRU, TTL, Priority
from radixkv.cache.eviction.session import SessionRetention
from radixkv.cache.eviction.value import Cost

POLICIES: dict[str, Callable[..., EvictionPolicy]] = {
    "lru": LRU,
    **{name: partial(PriorityPolicy, name, priority) for name, priority in CLASSICAL.items()},
    **{cls.name: cls for cls in (SLRU, ARC, S3FIFO, Priority, TTL, TLRU, Cost, Learned, SessionRetention,
                                 ContinuumPins, KVFlow, InferCeptRetention)},
}
# Policies handed the future (``needs_future``): references a simulation can run, never an engine.
REFERENCES: dict[str, Callable[..., EvictionPolicy]] = {"belady": Belady}
EVERY_POLICY = {**POLICIES, **REFERENCES}


def needs_future(name: str) -> bool:
    """Whether the policy of that name is handed the workload's future (False for an unknown name)."""
    return bool(getattr(EVERY_POLICY.get(name), "needs_future", False))


def make_policy(name: str | EvictionPolicy, future: Any = None, **params: Any) -> EvictionPolicy:
    """A fresh policy by name with its parameters (``ValueError`` for an unknown name or a bad parameter);
    ``future`` (a ``FutureUses``) goes to a policy that ``needs_future`` and to no other (one built without
    it refuses to serve a cache). A policy object is returned as it is (it must not serve two caches)."""
    if isinstance(name, EvictionPolicy):
        if params or future is not None:
            raise ValueError("parameters go with a policy name, not with a ready policy object")
        return name
    if not isinstance(name, str) or name not in EVERY_POLICY:
        raise ValueError(f"unknown eviction policy {name!r}; choose one of {sorted(EVERY_POLICY)}")
    if future is not None:
        if not needs_future(name):
            raise ValueError(f"future= goes to a policy that needs the future, not {name!r}")
        params["future"] = future
    try:
        inspect.signature(EVERY_POLICY[name]).bind(**params)
    except TypeError as e:  # an unknown parameter name
        raise ValueError(f"eviction policy {name!r}: {e}") from None
    return EVERY_POLICY[name](**params)


__all__ = ["EVERY_POLICY", "LRU", "POLICIES", "REFERENCES", "EvictionPolicy", "PriorityPolicy", "make_policy",
           "needs_future", "policy_clock"]
