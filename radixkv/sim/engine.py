"""Trace-driven simulation of prefix caching: the real caches and policies, a modelled clock.

``simulate`` replays a workload on a virtual clock through the very objects the
engine uses (``RadixCache`` / ``HashBlockCache`` / ``NoPrefixCache``, a
``SlotAllocator`` of the given KV budget, the policies of
``radixkv.scheduling``); only the model's forward is replaced by a
``CostModel``. One step schedules as ``LLM.step`` does: running requests
first (a decode token each, or their prompt's next chunk), then waiting ones
in policy order (under the KV budget and ``max_running``), each chunk at most
``chunked_prefill_size`` tokens and the step at most ``max_batch_tokens``;
without those limits an admitted request is prefilled whole in one step.
Each finished chunk joins the cache, as in the engine. Consecutive steps with
nothing but decodes are taken in one stride. Unlike the engine, a request
reserves its whole KV (uncached prompt + output - 1 tokens, the last
generated token's KV is never computed) when admitted, so nothing is ever
preempted; on finishing it inserts prompt + output[:-1] into the cache and
unlocks its prefix. So with KV to spare the simulator's steps are the
engine's, token for token; under memory pressure it evicts earlier than the
engine, and hits can differ (``preemption=True`` allocates as the engine
does). A request is sent at its arrival, or ``think_time`` after its
``parent`` and every request of its ``after`` have finished.

The cache reads simulated time: before the replay its ``clock`` is set to the replica's simulated seconds,
whether the simulator built it or the caller handed it in (``cache=obj``), so time-aware eviction (``ttl``)
decides the same in both; each request's ``priority`` and ``ttl`` go with every cache call made for it
(``CacheHints``). ``SimResult.saved_prefill_s`` prices the hits in prefill seconds under the cost model.

``simulate`` is the cluster loop of ``radixkv.sim.cluster`` with one replica: the same code, so N = 1
there is this, request for request and step for step. Its settings are
one ``StackConfig`` (``radixkv.stack``; ``SIMULATOR_DEFAULTS`` unless ``config`` is given) with keyword
settings on top: ``simulate(reqs, cache="radix", page_size=512, capacity_tokens=N, eviction_policy="lru")``
is ``simulate(reqs, config=replace(SIMULATOR_DEFAULTS, prefix_cache="radix", page_size=512, ...))``.

``upper_bound`` gives the best hit rate any capacity and order could reach;
``eviction_policy="belady"`` gives the clairvoyant eviction reference at a
given capacity: it evicts the leaf whose next use, in arrival order, lies
farthest ahead. It knows the arrivals, not the order a reordering policy
serves them in: with ``lpm`` and large batches an online policy can beat it
by a few percent (docs/experiments.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from radixkv.bounds import upper_bound  # noqa: F401  (the simulator's reference, kept importable here)
from radixkv.cache.base import PrefixCache
from radixkv.cost import CostModel, StepRecord  # noqa: F401  (importable here too)
from radixkv.sim.cluster import checked_requests, sim_config, simulate_on
from radixkv.sim.replica import SimResult
from radixkv.stack import StackConfig
from radixkv.workloads.request import Request


def simulate(requests: Sequence[Request], config: StackConfig | str | PrefixCache | None = None, *,
             cost_model: CostModel | None = None, preemption: bool = False, **settings: Any) -> SimResult:
    """Replay ``requests`` through one cache under one KV budget; see the module doc.

    Args:
        config: the cache and scheduling settings (``StackConfig``; ``SIMULATOR_DEFAULTS`` when None). A cache
            name or object here is the ``cache`` setting (the old second argument).
        settings: fields of ``config`` by keyword, as the simulator always took them: ``cache`` (``radix``,
            ``hash``, ``hash-v0``, ``none`` or a ready ``PrefixCache``, used as it is), ``capacity_tokens``
            (the KV budget; None: unlimited), ``page_size`` / ``block_size`` (the allocator takes the cache's),
            ``eviction_policy`` (also ``belady``, radix only), ``schedule_policy`` (``random`` seeded by
            ``seed``), ``in_batch_sharing`` (a token threshold; None or 0: off; never with ``none``),
            ``max_batch_tokens`` / ``chunked_prefill_size`` (None: every admitted prompt prefilled whole in
            one step), ``max_running``, ``seed``.
        cost_model: seconds per step (``CostModel()`` when None).
        preemption: False: a request reserves its whole KV (uncached prompt + output - 1) when admitted and
            nothing is preempted. True: KV grows as in the engine, a chunk or a token at a time, and a request
            short of memory preempts the newest running one (``SimResult.preemptions``).
    """
    if isinstance(config, str | PrefixCache):
        config, settings = None, {"cache": config, **settings}
    requests = checked_requests(requests, preemption)
    stack_config, cache = sim_config(config, settings)
    return simulate_on(requests, stack_config, cost_model or CostModel(), preemption, cache)
