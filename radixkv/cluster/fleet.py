"""What both Ray clusters share, the batch ``Cluster`` and the server's ``ClusterEngine``: Ray, the replica
actors (``ReplicaActor``), the router with its ``LoadTracker``, and the fan-out to every live replica
(``Fleet.send`` / ``gathered``: ``each`` for a blocking caller, ``each_async`` for an asyncio one).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time
from collections.abc import Hashable, Sequence

import numpy as np
import ray

from radixkv.config import EngineConfig, SamplingParams
from radixkv.engine import LLM
from radixkv.heap import freeze_startup_heap
from radixkv.inputs import Prompts
from radixkv.routing import make_router, memory_params
from radixkv.routing.base import EventRouter, LoadTracker

ACTOR_LOST = (ray.exceptions.RayActorError,)  # ActorDiedError and ActorUnavailableError are both


def build_llm(model: str, settings: dict, threads: int) -> LLM:
    """The replica's engine, built on the thread that will run it, with ``threads`` torch threads."""
    import torch

    torch.set_num_threads(threads)
    llm = LLM(model, **settings)
    freeze_startup_heap()  # a replica's process is a server's: see freeze_startup_heap
    return llm


class EventBuffer:
    """A cache listener that keeps ``(wall time, event)`` pairs until ``drain``; thread-safe (the engine's
    thread appends, the actor's drains)."""

    def __init__(self) -> None:
        self._events: collections.deque = collections.deque()

    def __call__(self, event) -> None:
        self._events.append((time.time(), event))

    def drain(self) -> list[tuple[float, object]]:
        out = []
        while self._events:
            out.append(self._events.popleft())
        return out


class ReplicaActor:
    """What every replica actor has, batch (``radixkv.cluster.batch``) or serving
    (``radixkv.serving.replicas``): its torch threads, its engine once started, and a buffer of its cache's
    events for routers that read them. A subclass's ``start`` builds the engine (``build_llm``, on the thread
    that will run it) and returns ``attach(llm, events)``."""

    def __init__(self, threads: int):
        self.threads, self.llm, self.events = threads, None, EventBuffer()

    def attach(self, llm: LLM, events: bool) -> tuple[EngineConfig, Prompts]:
        """Take ``llm`` as this replica's engine, its cache's events into the buffer where asked: what the
        driver needs of it (picklable, no weights)."""
        self.llm = llm
        if events:
            llm.cache.listener = self.events
        return llm.config, llm.prompts

    def drain(self) -> list[tuple[float, object]]:
        return self.events.drain()


class Fleet:
    """Ray, N replica actors of ``actor_cls``, the router and its ``LoadTracker``; see the module docstring.

    ``actor_cls(threads)`` is a ``ReplicaActor`` whose ``start(model, settings, events)`` returns its
    ``attach``: the engine's config and prompt rules, which the fleet keeps (``config``, ``prompts``) to check
    and tokenize prompts on the driver as the replicas would. Bad arguments
    (``replicas`` < 1, an unknown router) are a ``ValueError`` before any actor starts; a replica that fails
    to build its engine raises that error here, with every actor killed.
    """

    def __init__(self, actor_cls: type, model: str, replicas: int, router: str, address: str | None,
                 router_params: dict | None, num_cpus_per_replica: int, settings: dict):
        if not (isinstance(replicas, int) and not isinstance(replicas, bool) and replicas >= 1):
            raise ValueError(f"replicas must be an int >= 1, got {replicas!r}")
        if not (isinstance(num_cpus_per_replica, int) and num_cpus_per_replica >= 1):
            raise ValueError(f"num_cpus_per_replica must be an int >= 1, got {num_cpus_per_replica!r}")
        geometry = {k: settings[k] for k in ("prefix_cache", "page_size", "block_size") if k in settings}
        self.router = make_router(router, cache_block_size=EngineConfig(**geometry).kv_page_size,
                                  **(router_params or {}))
        self.router_params = router_params
        self.wants_events = isinstance(self.router, EventRouter)
        self.tracker = LoadTracker(replicas)
        self.decisions: list[int] = []
        self.kv_used = [0.0] * replicas  # each replica's share of KV slots held, as it last reported
        self.actors: list = []
        self.started = time.time()
        self.owns_ray = _init_ray(address, replicas * num_cpus_per_replica)
        try:
            self._spawn(actor_cls, model, replicas, num_cpus_per_replica, settings)
        except BaseException:
            self.shutdown()
            raise

    def _spawn(self, actor_cls: type, model: str, replicas: int, cpus: int, settings: dict) -> None:
        have = ray.cluster_resources().get("CPU", 0)
        if have < replicas * cpus:
            raise ValueError(f"{replicas} replicas x {cpus} CPUs need {replicas * cpus} CPUs; the Ray cluster has "
                             f"{have:g}")
        remote = ray.remote(actor_cls)
        self.actors = [remote.options(num_cpus=cpus).remote(cpus) for _ in range(replicas)]
        try:
            infos = ray.get([a.start.remote(model, settings, self.wants_events) for a in self.actors])
        except ray.exceptions.RayTaskError as e:  # the engine's own error (a missing model, a bad setting)
            raise (e.cause if isinstance(e.cause, Exception) else e) from None
        self.config, self.prompts = infos[0]
        if self.router.name == "affinity" and not self.router_params:  # the replicas' memory, now it is known
            self.router = make_router("affinity", **memory_params("affinity", self.config.stack, None))

    # ---------------------------------------------------------------- routing
    def now(self) -> float:
        """Seconds since the fleet started: the clock routers and events are stamped with."""
        return time.time() - self.started

    def route(self, rid: Hashable, ids: Sequence[int], params: SamplingParams, namespace: Hashable = None) -> int:
        """Pick a live replica for one request and count it as sent there (``RuntimeError`` when none lives)."""
        if not any(self.tracker.alive):
            raise RuntimeError(f"all {len(self.actors)} replicas are dead: nothing left to serve the request")
        views = self.tracker.views(self.kv_used)
        # a router that follows sessions is told the request's (``SamplingParams.session``), as in the simulator
        session = {"session": params.session} if getattr(self.router, "follows_sessions", False) else {}
        replica = self.router.route(np.asarray(ids, dtype=np.int64), views, namespace, now=self.now(), **session)
        if not (isinstance(replica, int | np.integer) and 0 <= replica < len(views) and views[replica].alive):
            raise ValueError(f"router {self.router.name!r} returned {replica!r}, not a live replica's index")
        replica = int(replica)
        self.tracker.sent(rid, replica, len(ids), params.max_new_tokens)
        self.decisions.append(replica)
        return replica

    def finish(self, rid: Hashable, tokens: Sequence[int], namespace: Hashable = None) -> None:
        """A request came back: its replica's cache now holds ``tokens`` (prompt + output[:-1])."""
        replica = self.tracker.done(rid)
        self.router.finished(replica, np.asarray(tokens, dtype=np.int64), namespace)

    def observe(self, replica: int, events: Sequence[tuple[float, object]]) -> None:
        for stamp, event in events:
            self.router.observe(replica, event, stamp - self.started)

    def lost(self, replica: int) -> None:
        """Mark a replica dead (and make sure its actor is): nothing is routed to it again."""
        self.tracker.alive[replica] = False
        _kill(self.actors[replica])

    def live(self) -> list[int]:
        return [i for i, up in enumerate(self.tracker.alive) if up]

    def send(self, method: str, *args) -> tuple[list[int], list]:
        """``method(*args)`` called on every live replica at once: the replicas and their result refs. The
        fan-out both clusters use: ``each`` waits for them here, ``each_async`` in an event loop."""
        live = self.live()
        return live, [getattr(self.actors[i], method).remote(*args) for i in live]

    def gathered(self, live: list[int], results: list) -> list:
        """``send``'s results (exceptions as values) in replica order, None for a dead replica: one found dead
        here is marked so (``lost``); any other error is raised."""
        out: list = [None] * len(self.actors)
        for i, result in zip(live, results, strict=True):
            if isinstance(result, ACTOR_LOST):
                self.lost(i)
            elif isinstance(result, BaseException):
                raise result
            else:
                out[i] = result
        return out

    def each(self, method: str, *args) -> list:
        """``method(*args)`` on every live replica, in parallel, waiting here (see ``gathered``)."""
        live, refs = self.send(method, *args)
        return self.gathered(live, [_result(ref) for ref in refs])

    async def each_async(self, method: str, *args) -> list:
        """``each`` for an asyncio caller (the server): the refs are awaited, not waited for."""
        live, refs = self.send(method, *args)
        return self.gathered(live, await asyncio.gather(*refs, return_exceptions=True))

    def shutdown(self) -> None:
        """Kill the actors; shut Ray down if this fleet started it. Safe to call twice."""
        for actor in self.actors:
            _kill(actor)
        if self.owns_ray and ray.is_initialized():
            ray.shutdown()
        self.owns_ray = False


def _kill(actor) -> None:
    """Kill an actor for good. One that is already dead, or whose Ray has shut down, is what we want: Ray's
    error saying so is dropped, nothing else is at stake."""
    with contextlib.suppress(Exception):
        ray.kill(actor, no_restart=True)


def _result(ref) -> object:
    """A ref's value, or the exception getting it raised (for ``Fleet.gathered``)."""
    try:
        return ray.get(ref)
    except Exception as e:  # noqa: BLE001 - returned, and raised by gathered unless it means a dead actor
        return e


def _init_ray(address: str | None, num_cpus: int) -> bool:
    """Join ``address`` or start Ray on this machine (``num_cpus`` logical CPUs, no dashboard) unless it is
    running already; whether this call started it."""
    if ray.is_initialized():
        return False
    if address is None:
        ray.init(num_cpus=num_cpus, include_dashboard=False)
    else:
        ray.init(address=address)
    return True


