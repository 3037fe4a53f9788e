"""The eviction-policy suite (radixkv.cache.eviction): each rule on a hand-built case, bad parameters, and the
stateful machine of test_cache_stateful over every policy, radix and hash, with check_invariants after each step."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from radixkv.cache.base import NO_HINTS, CacheHints
from radixkv.cache.eviction import POLICIES, EvictionPolicy, make_policy
from radixkv.cache.factory import make_cache
from radixkv.cache.hash_block import HashBlockCache
from radixkv.cache.radix import RadixCache
from radixkv.stack import StackConfig
from tests.test_cache_stateful import make_machine

NEW = ("slru", "arc", "s3fifo", "priority", "ttl", "tlru", "cost", "learned")


def _ticking(cache):
    """A deterministic clock: 1 second per read."""
    cache.clock = itertools.count().__next__
    return cache


for _name in NEW:
    globals()[f"TestRadixPage2{_name.upper()}"] = make_machine(
        lambda n=_name: _ticking(RadixCache(page_size=2, eviction_policy=n)), 2).TestCase
    globals()[f"TestHashBlock2{_name.upper()}"] = make_machine(
        lambda n=_name: _ticking(HashBlockCache(block_size=2, eviction_policy=n)), 2).TestCase


def _serve(cache, tokens, slot0, hints=NO_HINTS):
    """Insert ``tokens`` as a finished request would (match, insert), unlocked; returns the next free slot."""
    cache.match_prefix(tokens, None, hints)
    cache.insert(tokens, np.arange(slot0, slot0 + len(tokens)), None, hints)
    return slot0 + len(tokens)


def _first_victim(cache) -> list[int]:
    return cache.evict(1).tolist()


@pytest.mark.parametrize("kind", ["radix", "hash"])
def test_priority_evicts_the_lower_priority_prefix_first(kind):
    cache = make_cache(kind, page_size=1, block_size=1, eviction_policy="priority")
    _serve(cache, [1, 2], 0, CacheHints(priority=5))
    _serve(cache, [3, 4], 10, CacheHints(priority=1))  # newer but lower
    assert set(_first_victim(cache)) <= {10, 11}  # the hash cache frees a block, the tree the whole leaf
    cache.check_invariants()


def test_priority_keeps_the_highest_priority_of_a_shared_prefix():
    cache = RadixCache(eviction_policy="priority")
    _serve(cache, [1, 2, 3], 0, CacheHints(priority=0))
    _serve(cache, [1, 2, 3], 0, CacheHints(priority=9))  # reused by an important request
    _serve(cache, [7, 8], 10, CacheHints(priority=3))
    assert cache.evict(2).tolist() == [10, 11]


@pytest.mark.parametrize("kind", ["radix", "hash"])
def test_ttl_holds_a_prefix_until_its_time_is_up(kind):
    now = [0.0]
    cache = make_cache(kind, page_size=1, block_size=1, eviction_policy="ttl", eviction_params={"ttl": 10})
    cache.clock = lambda: now[0]
    _serve(cache, [1], 0, CacheHints(ttl=100.0))  # an agent between tool calls: hold it long
    now[0] = 1.0
    _serve(cache, [2], 1)  # held 10 s
    now[0] = 20.0  # [2]'s hold lapsed, [1]'s did not: [2] goes first although [1] is older
    assert _first_victim(cache) == [1]
    assert _first_victim(cache) == [0]  # only held ones left: they go too, earliest hold end first
    cache.check_invariants()


def test_tlru_evicts_what_cannot_help_the_ttft_tail_first():
    # prefill budget 4 tokens, no next-prompt estimate: a conversation of L tokens needs L - 4 of them cached
    cache = RadixCache(eviction_policy=make_policy("tlru", threshold=4, next_prompt_estimate=0))
    _serve(cache, list(range(20, 36)), 100)  # 16 tokens in one leaf: it needs 12 cached, it is not TEL-safe
    _serve(cache, list(range(8)), 0)
    _serve(cache, list(range(12)), 0)  # 12 tokens: its tail [8..11] sits after 8 >= 12 - 4 cached ones
    assert cache.evict(4).tolist() == [8, 9, 10, 11]  # LRU would take the older 16-token leaf
    assert cache.evict(1).tolist() == list(range(100, 116))
    cache.check_invariants()


def test_tlru_with_sglang_defaults_is_lru():
    a, b = RadixCache(eviction_policy="lru"), RadixCache(eviction_policy=make_policy("tlru", threshold=0,
                                                                                      next_prompt_estimate=0))
    for cache in (a, b):
        _serve(cache, [1, 2, 3], 0)
        _serve(cache, [1, 2, 9], 10)
        _serve(cache, [5], 20)
    assert [a.evict(1).tolist() for _ in range(4)] == [b.evict(1).tolist() for _ in range(4)]


def test_cost_keeps_deep_entries_longer():
    cache = RadixCache(eviction_policy=make_policy("cost", prefill_per_token=1e-4, attention_per_pair=1e-6))
    _serve(cache, list(range(100)), 0)
    _serve(cache, [*range(100), 500], 0)  # one token after a 100-token prefix
    _serve(cache, [900], 200)  # one token with no prefix: cheaper to recompute
    assert _first_victim(cache) == [200]


def test_cost_inflation_ages_old_entries():
    policy = make_policy("cost")
    cache = RadixCache(eviction_policy=policy)
    _serve(cache, [1], 0)
    _serve(cache, [2], 1)
    cache.evict(1)
    assert policy.inflation > 0


@pytest.mark.parametrize("kind", ["radix", "hash"])
def test_arc_sends_a_ghost_back_to_the_frequency_list(kind):
    cache = make_cache(kind, page_size=1, block_size=1, eviction_policy="arc")
    policy = cache.policy
    _serve(cache, [1], 0, CacheHints(request="a"))
    cache.evict(1)
    assert policy.ghosts[0].tokens == 1
    _serve(cache, [1], 5, CacheHints(request="b"))  # seen again after its eviction: T2, and p grew
    assert policy.sizes == [0, 1] and policy.p > 0


@pytest.mark.parametrize("kind", ["radix", "hash"])
def test_reuse_is_counted_per_request_not_per_lookup(kind):
    cache = make_cache(kind, page_size=1, block_size=1, eviction_policy="arc")
    hints = CacheHints(request="a")
    _serve(cache, [1, 2], 0, hints)
    cache.match_prefix([1, 2], None, hints)  # the same request looks again
    assert cache.policy.sizes == [2, 0]
    cache.match_prefix([1, 2], None, CacheHints(request="b"))
    assert cache.policy.sizes == [0, 2]


def test_s3fifo_drops_one_hit_wonders_before_reused_entries():
    cache = RadixCache(eviction_policy=make_policy("s3fifo", small_ratio=0.5))
    _serve(cache, [1], 0, CacheHints(request="a"))
    cache.match_prefix([1], None, CacheHints(request="b"))  # reused: moves to the main queue at eviction
    _serve(cache, [2], 1, CacheHints(request="c"))
    _serve(cache, [3], 2, CacheHints(request="d"))
    assert [cache.evict(1).tolist() for _ in range(3)] == [[1], [2], [0]]
    cache.check_invariants()


@pytest.mark.parametrize("name, params", [
    ("slru", {"protected_threshold": 0}), ("s3fifo", {"small_ratio": 1.0}), ("ttl", {"ttl": -1}),
    ("ttl", {"ttl": float("nan")}), ("tlru", {"threshold": -1}), ("tlru", {"threshold": 1.5}),
    ("cost", {"prefill_per_token": 0, "attention_per_pair": 0}), ("cost", {"prefill_per_token": "1"}),
    ("lru", {"anything": 1}), ("ARC", {}), ("belady", {"x": 1}),
])
def test_bad_policy_names_and_parameters_are_value_errors(name, params):
    with pytest.raises(ValueError):
        make_policy(name, **params)
    with pytest.raises(ValueError):
        StackConfig(eviction_policy=name, eviction_params=params)


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_every_policy_builds_with_defaults_and_describes_itself(name):
    policy = make_policy(name)
    assert isinstance(policy, EvictionPolicy) and policy.describe()["name"] == name
    for kind in ("radix", "hash"):
        cache = make_cache(kind, eviction_policy=name)
        assert cache.eviction_policy == name


def test_a_policy_object_is_used_as_given():
    policy = make_policy("ttl", ttl=3)
    cache = RadixCache(eviction_policy=policy)
    assert cache.policy is policy and policy.cache is cache
    with pytest.raises(ValueError):
        make_policy(policy, ttl=4)


@pytest.mark.parametrize("kind", ["radix", "hash"])
def test_one_eviction_of_two_entries_is_two_evictions_of_one(kind):
    """A policy reading the cache's size while evict runs sees it shrink victim by victim (the tree once
    updated it only after the loop, so S3-FIFO's small-queue test saw a stale total)."""
    def run(chunks):
        cache = make_cache(kind, page_size=1, block_size=1, eviction_policy="s3fifo",
                           eviction_params={"small_ratio": 0.5})
        slot = 0
        for tokens in ([1], [2]):
            slot = _serve(cache, tokens * 10, slot)
        cache.evict(20)
        for tokens in ([1], [2], [3], [4], [5]):  # 1 and 2 come back as ghosts: main queue
            slot = _serve(cache, tokens * 10, slot)
        return sorted(np.concatenate([cache.evict(20 // chunks) for _ in range(chunks)]).tolist())
    assert run(1) == run(2)


def test_arc_grows_p_by_the_ghost_lists_before_the_hit_leaves_them():
    cache = RadixCache(eviction_policy="arc")
    policy = cache.policy
    policy.ghosts[0].add("a", 16, 10**6)  # B1
    policy.ghosts[1].add("b", 128, 10**6)  # B2
    policy._peak = 10**6
    cache.key_of = lambda entry: "a"  # the next insert is found in B1 (16 tokens; B2 holds 128)
    _serve(cache, list(range(16)), 0)
    assert policy.p == 16 * (128 / 16)


def test_a_policy_serves_one_cache():
    policy = make_policy("arc")
    RadixCache(eviction_policy=policy)
    with pytest.raises(ValueError, match="another cache"):
        RadixCache(eviction_policy=policy)


def test_a_host_tier_learns_from_the_requests_too():
    """The request's hints reach the lower tiers' policies: its writes (write_through) and its loads."""
    from radixkv.cache.tiered import Tier, TieredCache
    from radixkv.memory import SlotAllocator

    host = Tier("host", RadixCache(eviction_policy="arc"), SlotAllocator(64))
    cache = TieredCache(RadixCache(eviction_policy="arc"), [host], "write_through")
    tokens = list(range(8))
    cache.insert(tokens, np.arange(8), None, CacheHints(request="a"))
    assert host.cache.policy.sizes == [8, 0] and next(iter(host.cache._all_nodes())).user == "a"
    cache.evict(8)  # the device drops it; the host keeps it
    m = cache.match_prefix(tokens, None, CacheHints(request="b"))
    plan = cache.plan_load(tokens, m, None, CacheHints(request="b"))  # another request loads it: a reuse
    assert plan.length == 8 and host.cache.policy.sizes == [0, 8]
    cache.cancel(plan)
