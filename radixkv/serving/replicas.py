"""``ClusterEngine``: ``AsyncLLM``'s interface over N replicas in Ray actors, for ``radixkv serve --replicas N``.

Each replica is an async Ray actor running its own ``AsyncLLM`` (its engine loop, continuous batching,
stop strings and aborts, unchanged). The driver routes each request as it arrives with the fleet's router
and ``LoadTracker`` (``radixkv.cluster.Fleet``), then streams its deltas from the actor through a Ray
streaming generator, each tagged with its replica; an abort is sent to the replica that holds the request.
Prompts are tokenized and checked on the driver with the replicas' own rules (``radixkv.inputs.Prompts``),
so bad input is a ``ValueError`` before anything is routed. It has ``AsyncLLM``'s interface, so the server
serves one engine or N the same way.

A replica that dies is marked dead; a request it held that had sent no token yet is routed again (once),
one that had is ended with ``finish_reason="error"``. Per-replica gauges are read from the actors when
``/metrics`` is scraped (``snapshots``). Routers that read cache events get each replica's buffered
events, drained before each routing decision.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

from radixkv.cluster.fleet import ACTOR_LOST, Fleet, ReplicaActor, build_llm
from radixkv.config import SamplingParams
from radixkv.serving.async_llm import AsyncLLM, Delta
from radixkv.serving.metrics import engine_gauges


class _StreamingReplica(ReplicaActor):
    """One ``AsyncLLM`` in an async Ray actor (its engine built on the engine's own thread)."""

    async def start(self, model: str, settings: dict, events: bool) -> tuple:
        self.engine = AsyncLLM(lambda: build_llm(model, settings, self.threads))
        info = self.attach(self.engine.llm, events)
        await self.engine.start()
        return info

    async def stream(self, ids: list[int], params: SamplingParams, request_id: str,
                     stop: Sequence[str]) -> AsyncIterator[Delta]:
        async for delta in self.engine.generate(ids, params, request_id, stop):
            yield delta

    def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)

    async def call(self, fn):
        return await self.engine.call(fn)

    async def shutdown(self) -> None:
        await self.engine.shutdown()


@dataclass(eq=False)
class _Request:
    """A request as the driver tracks it: where it is and what it has received."""

    request_id: str
    ids: list[int]
    params: SamplingParams
    stop: tuple[str, ...]
    replica: int = -1
    sent: bool = False  # counted by the tracker as outstanding on ``replica``
    output: list[int] = field(default_factory=list)
    done: bool = False


class ClusterEngine:
    """The server's engine over ``replicas`` actors; see the module docstring. ``config`` and ``prompts`` are
    the replicas': what the routes read of an engine."""

    def __init__(self, model: str, replicas: int, router: str = "affinity", address: str | None = None,
                 router_params: dict | None = None, num_cpus_per_replica: int = 1, **settings):
        self.fleet = Fleet(_StreamingReplica, model, replicas, router, address, router_params,
                           num_cpus_per_replica, settings)
        self.config, self.prompts, self.replicas = self.fleet.config, self.fleet.prompts, replicas
        self._requests: dict[str, _Request] = {}
        self._ids = itertools.count()
        self._routing = asyncio.Lock()

    async def start(self) -> None:
        """The actors started with the engine: nothing to do (``AsyncLLM``'s interface)."""

    async def generate(self, prompt: Sequence[int], params: SamplingParams | None = None,
                       request_id: str | None = None, stop: Sequence[str] = ()) -> AsyncIterator[Delta]:
        """``AsyncLLM.generate`` on a replica the router picks; each delta's ``replica`` says which."""
        params = params or SamplingParams()
        req = _Request(request_id or f"req-{next(self._ids)}", self.prompts.check(list(prompt), params), params,
                       tuple(s for s in stop if s))
        try:
            for attempt in range(2):
                await self._route(req)
                try:
                    async for delta in self._deltas(req):
                        yield delta
                    return
                except ACTOR_LOST:
                    self._release(req)
                    self.fleet.lost(req.replica)
                    if req.output or attempt or not self.fleet.live():  # tokens already sent: not resent
                        req.done = True
                        yield Delta(req.request_id, [], "", len(req.ids), 0, len(req.output), "error",
                                    f"replica {req.replica} died", replica=req.replica)
                        return
        finally:
            self._requests.pop(req.request_id, None)
            if not req.done:  # the client went away, or the replica raised: abort and release
                self._abort(req)
            self._release(req)

    async def _route(self, req: _Request) -> None:
        async with self._routing:  # events, then the decision: in order across concurrent arrivals
            if self.fleet.wants_events:
                await self._pull_events()
            req.replica = self.fleet.route(req.request_id, req.ids, req.params)
            req.sent = True
            self._requests[req.request_id] = req

    def _release(self, req: _Request, cached: list[int] | None = None) -> None:
        """The tracker forgets the request; the router hears of it when its replica caches ``cached``."""
        if req.sent:
            req.sent = False
            if cached is None:
                self.fleet.tracker.done(req.request_id)
            else:
                self.fleet.finish(req.request_id, cached)

    async def _deltas(self, req: _Request) -> AsyncIterator[Delta]:
        actor = self.fleet.actors[req.replica]
        started = False
        async for ref in actor.stream.remote(req.ids, req.params, req.request_id, req.stop):
            delta: Delta = await ref
            delta.replica = req.replica
            req.output += delta.token_ids
            if delta.token_ids and not started:
                self.fleet.tracker.started(req.request_id)
                started = True
            if delta.finish_reason is not None:
                req.done = True
                ok = delta.finish_reason in ("stop", "length")
                self._release(req, req.ids + req.output[:-1] if ok else None)
                yield delta
                return  # the stream's end is not awaited: its replica dying now loses nothing
            yield delta

    async def _pull_events(self) -> None:
        for i, events in enumerate(await self.fleet.each_async("drain")):
            if events is not None:
                self.fleet.observe(i, events)

    def abort(self, request_id: str) -> None:
        """Stop a request on its replica; unknown ids are ignored."""
        req = self._requests.get(request_id)
        if req is not None:
            self._abort(req)

    def _abort(self, req: _Request) -> None:
        if req.replica >= 0 and self.fleet.tracker.alive[req.replica]:
            self.fleet.actors[req.replica].abort.remote(req.request_id)

    def abort_all(self) -> None:
        for name in list(self._requests):
            self.abort(name)

    async def flush_cache(self) -> dict:
        """``LLM.flush_cache`` on every live replica: tokens freed in all, and per replica (None: dead)."""
        each = await self.fleet.each_async("call", _flush)
        return {"freed_tokens": sum(f or 0 for f in each), "replicas": each}

    async def cache_state(self) -> dict:
        """``LLM.cache_state`` of every replica (None for a dead one)."""
        states = await self.fleet.each_async("call", _cache_state)
        return {"replicas": [s if s is None else {"replica": i} | s for i, s in enumerate(states)]}

    async def gauges(self) -> list[dict | None]:
        """Each replica's gauges (``engine_gauges``), None for a dead one."""
        return await self.fleet.each_async("call", engine_gauges)

    async def shutdown(self) -> None:
        """Abort everything, stop each replica's loop, kill the actors (and Ray if this engine started it)."""
        self.abort_all()
        live = [self.fleet.actors[i].shutdown.remote() for i in self.fleet.live()]
        await asyncio.gather(*live, return_exceptions=True)
        self.fleet.shutdown()



def _flush(llm) -> int:
    return llm.flush_cache()


def _cache_state(llm) -> dict:
    return llm.cache_state()
