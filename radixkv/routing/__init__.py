"""Routing requests across replicas: the ``Router`` interface and its policies.

``make_router(name, **params)``: ``round_robin``, ``least_load``, ``prefix_hash`` (know nothing of caches);
``cache_aware`` (SGLang), ``kv_events`` (Dynamo), ``preble`` (Preble's E2); ``affinity`` (radixkv's own,
``radixkv.routing.affinity``). Torch-free.
"""

from __future__ import annotations

import inspect
from typing import Any

from radixkv.routing.affinity import Affinity
from radixkv.routing.base import EventRouter, LoadTracker, ReplicaView, Router
from radixkv.routing.basic import LeastLoad, PrefixHash, RoundRobin
from radixkv.routing.cache_routers import CacheAware, KVEvents, Preble

ROUTERS = {cls.name: cls for cls in (RoundRobin, LeastLoad, PrefixHash, CacheAware, KVEvents, Preble, Affinity)}


def make_router(name: str, cache_block_size: int | None = None, **params) -> Router:
    """A fresh router by name; unknown names and bad parameters are a ``ValueError``.

    ``cache_block_size``: the replicas' cache geometry, tokens per page or block (the radix page size, the
    hash caches' block size). A router that counts in blocks (one whose constructor takes ``block_size``,
    such as ``kv_events``) takes it from there; a ``block_size`` in ``params`` that disagrees is a
    ``ValueError`` naming both.
    """
    if name not in ROUTERS:
        raise ValueError(f"unknown router {name!r}; choose one of {sorted(ROUTERS)}")
    if cache_block_size is not None and takes_block_size(ROUTERS[name]):
        check_block_size(name, params.get("block_size"), cache_block_size)
        params = {**params, "block_size": cache_block_size}
    try:
        return ROUTERS[name](**params)
    except TypeError as e:
        raise ValueError(f"bad parameters for router {name!r}: {e}") from None


def takes_block_size(router_cls: type) -> bool:
    """Whether a router class counts in cache blocks (its constructor takes ``block_size``)."""
    return "block_size" in inspect.signature(router_cls).parameters


def check_block_size(name: str, router_block_size: object, cache_block_size: int) -> None:
    """``ValueError`` when a router's block size is given and is not the cache's."""
    if router_block_size is not None and router_block_size != cache_block_size:
        raise ValueError(f"router {name!r} has block_size {router_block_size!r} but the replicas' cache has "
                         f"{cache_block_size}-token pages/blocks: leave block_size out (it is taken from the "
                         "cache) or make them equal")


def fit_router(router: str | Router, cache_block_size: int | None, params: dict | None = None) -> Router:
    """A router for replicas whose cache has ``cache_block_size``-token pages or blocks: built by name
    (``make_router``) or, for a ``Router`` object, checked (its ``block_size``, where it has one, must be the
    cache's). ``params`` go with a name only."""
    if isinstance(router, str):
        return make_router(router, cache_block_size=cache_block_size, **(params or {}))
    if params:
        raise ValueError("router_params go with a router name, not a router object")
    if not isinstance(router, Router):
        raise ValueError(f"router must be a name or a Router, got {type(router).__name__}")
    if cache_block_size is not None:
        check_block_size(router.name, getattr(router, "block_size", None), cache_block_size)
    return router


def memory_params(router: str | Router, config: Any, params: dict | None) -> dict | None:
    """``params``; for ``affinity`` by name without them, the replicas' device and host tokens from their
    ``StackConfig``: what it trims its beliefs to and how it tells a replica past its cliff."""
    if router != "affinity" or params is not None:
        return params
    return {"capacity_tokens": config.capacity_tokens, "host_capacity_tokens": config.host_capacity_tokens or 0}


__all__ = ["ROUTERS", "Affinity", "CacheAware", "EventRouter", "KVEvents", "LeastLoad", "LoadTracker", "Preble",
           "PrefixHash", "ReplicaView", "RoundRobin", "Router", "check_block_size", "fit_router", "make_router",
           "memory_params", "takes_block_size"]
