"""Belady on the order the scheduler serves: the clairvoyant eviction for a reordering scheduler.

``belady`` ranks a leaf by the first future request that will use it, in arrival order (``FutureUses``). A
scheduler that reorders the queue (``session``, ``session-oracle``, ``lpm``) serves another order, so Belady
on arrivals is not Belady for what runs, and an online policy can beat it. ``belady_on_served_order``
replays with Belady ranked by arrival, then again ranked by the order that replay served (the requests by
the time they were admitted), and so on, until a replay serves the very order it was ranked by (a fixed
point: Belady for the order that ran) or ``rounds`` replays ran; it says which.

Even at the fixed point it bounds the hit rate of that one served order only: another eviction order changes
when requests finish and so when they come back, and a closed loop then serves another order. So no row it
gives is a bound on TTFT, or on what another scheduler could reach. Each round is one replay.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from radixkv.cache.eviction import REFERENCES
from radixkv.cache.factory import make_cache
from radixkv.cache.future import FutureUses
from radixkv.sim.cluster import CacheablePrompts
from radixkv.sim.engine import simulate
from radixkv.sim.replica import SimResult
from radixkv.workloads.request import Request

CLAIRVOYANT = next(iter(REFERENCES))  # the eviction reference that is handed the future


def served_order(result: SimResult, requests: int) -> list[int]:
    """The requests' indices in the order a replay admitted them (a rejected one where it was turned away,
    by its arrival: it used nothing). O(n log n)."""
    when = {r["rid"]: (r.get("admitted", r.get("ready", 0.0)) if not r["rejected"] else -1.0, r["rid"])
            for r in result.per_request}
    if len(when) != requests:
        raise ValueError(f"the replay served {len(when)} of {requests} requests")
    return sorted(range(requests), key=lambda rid: when[rid])


def belady_on_served_order(requests: Sequence[Request], *, page_size: int = 1, rounds: int = 4,
                           **settings: Any) -> tuple[SimResult, dict]:
    """The last replay of the module doc's iteration, with ``{"rounds": k, "fixed_point": bool}``; the radix
    cache at ``page_size`` under Belady, every other setting of ``simulate`` as given (a schedule policy, a
    capacity, a cost model; no lower tiers). ``ValueError`` for ``rounds`` below 1."""
    if rounds < 1:
        raise ValueError(f"rounds must be at least 1, got {rounds}")
    requests = list(requests)
    order: list[int] | None = None
    for k in range(1, rounds + 1):
        future = FutureUses(CacheablePrompts(requests), page_size, order=order)
        cache = make_cache("radix", page_size=page_size, eviction_policy=CLAIRVOYANT, future=future)
        result = simulate(requests, cache=cache, **settings)
        served = served_order(result, len(requests))
        if served == (order if order is not None else list(range(len(requests)))):
            return result, {"rounds": k, "fixed_point": True}
        order = served
    return result, {"rounds": rounds, "fixed_point": False}
