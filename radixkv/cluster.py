"""``Cluster``: N ``LLM`` replicas as Ray actors behind the same ``Router`` objects as the simulator.

    with Cluster("tiny-random", replicas=2, router="round_robin", kv_cache_tokens=1024) as cluster:
        outs = cluster.generate([[1, 2, 3], [4, 5, 6]], SamplingParams(max_new_tokens=8))
        cluster.decisions   # [0, 1]: the replica of each request, in routing order

Routing is one code path with the simulator's cluster: a ``LoadTracker`` counts what the driver sent and
what came back, and the router sees its ``views()``. ``generate`` routes every prompt first, in order,
then sends each replica its share as one call and gathers; only then are the requests finished (in input
order), so decisions depend only on the prompts and their order, as in the simulator with every arrival
at time 0. Routers that read cache events (``EventRouter``) get each replica's events, stamped in the
actor with the wall clock and fed in order, on the cluster's clock (seconds since it started).

A replica whose actor dies is marked dead and killed; its requests are released and routed again, once
each, to the live ones (``RuntimeError`` when none is left, or a request has lost two replicas).

``Fleet`` is what ``Cluster`` and the server's ``ClusterEngine`` (``radixkv.serving.replicas``) share: Ray,
the actors, the router, the tracker, and a ``Front`` that tokenizes and checks prompts on the driver with
the replicas' own ``LLM`` code. Needs Ray (``pip install 'radixkv[ray]'``); ``import radixkv`` never
imports it.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import time
from collections.abc import Hashable, Sequence
from types import SimpleNamespace

import numpy as np

try:
    import ray
except ImportError as e:  # pragma: no cover - the ray extra is missing
    raise ImportError("radixkv.cluster needs Ray: pip install 'radixkv[ray]' (make install does)") from e

from radixkv.config import EngineConfig, SamplingParams
from radixkv.engine import LLM, RequestOutput, batch_arguments
from radixkv.heap import freeze_startup_heap
from radixkv.routing import make_router
from radixkv.routing.base import EventRouter, LoadTracker

ACTOR_LOST = (ray.exceptions.RayActorError,)  # ActorDiedError and ActorUnavailableError are both


def build_llm(model: str, settings: dict, threads: int) -> LLM:
    """The replica's engine, built on the thread that will run it, with ``threads`` torch threads."""
    import torch

    torch.set_num_threads(threads)
    llm = LLM(model, **settings)
    freeze_startup_heap()  # a replica's process is a server's: see freeze_startup_heap
    return llm


def describe(llm: LLM) -> tuple:
    """What ``Front`` needs of a replica's engine (all of it picklable)."""
    return llm.config, llm.model.config, llm.tokenizer, llm.allocator.capacity


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


class Front:
    """A replica's engine as the driver sees it, without weights: its config, model config, tokenizer and
    KV capacity, and ``LLM``'s own prompt code (``_encode``, ``_checked``, ``chat_prompt``), so the driver
    computes the same token ids and refuses the same prompts as the replicas would."""

    def __init__(self, config, model_config, tokenizer, capacity: int):
        self.config, self.tokenizer = config, tokenizer
        self.model = SimpleNamespace(config=model_config)
        self.allocator = SimpleNamespace(capacity=capacity)

    _encode = LLM._encode
    _checked = LLM._checked
    _chat_ids = LLM._chat_ids
    chat_prompt = LLM.chat_prompt


class Fleet:
    """Ray, N replica actors of ``actor_cls``, the router and its ``LoadTracker``; see the module docstring.

    ``actor_cls(threads)`` must have ``start(model, settings, events) -> describe(llm)``. Bad arguments
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
        self.front = Front(*infos[0])

    # ---------------------------------------------------------------- routing
    def now(self) -> float:
        """Seconds since the fleet started: the clock routers and events are stamped with."""
        return time.time() - self.started

    def route(self, rid: Hashable, ids: Sequence[int], params: SamplingParams, namespace: Hashable = None) -> int:
        """Pick a live replica for one request and count it as sent there (``RuntimeError`` when none lives)."""
        if not any(self.tracker.alive):
            raise RuntimeError(f"all {len(self.actors)} replicas are dead: nothing left to serve the request")
        views = self.tracker.views(self.kv_used)
        replica = self.router.route(np.asarray(ids, dtype=np.int64), views, namespace, now=self.now())
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

    def each(self, method: str, *args) -> list:
        """``method(*args)`` on every live replica, in parallel: results in replica order, None for the dead
        (a replica found dead here is marked so)."""
        refs = {i: getattr(self.actors[i], method).remote(*args) for i in self.live()}
        out: list = [None] * len(self.actors)
        for i, ref in refs.items():
            try:
                out[i] = ray.get(ref)
            except ACTOR_LOST:
                self.lost(i)
        return out

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


class _Replica:
    """One ``LLM`` in a Ray actor; the engine is built by ``start``, so a bad model is an ordinary error."""

    def __init__(self, threads: int):
        self.threads, self.llm, self.events = threads, None, EventBuffer()

    def start(self, model: str, settings: dict, events: bool) -> tuple:
        self.llm = build_llm(model, settings, self.threads)
        if events:
            self.llm.cache.listener = self.events
        return describe(self.llm)

    def run(self, prompts: list[list[int]], params: list[SamplingParams],
            namespace: Hashable) -> tuple[list[RequestOutput], list, float]:
        """Serve these (already checked) prompts to completion: their outputs in order, the cache events
        since the last call, and the share of KV slots held after (as the simulator's cluster reports it).
        A failure withdraws them and leaves the engine as ``LLM.generate`` does."""
        llm, rids, done = self.llm, [], {}
        try:
            for ids, sp in zip(prompts, params, strict=True):
                rids.append(llm.add_request(ids, sp, namespace))
            while len(done) < len(rids):
                done.update((o.request_id, o) for o in llm.step())
        except BaseException:
            llm.scheduler.withdraw(set(rids))
            raise
        return [done[r] for r in rids], self.events.drain(), 1 - llm.allocator.num_free / llm.allocator.capacity

    def stats(self) -> dict:
        return self.llm.stats()

    def check_idle(self) -> None:
        self.llm.check_idle()

    def call(self, fn):
        return fn(self.llm)


class Cluster:
    """N ``LLM(model, **engine_settings)`` replicas as Ray actors; see the module docstring.

    ``address``: join that Ray cluster (default: start one on this machine, or use the one running).
    ``num_cpus_per_replica``: each actor's Ray CPUs and torch threads. ``router``/``router_params``:
    ``make_router``'s. ``decisions``: the replica of each request routed (retries too), in routing order.
    """

    def __init__(self, model: str, replicas: int = 1, router: str = "round_robin", address: str | None = None,
                 router_params: dict | None = None, num_cpus_per_replica: int = 1, **engine_settings):
        self.fleet = Fleet(_Replica, model, replicas, router, address, router_params, num_cpus_per_replica,
                           engine_settings)
        self.router, self.tracker, self.decisions = self.fleet.router, self.fleet.tracker, self.fleet.decisions
        self.actors = self.fleet.actors
        self._ids = itertools.count()

    def generate(self, prompts, params: SamplingParams | Sequence[SamplingParams] | None = None,
                 namespace: Hashable = None) -> list[RequestOutput]:
        """``LLM.generate`` across the replicas: one ``RequestOutput`` per prompt, in input order, each
        ``request_id`` unique in the cluster. Bad prompts raise ``ValueError`` before anything is routed."""
        prompts, params = batch_arguments(prompts, params)
        front = self.fleet.front
        jobs = {next(self._ids): (front._checked(p, sp), sp) for p, sp in zip(prompts, params, strict=True)}
        where: dict[int, int] = {}  # request id -> replica, while it is outstanding
        try:
            for rid, (ids, sp) in jobs.items():  # every prompt routed before any finishes
                where[rid] = self.fleet.route(rid, ids, sp, namespace)
            outs, events = self._gather(jobs, where, namespace)
        except BaseException:
            for rid in where:
                self.tracker.done(rid)
            raise
        try:
            for replica, evs in events.items():  # what the caches did, then what finished (as in the simulator)
                self.fleet.observe(replica, evs)
        finally:
            for rid in jobs:
                outs[rid].request_id = rid
                self.fleet.finish(rid, outs[rid].prompt_token_ids + outs[rid].token_ids[:-1], namespace)
        return [outs[rid] for rid in jobs]

    def chat(self, conversations, params: SamplingParams | None = None) -> list[RequestOutput]:
        """``LLM.chat`` across the replicas (the chat template applied on the driver, as each replica would)."""
        if not isinstance(conversations, Sequence) or isinstance(conversations, str | bytes):
            raise ValueError(f"conversations must be a list of messages or of conversations, got "
                             f"{type(conversations).__name__}")
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        return self.generate([self.fleet.front.chat_prompt(c) for c in conversations], params)

    def _gather(self, jobs: dict, where: dict[int, int], namespace: Hashable) -> tuple[dict, dict]:
        """Send each replica its routed requests as one call; collect outputs by request id and events by
        replica. A replica that dies has its requests routed again, once each."""
        pending: dict = {}  # ref -> (replica, request ids)
        outs: dict[int, RequestOutput] = {}
        events: dict[int, list] = collections.defaultdict(list)
        retried: set[int] = set()

        def send(rids: list[int]) -> None:
            for replica in sorted({where[r] for r in rids}):
                mine = [r for r in rids if where[r] == replica]
                ref = self.actors[replica].run.remote([jobs[r][0] for r in mine], [jobs[r][1] for r in mine],
                                                      namespace)
                pending[ref] = (replica, mine)

        send(list(jobs))
        while pending:
            [ref], _ = ray.wait(list(pending), num_returns=1)
            replica, rids = pending.pop(ref)
            try:
                got, evs, self.fleet.kv_used[replica] = ray.get(ref)
            except ACTOR_LOST:
                self._reroute(replica, rids, jobs, where, retried, namespace)
                send(rids)
                continue
            except Exception:  # the replica's own error: the others finish their share, then it is raised
                ray.wait(list(pending), num_returns=len(pending))
                raise
            outs.update(zip(rids, got, strict=True))
            events[replica].extend(evs)
        return outs, events

    def _reroute(self, replica: int, rids: list[int], jobs: dict, where: dict[int, int], retried: set[int],
                 namespace: Hashable) -> None:
        """``replica`` died holding ``rids``: mark it dead, release them, and route them again."""
        self.fleet.lost(replica)
        for rid in rids:
            self.tracker.done(rid)
            del where[rid]
        twice = [r for r in rids if r in retried]
        if twice:
            raise RuntimeError(f"requests {twice} lost a second replica ({replica}); they are not retried again")
        retried.update(rids)
        for rid in rids:
            ids, sp = jobs[rid]
            where[rid] = self.fleet.route(rid, ids, sp, namespace)  # RuntimeError when no replica is left

    def stats(self) -> list[dict | None]:
        """Each replica's ``LLM.stats()`` (None for a dead one)."""
        return self.fleet.each("stats")

    def check_idle(self) -> None:
        """``LLM.check_idle()`` on every live replica (its ``AssertionError`` comes through)."""
        self.fleet.each("check_idle")

    def shutdown(self) -> None:
        """Kill the actors (and stop Ray if this cluster started it)."""
        self.fleet.shutdown()

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


