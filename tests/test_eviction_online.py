"""Online means online: a cache built alone and handed to ``simulate`` decides exactly as one the simulator builds
from the same name, hit for hit, for every eviction policy. Nothing the simulator knows (the
arrivals, the future) reaches a policy but through the cache's own operations and clock.

Also: no policy leaks slots or locks at idle, under pressure, in the simulator and behind a host tier."""

from __future__ import annotations

import zlib

import pytest

from radixkv.cache.eviction import POLICIES
from radixkv.cache.factory import make_cache
from radixkv.sim import simulate
from radixkv.workloads.synthetic import multi_turn


def _workload():
    """Conversations with a shared system prompt, priorities and hold times varying by session."""
    requests = multi_turn(seed=3, sessions=24, turns=4, session_gap=0.5, think_time=1.0)
    for r in requests:
        r.priority = zlib.crc32(str(r.session).encode()) % 3  # stable across processes, unlike hash()
        r.ttl = 2.0 if zlib.crc32(str(r.session).encode()) % 2 else None
    return requests


def _capacity(requests) -> int:
    footprint = sum(len(r.prompt) + r.output_len for r in requests)
    return max(footprint // 6, max(len(r.prompt) + r.output_len for r in requests) + 64)


@pytest.mark.parametrize("kind, page", [("radix", 16), ("hash", 16)])
@pytest.mark.parametrize("name", sorted(POLICIES))
def test_a_cache_built_alone_decides_as_the_simulator_built_one(name, kind, page):
    requests = _workload()
    capacity = _capacity(requests)
    sizes = {"page_size": page} if kind == "radix" else {"block_size": page}
    alone = make_cache(kind, eviction_policy=name, **sizes)
    handed = simulate(requests, cache=alone, capacity_tokens=capacity)
    named = simulate(requests, cache=kind, eviction_policy=name, capacity_tokens=capacity, **sizes)
    assert named.evicted_tokens > 0, "the workload must put the cache under pressure"
    assert [r["hit"] for r in handed.per_request] == [r["hit"] for r in named.per_request]
    assert handed.hit_tokens == named.hit_tokens and handed.makespan == named.makespan


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_no_policy_leaks_at_idle_even_behind_a_host_tier(name):
    requests = _workload()
    capacity = _capacity(requests)
    for host in (None, 2 * capacity):
        result = simulate(requests, cache="radix", page_size=16, eviction_policy=name, capacity_tokens=capacity,
                          host_capacity_tokens=host)
        assert result.rejected == 0 and result.hit_tokens > 0
    cache = make_cache("hash", block_size=16, eviction_policy=name)
    simulate(requests, cache=cache, capacity_tokens=capacity)
    cache.check_invariants()
    assert cache.protected_size == 0
