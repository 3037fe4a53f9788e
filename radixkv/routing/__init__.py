"""Routing requests across replicas (issue 32): the ``Router`` interface and its policies.

``make_router(name, **params)``: ``round_robin``, ``least_load``, ``prefix_hash`` (know nothing of caches);
``cache_aware`` (SGLang), ``kv_events`` (Dynamo), ``preble`` (Preble's E2); ``affinity`` (radixkv's own,
``radixkv.routing.affinity``). Torch-free.
"""

from __future__ import annotations

from radixkv.routing.affinity import Affinity
from radixkv.routing.base import EventRouter, LoadTracker, ReplicaView, Router
from radixkv.routing.basic import LeastLoad, PrefixHash, RoundRobin
from radixkv.routing.cache_routers import CacheAware, KVEvents, Preble

ROUTERS = {"round_robin": RoundRobin, "least_load": LeastLoad, "prefix_hash": PrefixHash, "cache_aware": CacheAware,
           "kv_events": KVEvents, "preble": Preble, "affinity": Affinity}


def make_router(name: str, **params) -> Router:
    """A fresh router by name; unknown names and bad parameters are a ``ValueError``."""
    if name not in ROUTERS:
        raise ValueError(f"unknown router {name!r}; choose one of {sorted(ROUTERS)}")
    try:
        return ROUTERS[name](**params)
    except TypeError as e:
        raise ValueError(f"bad parameters for router {name!r}: {e}") from None


__all__ = ["ROUTERS", "Affinity", "CacheAware", "EventRouter", "KVEvents", "LeastLoad", "LoadTracker", "Preble",
           "PrefixHash", "ReplicaView", "RoundRobin", "Router", "make_router"]
