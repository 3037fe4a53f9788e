"""A simulated cluster: N replicas, each the simulator's engine with its own cache, behind one router.

The replicas share one simulated clock. Requests are sent at their arrival (or after their parent, as in
``simulate``); the router sees each replica through a ``LoadTracker`` (requests it sent and that have not
finished, their tokens: what a router process can count itself) plus each replica's KV use, and, for
routers fed by cache events, the events each replica's cache emitted, stamped with that replica's clock.
Each replica then runs exactly as ``simulate`` runs one engine, so with N = 1 the result is ``simulate``'s.

Event loop: the next thing to happen is either the next arrival or the step of the busy replica whose
clock is earliest; an arrival at the same time as a step goes first (as in ``simulate``). A replica's step
is atomic: a request routed while it runs sees its state before the step, and waits for the step's end.
O(requests x N) for the views, plus the replicas' own work.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from radixkv.bounds import upper_bound
from radixkv.routing import Router, fit_router
from radixkv.routing.base import EventRouter, LoadTracker
from radixkv.sim.engine import (
    CostModel,
    SimResult,
    _check_idle,
    _check_settings,
    _Feed,
    _numbered,
    _Replica,
    _request_list,
    _Running,
    _scheduler,
    simulate,
)
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
    def computed_tokens(self) -> list[int]:
        """Prompt tokens each replica computed (prefilled)."""
        return [r.computed_tokens for r in self.replicas]

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
        out = {"hit_rate": self.hit_rate, "prompt_tokens": self.prompt_tokens, "hit_tokens": self.hit_tokens,
               "computed_tokens": self.computed_tokens, "imbalance": self.imbalance,
               "ttft_p50": self.ttft_p50, "ttft_p99": self.ttft_p99,
               "throughput": self.throughput, "makespan": self.makespan,
               "rejected": sum(r.rejected for r in self.replicas), "decision_counts": dict(self.decision_counts)}
        for name, value in self.references.items():
            out[name] = value
            out[f"share_of_{name}"] = self.hit_rate / value if value else 0.0
        return out


def simulate_cluster(
    requests: Sequence[Request],
    replicas: int = 2,
    router: str | Router = "round_robin",
    capacity_tokens: int | None = None,
    cache: str = "radix",
    page_size: int = 1,
    block_size: int = 16,
    eviction_policy: str = "lru",
    schedule_policy: str = "fcfs",
    max_running: int = 64,
    cost_model: CostModel | None = None,
    seed: int = 0,
    router_params: dict | None = None,
    references: bool = True,
    in_batch_sharing: int | None = None,
    max_batch_tokens: int | None = None,
    chunked_prefill_size: int | None = None,
    preemption: bool = False,
) -> ClusterResult:
    """Replay ``requests`` over ``replicas`` simulated engines behind ``router``; see the module doc.

    Args:
        replicas: N >= 1 engines, each with its own cache of ``capacity_tokens`` (None: unlimited).
        router: a name for ``make_router`` (with ``router_params``) or a ``Router`` object (used as is).
        cache, page_size, block_size, eviction_policy, schedule_policy, max_running, cost_model, seed and the
            token budgets: as ``simulate`` takes them, for every replica (``belady`` only in the references).
        references: also compute ``ClusterResult.references`` (two more simulations of one pooled cache);
            ``cluster_references`` gives them alone, to compute once for many routers.
    """
    requests = _numbered(_request_list(requests))
    route = fit_router(router, page_size if cache == "radix" else block_size, router_params)
    limits = {"max_batch_tokens": max_batch_tokens, "chunked_prefill_size": chunked_prefill_size}
    _check_settings(max_running, limits, preemption, capacity_tokens=capacity_tokens, page_size=page_size,
                    block_size=block_size, seed=seed, replicas=replicas)
    if not isinstance(cache, str) or eviction_policy == "belady":
        raise ValueError("simulate_cluster takes a cache name (each replica builds its own) and an online "
                         f"eviction policy (belady is a reference, see cluster_references), got {cache!r}, "
                         f"{eviction_policy!r}")
    settings = dict(page_size=page_size, block_size=block_size, eviction_policy=eviction_policy,
                    schedule_policy=schedule_policy, max_running=max_running, seed=seed,
                    in_batch_sharing=in_batch_sharing, limits=limits, preemption=preemption)
    built = [_scheduler(requests, cache, capacity_tokens, **settings) for _ in range(replicas)]
    run = _ClusterRun(requests, [s for s, _ in built], route, cost_model or CostModel())
    result = run.run()
    for s, _ in built:
        _check_idle(s.cache, s.allocator)
    result.config = {**built[0][1], "replicas": replicas, "router": route.name,
                     "router_params": _params(route), "cost_model": asdict(cost_model or CostModel()),
                     "requests": len(requests)}
    if references:
        result.references = cluster_references(requests, replicas, capacity_tokens, cache=cache,
                                               page_size=page_size, block_size=block_size,
                                               schedule_policy=schedule_policy, max_running=max_running,
                                               cost_model=cost_model, seed=seed)
    return result


def cluster_references(requests: Sequence[Request], replicas: int, capacity_tokens: int | None, cache: str = "radix",
                       page_size: int = 1, block_size: int = 16, schedule_policy: str = "fcfs",
                       max_running: int = 64, cost_model: CostModel | None = None, seed: int = 0,
                       belady: bool = True) -> dict[str, float]:
    """Hit rates no routing of N caches of ``capacity_tokens`` can beat: the workload's upper bound, and one
    pooled cache of N x the capacity with N x the compute (a cost model N times faster, N x ``max_running``),
    under LRU and (radix only, ``belady=True``) Belady's clairvoyant eviction."""
    cost = cost_model or CostModel()
    pooled = dict(cache=cache, capacity_tokens=None if capacity_tokens is None else capacity_tokens * replicas,
                  page_size=page_size, block_size=block_size, schedule_policy=schedule_policy,
                  max_running=max_running * replicas, seed=seed,
                  cost_model=CostModel(**{k: v / replicas for k, v in asdict(cost).items()}))
    granularity = page_size if cache == "radix" else block_size
    out = {"upper_bound": upper_bound(requests, page_size=granularity),
           "pooled_lru": simulate(requests, eviction_policy="lru", **pooled).hit_rate}
    if belady and cache == "radix":
        out["pooled_belady"] = simulate(requests, eviction_policy="belady", **pooled).hit_rate
    return out


def _params(router: Router) -> dict:
    """A router's parameters as far as it exposes them (its public scalar attributes), for the config."""
    return {k: v for k, v in vars(router).items() if not k.startswith("_") and isinstance(v, int | float | str)}


class _ClusterRun:
    """State of one cluster run; ``simulate_cluster`` is its only user."""

    def __init__(self, requests: list[Request], schedulers: list, router: Router, cost: CostModel):
        self.feed = _Feed(requests)
        self.router = router
        self.tracker = LoadTracker(len(schedulers))
        self.replicas = [_Replica(self.feed, s, cost, i, self._finished) for i, s in enumerate(schedulers)]
        self.decisions = [-1] * len(requests)
        if isinstance(router, EventRouter):  # only event-fed routers pay for events
            for rep in self.replicas:
                rep.cache.listener = self._listener(rep)

    def _listener(self, rep: _Replica):
        return lambda event: self.router.observe(rep.index, event, rep.now)

    def _finished(self, run: _Running, replica: int, tokens: np.ndarray) -> None:
        self.tracker.done(run.rid)
        self.router.finished(replica, tokens, run.namespace)

    def _send(self) -> None:
        t = self.feed.next_time()
        req = self.feed.pop()
        used = [1.0 - rep.alloc.num_free / rep.alloc.capacity for rep in self.replicas]
        views = self.tracker.views(used)
        i = self.router.route(req.prompt, views, req.namespace, now=t)
        if not (isinstance(i, int | np.integer) and 0 <= i < len(self.replicas)):
            raise ValueError(f"router {self.router.name!r} returned {i!r}, not a replica index")
        i = int(i)
        self.decisions[req.rid] = i
        self.tracker.sent(req.rid, i, len(req.prompt), req.output_len)
        rep = self.replicas[i]
        if not rep.busy:
            rep.now = max(rep.now, t)
        rep.add(req)

    def run(self) -> ClusterResult:
        while True:
            busy = [rep for rep in self.replicas if rep.busy]
            t_step = min((rep.now for rep in busy), default=math.inf)
            if self.feed.pending and self.feed.next_time() <= t_step:
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
