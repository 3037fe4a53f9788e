"""Routing requests across replicas (issue 32): the ``Router`` interface and its policies.

``make_router(name, **params)``: ``round_robin``, ``least_load``, ``prefix_hash``. Torch-free.
"""

from __future__ import annotations

from radixkv.routing.base import ReplicaView, Router
from radixkv.routing.basic import LeastLoad, PrefixHash, RoundRobin

ROUTERS = {"round_robin": RoundRobin, "least_load": LeastLoad, "prefix_hash": PrefixHash}


def make_router(name: str, **params) -> Router:
    """A fresh router by name; unknown names and bad parameters are a ``ValueError``."""
    if name not in ROUTERS:
        raise ValueError(f"unknown router {name!r}; choose one of {sorted(ROUTERS)}")
    try:
        return ROUTERS[name](**params)
    except TypeError as e:
        raise ValueError(f"bad parameters for router {name!r}: {e}") from None


__all__ = ["ROUTERS", "LeastLoad", "PrefixHash", "ReplicaView", "RoundRobin", "Router", "make_router"]
