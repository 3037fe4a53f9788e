"""The router interface: which replica serves a request, from what a router may know.

A router sees, per replica, a ``ReplicaView`` as of the request's arrival (requests running and waiting,
their outstanding tokens, KV use) and the request's tokens; it returns a replica's index. It is told
when a request it routed finishes (``finished``), so routers that track load or what each replica caches
can update. The simulator's cluster and the Ray cluster call the same objects, so a router's decisions
are the same in both (issue 32).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np


@dataclass(frozen=True)
class ReplicaView:
    """One replica as a router sees it. ``outstanding_tokens``: prompt tokens not yet prefilled plus tokens
    still to generate, over its running and waiting requests; ``kv_used``: fraction of its KV slots held."""

    index: int
    running: int = 0
    waiting: int = 0
    outstanding_tokens: int = 0
    kv_used: float = 0.0
    alive: bool = True


@runtime_checkable
class Router(Protocol):
    """Picks a replica for each request; see the module docstring."""

    name: str

    def route(self, tokens: np.ndarray, replicas: Sequence[ReplicaView], namespace: Hashable = None) -> int: ...

    def finished(self, replica: int, tokens: np.ndarray, namespace: Hashable = None) -> None: ...


def alive(replicas: Sequence[ReplicaView]) -> list[ReplicaView]:
    """The replicas a request may go to (``ValueError`` when none is alive)."""
    up = [r for r in replicas if r.alive]
    if not up:
        raise ValueError("no replica is alive to route to")
    return up
