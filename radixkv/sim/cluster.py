"""A simulated cluster: N replicas, each the simulator's engine with its own cache, behind one router.

The replicas share one simulated clock. Requests are sent at their arrival (or after their parent, as in
``simulate``); the router sees each replica through a ``LoadTracker`` (requests it sent and that have not
finished, their tokens: what a router process can count itself) plus each replica's KV use, and, for
routers fed by cache events, the events each replica's cache emitted, stamped with that replica's clock.
Each replica runs as ``simulate`` runs one engine: ``simulate`` is this loop with one replica.

Event loop: the next thing to happen is either the next arrival or the step of the busy replica whose
clock is earliest; an arrival at the same time as a step goes first (as in ``simulate``). A replica's step
is atomic: a request routed while it runs sees its state before the step, and waits for the step's end.
O(requests x N) for the views, plus the replicas' own work.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Hashable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np

from radixkv.bounds import upper_bound
from radixkv.cache.base import PrefixCache
from radixkv.cache.eviction import EVERY_POLICY, needs_future
from radixkv.cache.future import FutureUses
from radixkv.cache.tiered import Tier, device_policy
from radixkv.cache.tiers import HOST, STORAGE
from radixkv.checks import is_int
from radixkv.cost import CostModel
from radixkv.routing import RoundRobin, Router, fit_router, memory_params
from radixkv.routing.base import EventRouter, LoadTracker
from radixkv.sim.replica import (
    Feed,
    Replica,
    Running,
    SimResult,
    cacheable_prompt,
    numbered,
    request_list,
    whole_kv,
)
from radixkv.stack import SIMULATOR_DEFAULTS, Stack, StackConfig, build_stack, check_idle, lower_tier, settings_from
from radixkv.workloads.request import Request


@dataclass
class ClusterResult:
    """One cluster run: each replica's ``SimResult``, the router's decisions and the references.

    ``decisions[rid]``: the replica request ``rid`` was sent to. ``decision_counts``: requests per replica
    (``replica 0`` ...) plus the router's own tally where it keeps one (``exploit`` / ``explore`` ...).
    ``references``: hit rates no routing of these N caches can beat: ``upper_bound`` (unlimited capacity,
    perfect order), ``pooled_lru`` and ``pooled_belady`` (one cache of N x the capacity, N x the compute).
    """

    replicas: list[SimResult]
    decisions: list[int]
    decision_counts: dict[str, int] = field(default_factory=dict)
    references: dict[str, float] = field(default_factory=dict)
    config: dict = field(default_factory=dict)

    @property
    def prompt_tokens(self) -> int:
        return sum(r.prompt_tokens for r in self.replicas)

    @property
    def hit_tokens(self) -> int:
        return sum(r.hit_tokens for r in self.replicas)

    @property
    def hit_rate(self) -> float:
        """Hit tokens over prompt tokens of the served requests, over all replicas."""
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def hit_rate_by_tier(self) -> dict[str, float]:
        """``hit_rate`` split by the tier each hit token came from, over all replicas; sums to it."""
        hits: Counter = Counter()
        for r in self.replicas:
            hits.update(r.hit_tokens_by_tier)
        n = self.prompt_tokens
        return {tier: h / n if n else 0.0 for tier, h in hits.items()}

    @property
    def computed_tokens(self) -> list[int]:
        """Prompt tokens each replica computed (prefilled)."""
        return [r.computed_tokens for r in self.replicas]

    @property
    def saved_prefill_s(self) -> float:
        """Prefill seconds the replicas' caches saved under the cost model (``SimResult.saved_prefill_s``), summed."""
        return sum(r.saved_prefill_s for r in self.replicas)

    @property
    def imbalance(self) -> float:
        """Max over mean of the replicas' computed prompt tokens (1.0: perfectly even)."""
        c = self.computed_tokens
        mean = sum(c) / len(c)
        return max(c) / mean if mean else 1.0

    @property
    def makespan(self) -> float:
        return max(r.makespan for r in self.replicas)

    def ttfts(self) -> np.ndarray:
        """Every served request's TTFT (seconds from its arrival), all replicas."""
        return np.concatenate([r.ttfts() for r in self.replicas])

    @property
    def ttft_mean(self) -> float:
        t = self.ttfts()
        return float(np.mean(t)) if len(t) else 0.0

    @property
    def ttft_p50(self) -> float:
        t = self.ttfts()
        return float(np.median(t)) if len(t) else 0.0

    @property
    def ttft_p99(self) -> float:
        t = self.ttfts()
        return float(np.percentile(t, 99)) if len(t) else 0.0

    @property
    def throughput(self) -> float:
        """Served requests per simulated second, over the cluster's makespan."""
        return len(self.ttfts()) / self.makespan if self.makespan else 0.0

    def summary(self) -> dict[str, Any]:
        """The totals, TTFT statistics, throughput and references as a flat dict (what experiments store)."""
        own = ("hit_rate", "prompt_tokens", "hit_tokens", "computed_tokens", "imbalance", "ttft_mean", "ttft_p50",
               "ttft_p99", "throughput", "makespan")
        summed = ("load_seconds", "loaded_tokens", "written_tokens", "saved_prefill_s")
        out = {**{k: getattr(self, k) for k in own}, "rejected": sum(r.rejected for r in self.replicas),
               "decision_counts": dict(self.decision_counts), "hit_rate_by_tier": self.hit_rate_by_tier,
               **{k: sum(getattr(r, k) for r in self.replicas) for k in summed}}
        for name, value in self.references.items():
            out[name] = value
            out[f"share_of_{name}"] = self.hit_rate / value if value else 0.0
        return out


def sim_config(config: StackConfig | None, settings: dict[str, Any]) -> tuple[StackConfig, PrefixCache | None]:
    """The ``StackConfig`` of a ``simulate`` / ``simulate_cluster`` call and the cache object it was given, if
    any: ``config`` (or ``SIMULATOR_DEFAULTS``) with the keyword settings on top. ``cache`` is a name or a
    ready ``PrefixCache``; ``in_batch_sharing=None`` means off (0)."""
    settings = dict(settings)
    cache = settings.pop("cache", None)  # an object's page is its own (build_replica)
    if isinstance(cache, str):
        settings["prefix_cache"], cache = cache, None
    elif cache is not None and not isinstance(cache, PrefixCache):
        raise ValueError(f"cache must be a name or a PrefixCache, got {type(cache).__name__}")
    if "in_batch_sharing" in settings and settings["in_batch_sharing"] is None:
        settings["in_batch_sharing"] = 0
    return settings_from(config or SIMULATOR_DEFAULTS, **settings), cache


def build_replica(requests: Sequence[Request], config: StackConfig, preemption: bool,
                  cache: PrefixCache | None = None, cost: CostModel | None = None,
                  storage: Tier | None = None) -> tuple[Stack, dict]:
    """One simulated engine's cache, allocator and scheduler (``build_stack``) and the config that names it.
    Unlimited capacity makes room for every token of every request, so nothing is ever evicted. Tiers load
    where ``cost`` says it beats recomputing; ``storage``: a store the replicas share."""
    page = cache.page_size if cache is not None else config.kv_page_size
    slots = config.capacity_tokens
    if slots is None:
        slots = sum(r.prompt_len + r.output_len for r in requests) + page * (len(requests) + 1)
    if cache is None and needs_future(config.eviction_policy):  # a clairvoyant policy knows every arrival
        future = FutureUses(CacheablePrompts(requests), config.page_size)
    else:  # a ready cache whose policy was handed its future marks requests served the same way
        future = getattr(getattr(cache, "policy", None), "future", None)
    cost = cost or CostModel()
    stack = build_stack(config, slots, cache=cache, whole_kv=None if preemption else whole_kv, storage=storage,
                        worth_loading=cost.worth_loading, future=future,
                        load_time=lambda tokens: cost.load_time(HOST, tokens))
    policy = getattr(stack.scheduler.policy, "inner", stack.scheduler.policy)
    if getattr(policy, "needs_future", False):  # a clairvoyant schedule (session-oracle) knows every request
        policy.foresee(requests)
    return stack, {**config.to_dict(), "cache": config.prefix_cache if cache is None else type(cache).__name__,
                   "kv_slots": stack.allocator.capacity, "allocator_page": stack.allocator.page_size,
                   # the threshold the builder applied (none: no sharing)
                   "in_batch_sharing": getattr(stack.scheduler.policy, "threshold", None), "preemption": preemption}


class CacheablePrompts:
    """Each request's cacheable prompt and namespace, in order, built as they are read (``FutureUses`` reads
    them twice): a replay of block prompts never holds every prompt's tokens at once."""

    def __init__(self, requests: Sequence[Request]):
        self.requests = requests

    def __len__(self) -> int:
        return len(self.requests)

    def __iter__(self) -> Iterator[tuple[np.ndarray, Hashable]]:
        return ((cacheable_prompt(r.tokens()), r.namespace) for r in self.requests)


def checked_requests(requests: object, preemption: object) -> list[Request]:
    """The requests as a numbered list (``ValueError`` for anything else) after checking ``preemption``."""
    if not isinstance(preemption, bool):
        raise ValueError(f"preemption must be a bool, got {preemption!r}")
    return numbered(request_list(requests))


def run_cluster(requests: list[Request], stacks: list[Stack], router: Router, cost: CostModel) -> ClusterResult:
    """Replay ``requests`` over one simulated replica per stack behind ``router``, on one clock; every
    replica ends idle with nothing leaked (``check_idle``)."""
    result = _ClusterRun(requests, stacks, router, cost).run()
    for s in stacks:
        check_idle(s.cache, s.allocator)
    return result


def simulate_cluster(requests: Sequence[Request], config: StackConfig | int | None = None, *, replicas: int = 2,
                     router: str | Router = "affinity", router_params: dict | None = None,
                     cost_model: CostModel | None = None, references: bool = True, preemption: bool = False,
                     **settings: Any) -> ClusterResult:
    """Replay ``requests`` over ``replicas`` simulated engines behind ``router``; see the module doc.

    Args:
        config: every replica's cache and scheduling settings (``StackConfig``; ``SIMULATOR_DEFAULTS`` when
            None); ``settings`` replace fields of it by keyword (``cache``, ``capacity_tokens`` per replica,
            ``page_size``, ... as ``simulate`` takes them). An int here is ``replicas`` (the old order).
        router: a name for ``make_router`` (with ``router_params``; a router that counts in blocks takes the
            replicas' page or block size; ``affinity``, the default, the replicas' device and host tokens unless
            given) or a ``Router`` object (used as is).
        references: also compute ``ClusterResult.references`` (two more simulations of one pooled cache);
            ``cluster_references`` gives them alone, to compute once for many routers.
    """
    if is_int(config):
        config, replicas = None, config
    if not (is_int(replicas) and replicas >= 1):
        raise ValueError(f"replicas must be an int >= 1, got {replicas!r}")
    requests = checked_requests(requests, preemption)
    config, obj = sim_config(config, settings)
    if obj is not None or needs_future(config.eviction_policy):
        raise ValueError("simulate_cluster takes a cache name (each replica builds its own) and an online eviction "
                         f"policy (one that needs the future is a reference, see cluster_references), got "
                         f"{settings.get('cache')!r}, {config.eviction_policy!r}")
    route = fit_router(router, config.kv_page_size, memory_params(router, config, router_params))
    cost = cost_model or CostModel()
    stores = [lower_tier(config, replace(spec, shared=True)) for spec in config.tiers if spec.name == STORAGE]
    store = stores[0] if stores else None  # one store every replica reads and writes
    built = [build_replica(requests, config, preemption, cost=cost, storage=store) for _ in range(replicas)]
    result = run_cluster(requests, [stack for stack, _ in built], route, cost)
    result.config = {**built[0][1], "replicas": replicas, "router": route.name, "router_params": _params(route),
                     "cost_model": asdict(cost), "requests": len(requests)}
    if references:
        result.references = cluster_references(requests, replicas, config=config, cost_model=cost_model)
    return result


def cluster_references(requests: Sequence[Request], replicas: int, capacity_tokens: int | None = None, *,
                       config: StackConfig | None = None, cost_model: CostModel | None = None, clairvoyant: bool = True,
                       **settings: Any) -> dict[str, float]:
    """Hit rates no routing of N caches of ``capacity_tokens`` (or ``config``'s) can beat: the workload's upper
    bound, and one pooled cache of N x the capacity with N x the compute (a cost model N times faster, N x
    ``max_running``), under LRU and (radix only, ``clairvoyant=True``) each policy that needs the future
    (``pooled_<name>``: Belady's ``pooled_belady``). With host or
    storage tiers the pooled cache is one tier holding all of their memory (``pooled_tokens``), with nothing to
    prefetch from."""
    if capacity_tokens is not None:
        settings["capacity_tokens"] = capacity_tokens
    config, _ = sim_config(config, settings)
    pooled = settings_from(config, max_running=config.max_running * replicas, capacity_tokens=None
                           if config.capacity_tokens is None else pooled_tokens(config, replicas),
                           host_capacity_tokens=None, storage_capacity_tokens=None, prefetch=False)
    faster = (cost_model or CostModel()).scaled(replicas)
    requests = checked_requests(requests, False)
    out = {"upper_bound": upper_bound(requests, page_size=config.kv_page_size)}
    seers = [name for name in EVERY_POLICY if clairvoyant and config.prefix_cache == "radix" and needs_future(name)]
    for name in ["lru", *seers]:  # then the references that know the future (radix only)
        out[f"pooled_{name}"] = simulate_on(requests, settings_from(pooled, eviction_policy=name), faster).hit_rate
    return out


def pooled_tokens(config: StackConfig, replicas: int) -> int:
    """Every tier's memory of ``replicas`` replicas as one single-tier cache: N x (device + host) + the storage
    they share (a tiered cluster's references pool all of it, so no routing or tiering can beat them)."""
    return replicas * (config.capacity_tokens + (config.host_capacity_tokens or 0)) + (
        config.storage_capacity_tokens or 0)


def simulate_on(requests: list[Request], config: StackConfig, cost: CostModel, preemption: bool = False,
                cache: PrefixCache | None = None) -> SimResult:
    """``simulate`` on checked requests and a built config: a cluster of one replica (behind round robin, which
    has only replica 0 to choose)."""
    stack, named = build_replica(requests, config, preemption, cache, cost)
    result = run_cluster(requests, [stack], RoundRobin(), cost).replicas[0]  # one replica: always 0
    policy = device_policy(stack.cache)
    result.config = {**named, "cost_model": asdict(cost), "requests": len(requests),
                     "eviction": None if policy is None else policy.describe()}  # with what it learned by the end
    if stack.scheduler.prefetcher is not None:  # the pauses it predicted by the end
        result.config["prefetcher"] = stack.scheduler.prefetcher.describe()
    return result


def _params(router: Router) -> dict:
    """A router's parameters as far as it exposes them (its public scalar attributes), for the config."""
    return {k: v for k, v in vars(router).items() if not k.startswith("_") and isinstance(v, int | float | str)}


class _ClusterRun:
    """State of one cluster run: the feed, the replicas on one clock, the router and its load tracker."""

    def __init__(self, requests: list[Request], stacks: list[Stack], router: Router, cost: CostModel):
        self.feed = Feed(requests)
        self.router = router
        self.tracker = LoadTracker(len(stacks))
        self.replicas = [Replica(self.feed, s.scheduler, cost, i, self._finished, s.future)
                         for i, s in enumerate(stacks)]
        self.decisions = [-1] * len(requests)
        self.prefetching = [rep for rep in self.replicas if rep.scheduler.prefetcher is not None]
        if isinstance(router, EventRouter):  # only event-fed routers pay for events
            for rep in self.replicas:
                rep.cache.listener = self._listener(rep)

    def _listener(self, rep: Replica):
        return lambda event: self.router.observe(rep.index, event, rep.now)

    def _finished(self, run: Running, replica: int, tokens: np.ndarray) -> None:
        self.tracker.done(run.rid)
        self.router.finished(replica, tokens, run.namespace)

    def _send(self) -> None:
        t = self.feed.next_time()
        req = self.feed.pop()
        used = [1.0 - rep.alloc.num_free / rep.alloc.capacity for rep in self.replicas]
        tokens = req.tokens()  # built once per request (a ``BlockPrompt`` holds its block ids only)
        # a router that follows sessions is told the request's (an agent session, a conversation)
        session = {"session": req.session} if getattr(self.router, "follows_sessions", False) else {}
        i = self.router.route(tokens, self.tracker.views(used), req.namespace, now=t, **session)
        if not (isinstance(i, int | np.integer) and 0 <= i < len(self.replicas)):
            raise ValueError(f"router {self.router.name!r} returned {i!r}, not a replica index")
        i = int(i)
        self.decisions[req.rid] = i
        self.tracker.sent(req.rid, i, req.prompt_len, req.output_len)
        rep = self.replicas[i]
        if not rep.busy:
            rep.now = max(rep.now, t)
        rep.add(req, tokens)

    def run(self) -> ClusterResult:
        while True:
            busy = [rep for rep in self.replicas if rep.busy]
            t_step = min((rep.now for rep in busy), default=math.inf)
            t_feed = self.feed.next_time() if self.feed.pending else math.inf
            t_due, idle = min(((rep.next_prefetch(), rep.index) for rep in self.prefetching if not rep.busy),
                              default=(math.inf, -1))
            if t_due < min(t_feed, t_step) < math.inf:
                self.replicas[idle].prefetch_idle()  # a context due on an idle replica loads now, before anything else
            elif self.feed.pending and t_feed <= t_step:
                self._send()
            elif busy:
                min(busy, key=lambda rep: (rep.now, rep.index)).step()
            else:
                break
        self.feed.check_all_sent(row["rid"] for rep in self.replicas for row in rep.result.per_request)
        counts = Counter(f"replica {i}" for i in self.decisions)
        counts.update(getattr(self.router, "counts", {}))
        results = [rep.close() for rep in self.replicas]
        return ClusterResult(results, self.decisions, dict(sorted(counts.items())))


__all__ = ["ClusterResult", "cluster_references", "simulate_cluster"]
