"""The router interface: which replica serves a request, from what a router may know.

A router sees, per replica, a ``ReplicaView`` as of the request's arrival and the request's tokens; it
returns a replica's index. It is told when a request it routed finishes (``finished``), so routers that
track load or what each replica caches can update. Routers fed by the replicas' cache events (Dynamo's
KV router) also have ``observe(replica, event, time)``; a cluster attaches cache listeners only for them.

What a router knows of load is what the process routing the requests can count itself (``LoadTracker``):
requests sent and not yet finished, and their tokens, as SGLang's router and Dynamo's count them. The
simulator's cluster and the Ray cluster build their views with the same tracker and call the same router
objects, so a router's decisions are the same in both.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np


@dataclass(frozen=True)
class ReplicaView:
    """One replica as a router sees it. ``outstanding_tokens``: prompt tokens plus tokens still to generate,
    over its unfinished requests; ``kv_used``: fraction of its KV slots held (0 where not reported)."""

    index: int
    running: int = 0
    waiting: int = 0
    outstanding_tokens: int = 0
    kv_used: float = 0.0
    alive: bool = True


@runtime_checkable
class Router(Protocol):
    """Picks a replica for each request; see the module docstring. ``now``: seconds on the cluster's clock
    (simulated or wall), used by routers that model time (a delayed event feed)."""

    name: str

    def route(self, tokens: np.ndarray, replicas: Sequence[ReplicaView], namespace: Hashable = None,
              now: float = 0.0) -> int: ...

    def finished(self, replica: int, tokens: np.ndarray, namespace: Hashable = None) -> None: ...


@runtime_checkable
class EventRouter(Router, Protocol):
    """A router that also reads the replicas' cache events (``radixkv.cache.events``), stamped with the
    cluster's clock when they were emitted."""

    def observe(self, replica: int, event: Any, time: float) -> None: ...


def alive(replicas: Sequence[ReplicaView]) -> list[ReplicaView]:
    """The replicas a request may go to (``ValueError`` when none is alive)."""
    up = [r for r in replicas if r.alive]
    if not up:
        raise ValueError("no replica is alive to route to")
    return up


class LoadTracker:
    """The router process's own count of each replica's load: requests sent and not finished, their tokens.

    ``sent`` when a request is routed, ``done`` when it finishes (or fails); ``views`` gives the
    ``ReplicaView`` list a router sees. It counts a request as waiting until its replica reports it
    running (``started``). O(1) per call, O(N) per ``views``.
    """

    def __init__(self, replicas: int):
        if not (isinstance(replicas, int) and replicas >= 1):
            raise ValueError(f"replicas must be an int >= 1, got {replicas!r}")
        self.replicas = replicas
        self.alive = [True] * replicas
        self._requests: dict[Hashable, tuple[int, int, bool]] = {}  # rid -> (replica, tokens, started)
        self._waiting, self._running, self._tokens = [0] * replicas, [0] * replicas, [0] * replicas

    def sent(self, rid: Hashable, replica: int, prompt_tokens: int, max_new_tokens: int) -> None:
        if rid in self._requests:
            raise ValueError(f"request {rid!r} is already outstanding")
        tokens = int(prompt_tokens) + int(max_new_tokens)
        self._requests[rid] = (replica, tokens, False)
        self._waiting[replica] += 1
        self._tokens[replica] += tokens

    def started(self, rid: Hashable) -> None:
        replica, tokens, started = self._requests[rid]
        if not started:
            self._requests[rid] = (replica, tokens, True)
            self._waiting[replica] -= 1
            self._running[replica] += 1

    def done(self, rid: Hashable) -> int:
        """Forget ``rid``; returns the replica it was on."""
        replica, tokens, started = self._requests.pop(rid)
        (self._running if started else self._waiting)[replica] -= 1
        self._tokens[replica] -= tokens
        return replica

    def on(self, replica: int) -> list[Hashable]:
        """The outstanding requests of one replica (to retry them elsewhere when it dies)."""
        return [rid for rid, (r, _, _) in self._requests.items() if r == replica]

    def views(self, kv_used: Sequence[float] | None = None) -> list[ReplicaView]:
        return [ReplicaView(i, self._running[i], self._waiting[i], self._tokens[i],
                            0.0 if kv_used is None else float(kv_used[i]), self.alive[i])
                for i in range(self.replicas)]
