"""Scenario and regression tests for ``RadixCache`` (the token-level radix prefix cache).

Every test drives the cache through its public API only (``match_prefix``, ``insert``,
``lock``/``unlock``, ``evict``, the size properties, ``to_dict``, ``check_invariants``)
and calls ``check_invariants()`` after the operations it performs.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from radixkv import LockError, MatchResult, OutOfSlotsError, PrefixCache, RadixCache, SlotAllocator
from radixkv.cache.eviction import POLICIES

POLICY_NAMES = ["lru", "lfu", "fifo", "mru", "filo"]


# --------------------------------------------------------------------------- helpers
def paths(cache: RadixCache, namespace=None) -> list[tuple[list[int], list[int]]]:
    """Every root-to-leaf path of ``to_dict`` as (tokens, indices), sorted."""
    out = []

    def walk(node, toks, idx):
        toks = toks + list(node["tokens"])
        idx = idx + list(node["indices"])
        if not node["children"]:
            if toks:
                out.append((toks, idx))
            return
        for child in node["children"]:
            walk(child, toks, idx)

    walk(cache.to_dict(namespace), [], [])
    return sorted(out)


def child_edges(node_dict) -> list[list[int]]:
    return sorted(c["tokens"] for c in node_dict["children"])


def all_tree_indices(cache: RadixCache, namespace=None) -> list[int]:
    out = []

    def walk(node):
        out.extend(node["indices"])
        for child in node["children"]:
            walk(child)

    walk(cache.to_dict(namespace))
    return sorted(out)


def lock_counts(cache: RadixCache, namespace=None) -> list[int]:
    out = []

    def walk(node):
        out.append(node["lock_count"])
        for child in node["children"]:
            walk(child)

    walk(cache.to_dict(namespace))
    return out


def evictable_leaves(cache: RadixCache, namespace=None) -> list[dict]:
    """The ``to_dict`` nodes that are unlocked leaves (the eviction candidates)."""
    out = []

    def walk(node, is_root):
        if not node["children"] and not is_root and node["lock_count"] == 0:
            out.append(node)
        for child in node["children"]:
            walk(child, False)

    walk(cache.to_dict(namespace), True)
    return out


def sizes(cache: RadixCache) -> tuple[int, int, int]:
    return cache.total_size, cache.evictable_size, cache.protected_size


def check(cache: RadixCache) -> None:
    cache.check_invariants()
    assert cache.total_size == cache.evictable_size + cache.protected_size
    assert cache.evictable_size >= 0 and cache.protected_size >= 0
    assert all(c >= 0 for c in lock_counts(cache))


def assert_match(cache, tokens, length, indices, namespace=None) -> MatchResult:
    m = cache.match_prefix(tokens, namespace=namespace)
    assert isinstance(m, MatchResult)
    assert m.length == length
    assert isinstance(m.indices, np.ndarray)
    assert m.indices.dtype == np.int64 and m.indices.ndim == 1
    assert m.indices.tolist() == list(indices)
    assert m.node is not None
    check(cache)
    return m


# --------------------------------------------------------------------------- basics
def test_is_a_prefix_cache():
    assert isinstance(RadixCache(), PrefixCache)


def test_empty_cache():
    cache = RadixCache()
    assert sizes(cache) == (0, 0, 0)
    m = assert_match(cache, [1, 2, 3], 0, [])
    # the root: locking it changes nothing
    cache.lock(m.node)
    assert sizes(cache) == (0, 0, 0)
    cache.unlock(m.node)
    check(cache)


def test_docstring_example():
    cache = RadixCache()
    assert cache.insert([1, 2, 3, 4, 5], [10, 11, 12, 13, 14]) == 0
    assert cache.insert([1, 2, 3, 9], [20, 21, 22, 23]) == 3
    assert_match(cache, [1, 2, 3, 4, 7], 4, [10, 11, 12, 13])
    assert cache.total_size == 6


def test_split_on_insert():
    cache = RadixCache()
    assert cache.insert([1, 2, 3, 4, 5], [10, 11, 12, 13, 14]) == 0
    check(cache)
    assert cache.insert([1, 2, 3, 9], [20, 21, 22, 23]) == 3
    check(cache)
    root = cache.to_dict()
    assert [c["tokens"] for c in root["children"]] == [[1, 2, 3]]
    mid = root["children"][0]
    assert mid["indices"] == [10, 11, 12]
    assert child_edges(mid) == [[4, 5], [9]]
    by_tokens = {tuple(c["tokens"]): c for c in mid["children"]}
    assert by_tokens[(4, 5)]["indices"] == [13, 14]
    assert by_tokens[(9,)]["indices"] == [23]
    assert by_tokens[(4, 5)]["children"] == [] and by_tokens[(9,)]["children"] == []
    assert sizes(cache) == (6, 6, 0)
    assert paths(cache) == [([1, 2, 3, 4, 5], [10, 11, 12, 13, 14]), ([1, 2, 3, 9], [10, 11, 12, 23])]
    assert_match(cache, [1, 2, 3, 9, 9], 4, [10, 11, 12, 23])
    assert_match(cache, [1, 2, 3, 4, 5], 5, [10, 11, 12, 13, 14])


def test_split_on_match_leaves_data_unchanged():
    cache = RadixCache()
    cache.insert([1, 2, 3, 4, 5, 6], [10, 11, 12, 13, 14, 15])
    cache.insert([7, 8, 9], [20, 21, 22])
    before = paths(cache)
    total = cache.total_size
    # ends inside the edge [1..6]
    m = assert_match(cache, [1, 2, 3, 0], 3, [10, 11, 12])
    assert paths(cache) == before
    assert cache.total_size == total
    root = cache.to_dict()
    by_first = {c["tokens"][0]: c for c in root["children"]}
    assert by_first[1]["tokens"] == [1, 2, 3]
    assert child_edges(by_first[1]) == [[4, 5, 6]]
    # the returned node ends exactly at the match length: locking it protects 3 tokens
    cache.lock(m.node)
    assert sizes(cache) == (9, 6, 3)
    check(cache)
    cache.unlock(m.node)
    assert sizes(cache) == (9, 9, 0)
    # a query that is a strict prefix of an edge also splits, data still unchanged
    m2 = assert_match(cache, [7, 8], 2, [20, 21])
    assert paths(cache) == before
    cache.lock(m2.node)
    assert cache.protected_size == 2
    cache.unlock(m2.node)
    check(cache)


def test_query_longer_than_stored():
    cache = RadixCache()
    cache.insert([1, 2, 3], [5, 6, 7])
    m = assert_match(cache, [1, 2, 3, 4, 5, 6], 3, [5, 6, 7])
    assert cache.total_size == 3
    assert paths(cache) == [([1, 2, 3], [5, 6, 7])]
    cache.lock(m.node)
    assert sizes(cache) == (3, 0, 3)
    cache.unlock(m.node)
    check(cache)


def test_no_match_returns_root_handle():
    cache = RadixCache()
    cache.insert([1, 2, 3], [5, 6, 7])
    m = assert_match(cache, [2, 3], 0, [])
    cache.lock(m.node)
    assert sizes(cache) == (3, 3, 0)
    cache.unlock(m.node)
    assert_match(cache, [], 0, [])
    check(cache)


def test_namespaces_isolated_with_shared_capacity():
    cache = RadixCache()
    assert cache.insert([1, 2, 3], [0, 1, 2], namespace="a") == 0
    assert cache.insert([1, 2, 3], [10, 11, 12], namespace="b") == 0  # no sharing across namespaces
    check(cache)
    assert cache.total_size == 6
    assert_match(cache, [1, 2, 3], 3, [0, 1, 2], namespace="a")
    assert_match(cache, [1, 2, 3], 3, [10, 11, 12], namespace="b")
    assert_match(cache, [1, 2, 3], 0, [])  # the default namespace is a third one
    assert_match(cache, [1, 2, 3], 0, [], namespace="never-used")
    assert paths(cache, "a") == [([1, 2, 3], [0, 1, 2])]
    assert paths(cache, "b") == [([1, 2, 3], [10, 11, 12])]
    assert paths(cache) == []
    # a split in one namespace does not touch the other
    assert cache.insert([1, 2, 9], [3, 4, 5], namespace="a") == 2
    assert paths(cache, "b") == [([1, 2, 3], [10, 11, 12])]
    assert cache.total_size == 7
    # shared capacity: one evict call frees from both namespaces
    freed = cache.evict(100)
    assert sorted(freed.tolist()) == [0, 1, 2, 5, 10, 11, 12]
    assert sizes(cache) == (0, 0, 0)
    check(cache)


def test_namespaces_share_eviction_order():
    cache = RadixCache(eviction_policy="lru")
    cache.insert([1, 2], [0, 1], namespace="a")
    cache.insert([1, 2], [10, 11], namespace=("tenant", 7))
    cache.insert([5], [20])
    # the least recently used leaf is in namespace "a"; then ("tenant", 7); then the default one
    assert cache.evict(1).tolist() == [0, 1]
    assert cache.evict(1).tolist() == [10, 11]
    assert cache.evict(1).tolist() == [20]
    check(cache)


def test_namespace_lock_is_per_namespace():
    cache = RadixCache()
    cache.insert([1, 2, 3], [0, 1, 2], namespace="a")
    cache.insert([1, 2, 3], [10, 11, 12], namespace="b")
    m = cache.match_prefix([1, 2, 3], namespace="a")
    cache.lock(m.node)
    assert sizes(cache) == (6, 3, 3)
    assert sorted(cache.evict(100).tolist()) == [10, 11, 12]
    assert_match(cache, [1, 2, 3], 3, [0, 1, 2], namespace="a")
    cache.unlock(m.node)
    check(cache)


def test_page_size_4_rounds_down():
    cache = RadixCache(page_size=4)
    toks = list(range(100, 110))
    assert cache.insert(toks, list(range(10))) == 0
    check(cache)
    assert cache.total_size == 8
    assert paths(cache) == [(toks[:8], list(range(8)))]
    assert_match(cache, toks[:7], 4, [0, 1, 2, 3])
    m = assert_match(cache, toks[:3], 0, [])
    cache.lock(m.node)  # the root
    assert cache.protected_size == 0
    assert_match(cache, toks, 8, list(range(8)))
    # a second insert of the same 10 tokens finds the 8 stored ones
    assert cache.insert(toks, list(range(50, 60))) == 8
    assert cache.total_size == 8
    assert paths(cache) == [(toks[:8], list(range(8)))]
    # match lengths are multiples of the page size
    for n in range(11):
        assert cache.match_prefix(toks[:n]).length == (n // 4) * 4
    check(cache)


def test_page_size_match_ending_inside_a_page_rounds_down():
    cache = RadixCache(page_size=4)
    cache.insert(list(range(12)), list(range(12)))
    # differs at token 6 (inside the second page): only the first page matches
    q = [0, 1, 2, 3, 4, 5, 99, 7, 8, 9, 10, 11]
    m = assert_match(cache, q, 4, [0, 1, 2, 3])
    cache.lock(m.node)
    assert sizes(cache) == (12, 8, 4)
    cache.unlock(m.node)
    assert paths(cache) == [(list(range(12)), list(range(12)))]
    check(cache)


def test_siblings_sharing_a_first_token_under_paging():
    cache = RadixCache(page_size=4)
    a = [1, 2, 3, 4, 5, 6, 7, 8]
    b = [1, 2, 3, 4, 5, 9, 9, 9]
    assert cache.insert(a, list(range(8))) == 0
    assert cache.insert(b, list(range(100, 108))) == 4
    check(cache)
    root = cache.to_dict()
    assert [c["tokens"] for c in root["children"]] == [[1, 2, 3, 4]]
    mid = root["children"][0]
    assert mid["indices"] == [0, 1, 2, 3]
    assert child_edges(mid) == [[5, 6, 7, 8], [5, 9, 9, 9]]
    assert cache.total_size == 12
    assert_match(cache, a, 8, list(range(8)))
    assert_match(cache, b, 8, [0, 1, 2, 3, 104, 105, 106, 107])
    assert_match(cache, [1, 2, 3, 4, 5, 6, 7, 0], 4, [0, 1, 2, 3])
    assert_match(cache, [1, 2, 3, 4, 5, 9, 9, 0], 4, [0, 1, 2, 3])
    assert cache.total_size == 12
    # each sibling is evicted on its own
    freed = cache.evict(4)
    assert len(freed) == 4
    assert cache.total_size == 8
    check(cache)


def test_page_size_2_lengths_and_edges_page_aligned():
    cache = RadixCache(page_size=2)
    assert cache.insert([1, 2, 3, 4, 5], [0, 1, 2, 3, 4]) == 0
    assert cache.total_size == 4
    assert cache.insert([1, 2, 3, 9, 9, 9], [10, 11, 12, 13, 14, 15]) == 2
    check(cache)
    for toks, _ in paths(cache):
        assert len(toks) % 2 == 0
    root = cache.to_dict()

    def walk(node):
        assert len(node["tokens"]) % 2 == 0
        for c in node["children"]:
            walk(c)

    walk(root)
    assert cache.total_size == 8


# --------------------------------------------------------------------------- locking
def test_lock_protects_the_whole_path():
    cache = RadixCache()
    cache.insert([1, 2, 3, 4], [0, 1, 2, 3])
    cache.insert([1, 2, 5], [10, 11, 12])
    m = assert_match(cache, [1, 2, 3, 4], 4, [0, 1, 2, 3])
    cache.lock(m.node)
    assert sizes(cache) == (5, 1, 4)
    check(cache)
    m2 = cache.match_prefix([1, 2, 5])
    cache.lock(m2.node)
    assert sizes(cache) == (5, 0, 5)
    check(cache)
    cache.unlock(m.node)
    assert sizes(cache) == (5, 2, 3)  # [1,2] is still held by the second lock
    check(cache)
    cache.unlock(m2.node)
    assert sizes(cache) == (5, 5, 0)
    check(cache)


def test_lock_is_a_reference_count():
    cache = RadixCache()
    cache.insert([1, 2, 3], [0, 1, 2])
    m = cache.match_prefix([1, 2, 3])
    cache.lock(m.node)
    cache.lock(m.node)
    assert cache.protected_size == 3
    cache.unlock(m.node)
    assert cache.protected_size == 3
    assert cache.evict(100).size == 0
    cache.unlock(m.node)
    assert cache.protected_size == 0
    check(cache)
    assert sorted(cache.evict(100).tolist()) == [0, 1, 2]
    check(cache)


def test_lock_accounting_across_a_split():
    cache = RadixCache()
    cache.insert([1, 2, 3, 4, 5], [10, 11, 12, 13, 14])
    m = cache.match_prefix([1, 2, 3, 4, 5])
    cache.lock(m.node)
    assert sizes(cache) == (5, 0, 5)
    # another request splits the locked leaf's edge
    assert cache.insert([1, 2, 3, 9], [20, 21, 22, 23]) == 3
    check(cache)
    assert sizes(cache) == (6, 1, 5)
    mid = cache.to_dict()["children"][0]
    assert mid["tokens"] == [1, 2, 3] and mid["lock_count"] == 1
    by_tokens = {tuple(c["tokens"]): c for c in mid["children"]}
    assert by_tokens[(4, 5)]["lock_count"] == 1
    assert by_tokens[(9,)]["lock_count"] == 0
    # only the unlocked sibling can go
    assert cache.evict(100).tolist() == [23]
    check(cache)
    # the old handle still ends at the same token: unlocking releases all 5 tokens
    cache.unlock(m.node)
    assert sizes(cache) == (5, 5, 0)
    check(cache)
    assert lock_counts(cache) == [0, 0, 0]
    with pytest.raises(LockError):
        cache.unlock(m.node)
    assert sizes(cache) == (5, 5, 0)
    check(cache)
    assert sorted(cache.evict(100).tolist()) == [10, 11, 12, 13, 14]
    check(cache)


def test_lock_accounting_across_a_split_by_match():
    cache = RadixCache()
    cache.insert([1, 2, 3, 4, 5, 6], [0, 1, 2, 3, 4, 5])
    full = cache.match_prefix([1, 2, 3, 4, 5, 6])
    cache.lock(full.node)
    part = assert_match(cache, [1, 2, 3, 0], 3, [0, 1, 2])  # splits a locked edge
    cache.lock(part.node)
    assert sizes(cache) == (6, 0, 6)
    cache.unlock(full.node)
    assert sizes(cache) == (6, 3, 3)
    check(cache)
    assert sorted(cache.evict(100).tolist()) == [3, 4, 5]
    check(cache)
    cache.unlock(part.node)
    assert sizes(cache) == (3, 3, 0)
    check(cache)


def test_unlock_at_zero_raises_and_changes_nothing():
    cache = RadixCache()
    cache.insert([1, 2, 3], [0, 1, 2])
    cache.insert([1, 4], [10, 11])
    m = cache.match_prefix([1, 2, 3])
    before = (sizes(cache), paths(cache), lock_counts(cache))
    with pytest.raises(LockError):
        cache.unlock(m.node)
    assert (sizes(cache), paths(cache), lock_counts(cache)) == before
    check(cache)
    # LockError is both a RuntimeError and a ValueError
    assert issubclass(LockError, RuntimeError) and issubclass(LockError, ValueError)
    with pytest.raises(RuntimeError):
        cache.unlock(m.node)
    with pytest.raises(ValueError):
        cache.unlock(m.node)
    check(cache)


def test_unlock_of_a_node_whose_ancestor_is_still_locked_by_another_request_raises():
    cache = RadixCache()
    cache.insert([1, 2, 3, 4], [0, 1, 2, 3])
    upper = cache.match_prefix([1, 2])
    cache.lock(upper.node)
    lower = cache.match_prefix([1, 2, 3, 4])
    with pytest.raises(LockError):
        cache.unlock(lower.node)  # the leaf itself was never locked
    assert sizes(cache) == (4, 2, 2)
    assert sorted(lock_counts(cache)) == [0, 0, 1]
    cache.unlock(upper.node)
    check(cache)


def test_root_lock_unlock_is_a_noop():
    cache = RadixCache()
    cache.insert([1, 2, 3], [0, 1, 2])
    root = cache.match_prefix([9]).node
    before = (sizes(cache), paths(cache), lock_counts(cache))
    for _ in range(3):
        cache.lock(root)
    assert (sizes(cache), paths(cache), lock_counts(cache)) == before
    for _ in range(5):  # more unlocks than locks: still nothing, no error
        cache.unlock(root)
    assert (sizes(cache), paths(cache), lock_counts(cache)) == before
    # the root of a namespace as well
    cache.insert([1], [7], namespace="ns")
    ns_root = cache.match_prefix([2], namespace="ns").node
    cache.lock(ns_root)
    cache.unlock(ns_root)
    cache.unlock(ns_root)
    assert sizes(cache) == (4, 4, 0)
    check(cache)
    assert sorted(cache.evict(100).tolist()) == [0, 1, 2, 7]
    check(cache)


# --------------------------------------------------------------------------- eviction
def test_evict_on_empty_tree_returns_empty_int64_array():
    cache = RadixCache()
    freed = cache.evict(10)
    assert isinstance(freed, np.ndarray)
    assert freed.dtype == np.int64 and freed.ndim == 1 and freed.size == 0
    check(cache)


def test_evict_zero_frees_nothing():
    cache = RadixCache()
    cache.insert([1, 2], [0, 1])
    freed = cache.evict(0)
    assert freed.dtype == np.int64 and freed.size == 0
    assert cache.total_size == 2
    check(cache)


def test_evict_removes_whole_leaves_and_returns_int64():
    cache = RadixCache()
    cache.insert([1, 2, 3, 4, 5], [0, 1, 2, 3, 4])
    freed = cache.evict(1)  # a whole leaf, even though only 1 token was asked for
    assert freed.dtype == np.int64 and freed.ndim == 1
    assert sorted(freed.tolist()) == [0, 1, 2, 3, 4]
    assert sizes(cache) == (0, 0, 0)
    check(cache)


def test_lru_order_refreshed_by_matches():
    cache = RadixCache(eviction_policy="lru")
    cache.insert([1, 1], [0, 1])
    cache.insert([2, 2], [2, 3])
    cache.insert([3, 3], [4, 5])
    # without matches the oldest insert goes first; a match makes [1, 1] the newest
    assert_match(cache, [1, 1], 2, [0, 1])
    assert cache.evict(1).tolist() == [2, 3]
    assert cache.evict(1).tolist() == [4, 5]
    assert cache.evict(1).tolist() == [0, 1]
    check(cache)


def test_lru_match_refreshes_the_whole_path():
    cache = RadixCache(eviction_policy="lru")
    cache.insert([1, 2, 3], [0, 1, 2])
    cache.insert([1, 2, 4], [3, 4, 5])  # [1,2] -> [3], [4]
    cache.insert([7], [6])
    cache.match_prefix([1, 2])  # refreshes [1,2] only, not its children
    d = cache.to_dict()
    by_first = {c["tokens"][0]: c for c in d["children"]}
    seven = by_first[7]
    mid = by_first[1]
    assert mid["last_access"] > seven["last_access"]
    assert mid["hit_count"] == 1
    for c in mid["children"]:
        assert c["last_access"] < mid["last_access"]
        assert c["hit_count"] == 0
    # a full match refreshes and counts every node on the path
    cache.match_prefix([1, 2, 3])
    d = cache.to_dict()
    mid = {c["tokens"][0]: c for c in d["children"]}[1]
    leaf3 = {c["tokens"][0]: c for c in mid["children"]}[3]
    assert mid["hit_count"] == 2 and leaf3["hit_count"] == 1
    assert mid["last_access"] == leaf3["last_access"]
    assert cache.evict(1).tolist() == [2 + 3]  # leaf [4] is now the least recently used
    check(cache)


def _policy_scenario(policy: str) -> list[int]:
    """Five single-token leaves A..E (slots 0..4) with a history where every policy
    picks a different victim first; returns the full eviction order as slots.

    created:      A < B < C < D < E
    after the matches below:  hits A2 B2 C2 D1 E2; last access B < D < A < E < C
    """
    cache = RadixCache(eviction_policy=policy)
    for slot, tok in enumerate([10, 11, 12, 13, 14]):
        cache.insert([tok], [slot])
    for tok in [11, 11, 13, 10, 10, 14, 14, 12, 12]:
        cache.match_prefix([tok])
    check(cache)
    order = []
    for _ in range(5):
        freed = cache.evict(1)
        assert len(freed) == 1
        order.append(int(freed[0]))
        check(cache)
    assert cache.total_size == 0
    return order


@pytest.mark.parametrize(
    "policy, expected",
    [
        ("lru", [1, 3, 0, 4, 2]),  # least recently used: B D A E C
        ("lfu", [3, 1, 0, 4, 2]),  # fewest hits (D), then ties by recency: B A E C
        ("fifo", [0, 1, 2, 3, 4]),  # oldest created first
        ("mru", [2, 4, 0, 3, 1]),  # most recently used first
        ("filo", [4, 3, 2, 1, 0]),  # newest created first
    ],
)
def test_each_policy_changes_eviction_order(policy, expected):
    assert _policy_scenario(policy) == expected


def test_classical_policies_pick_different_first_victims():
    firsts = {p: _policy_scenario(p)[0] for p in POLICY_NAMES}
    assert len(set(firsts.values())) == len(POLICY_NAMES), firsts
    assert set(POLICY_NAMES) <= set(POLICIES)


def test_lfu_ties_broken_by_recency():
    cache = RadixCache(eviction_policy="lfu")
    cache.insert([1], [0])
    cache.insert([2], [1])
    cache.insert([3], [2])
    cache.match_prefix([1])
    cache.match_prefix([3])
    cache.match_prefix([2])  # all one hit; [1] least recently used
    assert cache.evict(1).tolist() == [0]
    cache.match_prefix([2])  # [2] now has 2 hits, [3] 1
    assert cache.evict(1).tolist() == [2]
    assert cache.evict(1).tolist() == [1]
    check(cache)


def test_fifo_ignores_matches_and_mru_follows_them():
    fifo = RadixCache(eviction_policy="fifo")
    mru = RadixCache(eviction_policy="mru")
    for cache in (fifo, mru):
        cache.insert([1], [0])
        cache.insert([2], [1])
        cache.match_prefix([1])
    assert fifo.evict(1).tolist() == [0]
    assert mru.evict(1).tolist() == [0]
    for cache in (fifo, mru):
        cache.match_prefix([2])
        cache.insert([3], [2])
    assert fifo.evict(1).tolist() == [1]
    assert mru.evict(1).tolist() == [2]  # the insert counts as a use
    check(fifo)
    check(mru)


def test_lfu_split_keeps_hit_counts():
    cache = RadixCache(eviction_policy="lfu")
    cache.insert([1, 2, 3, 4], [0, 1, 2, 3])
    cache.match_prefix([1, 2, 3, 4])  # 1 hit
    cache.insert([7], [4])
    cache.match_prefix([1, 2, 9])  # splits [1,2] | [3,4]; [1,2] now has 2 hits, [3,4] keeps 1
    cache.match_prefix([7])  # 1 hit, more recent than everything else
    d = cache.to_dict()
    upper = {c["tokens"][0]: c for c in d["children"]}[1]
    assert upper["tokens"] == [1, 2] and upper["hit_count"] == 2
    assert upper["children"][0]["hit_count"] == 1
    assert cache.evict(1).tolist() == [2, 3]  # (1 hit, oldest)
    assert cache.evict(1).tolist() == [4]  # 1 hit beats [1,2]'s 2 hits
    assert cache.evict(1).tolist() == [0, 1]
    check(cache)


@given(
    policy=st.sampled_from(["lru", "lfu", "mru"]),
    page_size=st.sampled_from([1, 2]),
    ops=st.lists(
        st.tuples(
            st.sampled_from(["insert", "match", "lock", "evict"]),
            st.lists(st.integers(0, 1), max_size=5),  # tiny alphabet: repeats and splits are common
        ),
        max_size=30,
    ),
)
# a fully cached insert refreshes the leaf's recorded access time: eviction must follow it
@example(policy="lru", page_size=1, ops=[("insert", [0]), ("insert", [1]), ("insert", [0]), ("evict", [])])
def test_eviction_follows_policy_on_recorded_stats(policy, page_size, ops):
    """Whatever access times and hit counts the cache records (as shown by ``to_dict``),
    ``evict`` must take an unlocked leaf whose policy priority is the smallest."""
    priority = {
        "lru": lambda n: (n["last_access"],),
        "lfu": lambda n: (n["hit_count"], n["last_access"]),
        "mru": lambda n: (-n["last_access"],),
    }[policy]
    cache = RadixCache(page_size=page_size, eviction_policy=policy)
    next_slot = 0
    locked = []
    for op, toks in ops:
        if op == "insert":
            cache.insert(toks, list(range(next_slot, next_slot + len(toks))))
            next_slot += len(toks)
        elif op == "match":
            cache.match_prefix(toks)
        elif op == "lock":
            if locked and len(toks) % 2:
                cache.unlock(locked.pop())
            else:
                m = cache.match_prefix(toks)
                cache.lock(m.node)
                locked.append(m.node)
        else:
            leaves = evictable_leaves(cache)
            freed = cache.evict(1)
            if not leaves:
                assert freed.size == 0
                continue
            victim = [n for n in leaves if sorted(n["indices"]) == sorted(freed.tolist())]
            assert len(victim) == 1, "evict(1) must remove exactly one evictable leaf"
            assert priority(victim[0]) == min(priority(n) for n in leaves), (policy, victim, leaves)
        cache.check_invariants()
    for node in locked:
        cache.unlock(node)
    cache.check_invariants()


def test_cascading_eviction():
    cache = RadixCache()
    cache.insert([1, 2, 3], [0, 1, 2])
    assert cache.insert([1, 2, 4], [3, 4, 5]) == 2  # [1,2] -> [3], [4]; keeps slot 5 only
    cache.insert([9, 9], [6, 7])
    cache.match_prefix([9, 9])  # newest, so the [1,2] subtree goes first under lru
    freed = cache.evict(4)  # both leaves (2 tokens) and then their parent (2 more)
    assert sorted(freed.tolist()) == [0, 1, 2, 5]
    assert cache.total_size == 2
    assert paths(cache) == [([9, 9], [6, 7])]
    check(cache)


def test_cascading_eviction_deep_chain():
    cache = RadixCache()
    # a chain of single-token nodes with a side leaf at every level
    for depth in range(1, 6):
        cache.insert(list(range(depth)) + [100 + depth], list(range(10 * depth, 10 * depth + depth + 1)))
    check(cache)
    total = cache.total_size
    freed = cache.evict(10**9)
    assert len(freed) == total
    assert len(set(freed.tolist())) == total
    assert sizes(cache) == (0, 0, 0)
    check(cache)


def test_parent_becomes_leaf_then_evictable_later():
    cache = RadixCache()
    cache.insert([1, 2, 3], [0, 1, 2])
    cache.insert([1, 2, 4], [3, 4, 5])
    cache.insert([8], [6])
    cache.match_prefix([8])
    assert sorted(cache.evict(1).tolist()) in ([2], [5])
    assert sorted(cache.evict(1).tolist()) in ([2], [5])
    assert sorted(cache.evict(1).tolist()) == [0, 1]  # the parent is now a leaf and the oldest
    assert cache.evict(1).tolist() == [6]
    check(cache)


def test_locked_path_survives_huge_evict():
    cache = RadixCache()
    cache.insert([1, 2, 3, 4], [0, 1, 2, 3])
    cache.insert([1, 2, 5, 6], [10, 11, 12, 13])
    cache.insert([7, 8], [20, 21])
    m = cache.match_prefix([1, 2, 3, 4])
    cache.lock(m.node)
    freed = cache.evict(10**9)
    assert sorted(freed.tolist()) == [12, 13, 20, 21]
    assert sizes(cache) == (4, 0, 4)
    check(cache)
    assert paths(cache) == [([1, 2, 3, 4], [0, 1, 2, 3])]
    assert cache.evict(10**9).size == 0
    assert_match(cache, [1, 2, 3, 4, 5], 4, [0, 1, 2, 3])
    cache.unlock(m.node)
    assert sizes(cache) == (4, 4, 0)
    assert sorted(cache.evict(10**9).tolist()) == [0, 1, 2, 3]
    check(cache)


def test_locked_inner_node_children_evictable_then_node_after_unlock():
    cache = RadixCache()
    cache.insert([1, 2, 3], [0, 1, 2])
    m = cache.match_prefix([1, 2])  # splits [1,2] | [3]
    cache.lock(m.node)
    assert cache.evict(100).tolist() == [2]
    assert sizes(cache) == (2, 0, 2)
    check(cache)
    cache.unlock(m.node)  # now an unlocked leaf: must be evictable
    assert sizes(cache) == (2, 2, 0)
    check(cache)
    assert sorted(cache.evict(100).tolist()) == [0, 1]
    check(cache)


def test_evict_stops_when_enough_freed():
    cache = RadixCache()
    for i in range(5):
        cache.insert([i, i], [2 * i, 2 * i + 1])
    freed = cache.evict(3)  # two leaves of 2 tokens
    assert len(freed) == 4
    assert cache.total_size == 6
    check(cache)


def test_evicted_handle_cannot_be_locked():
    cache = RadixCache()
    cache.insert([1, 2], [0, 1])
    m = cache.match_prefix([1, 2])
    cache.evict(10)
    with pytest.raises(LockError):
        cache.lock(m.node)
    assert sizes(cache) == (0, 0, 0)
    check(cache)


# --------------------------------------------------------------------------- insert semantics
def test_duplicate_rule():
    cache = RadixCache()
    assert cache.insert([1, 2, 3, 4], [0, 1, 2, 3]) == 0
    # request B computed the same prefix itself (matched nothing) plus 2 new tokens
    b_tokens = [1, 2, 3, 4, 5, 6]
    b_indices = np.array([10, 11, 12, 13, 14, 15], dtype=np.int64)
    already = 0
    returned = cache.insert(b_tokens, b_indices)
    assert returned == 4
    duplicates = b_indices[already:returned]
    assert duplicates.tolist() == [10, 11, 12, 13]
    check(cache)
    # the tree keeps the original values and takes only the new tail
    assert_match(cache, b_tokens, 6, [0, 1, 2, 3, 14, 15])
    assert all_tree_indices(cache) == [0, 1, 2, 3, 14, 15]
    assert not set(duplicates.tolist()) & set(all_tree_indices(cache))
    # a fully cached insert takes nothing
    assert cache.insert([1, 2, 3], [20, 21, 22]) == 3
    assert all_tree_indices(cache) == [0, 1, 2, 3, 14, 15]
    assert cache.total_size == 6
    check(cache)


def test_duplicate_rule_with_partial_own_match():
    cache = RadixCache()
    cache.insert([1, 2], [0, 1])
    m = cache.match_prefix([1, 2, 3, 4, 5])  # the request matched 2 tokens
    cache.lock(m.node)
    # meanwhile another request inserts a longer prefix
    cache.insert([1, 2, 3, 4], [30, 31, 32, 33])
    idx = list(m.indices) + [40, 41, 42]
    returned = cache.insert([1, 2, 3, 4, 5], idx)
    assert returned == 4
    assert idx[m.length : returned] == [40, 41]  # the caller's duplicates
    assert_match(cache, [1, 2, 3, 4, 5], 5, [0, 1, 32, 33, 42])
    cache.unlock(m.node)
    check(cache)


def test_insert_empty_and_short_sequences():
    cache = RadixCache()
    assert cache.insert([], []) == 0
    assert cache.total_size == 0
    cache2 = RadixCache(page_size=4)
    assert cache2.insert([1, 2, 3], [0, 1, 2]) == 0  # less than a page: stores nothing
    assert cache2.total_size == 0
    check(cache)
    check(cache2)


def test_insert_returns_cached_prefix_length_for_prefix_of_edge():
    cache = RadixCache()
    cache.insert([1, 2, 3, 4], [0, 1, 2, 3])
    assert cache.insert([1, 2], [9, 9]) == 2
    assert cache.total_size == 4
    assert paths(cache) == [([1, 2, 3, 4], [0, 1, 2, 3])]
    check(cache)


def test_mismatched_lengths_raise():
    cache = RadixCache()
    with pytest.raises(ValueError):
        cache.insert([1, 2, 3], [0, 1])
    with pytest.raises(ValueError):
        cache.insert([1, 2], [0, 1, 2])
    paged = RadixCache(page_size=4)
    with pytest.raises(ValueError):  # the check is on the full lengths, not the stored part
        paged.insert([1, 2, 3, 4, 5], [0, 1, 2, 3])
    assert cache.total_size == 0 and paged.total_size == 0
    check(cache)
    check(paged)


def _token_variants(values):
    return {
        "list": list(values),
        "tuple": tuple(values),
        "np_int64": np.array(values, dtype=np.int64),
        "np_int32": np.array(values, dtype=np.int32),
        "np_noncontiguous": np.array([v for x in values for v in (x, -1)], dtype=np.int64)[::2],
        "torch_int64": torch.tensor(values, dtype=torch.int64),
        "torch_int32": torch.tensor(values, dtype=torch.int32),
    }


def _snapshot(obj):
    if isinstance(obj, torch.Tensor):
        return ("torch", obj.dtype, obj.clone())
    if isinstance(obj, np.ndarray):
        return ("np", obj.dtype, obj.copy())
    return (type(obj).__name__, None, copy.deepcopy(obj))


def _same(obj, snap):
    kind, dtype, data = snap
    if kind == "torch":
        return obj.dtype == dtype and torch.equal(obj, data)
    if kind == "np":
        return obj.dtype == dtype and np.array_equal(obj, data)
    return type(obj).__name__ == kind and obj == data


@pytest.mark.parametrize("page_size", [1, 2])
def test_input_types_give_same_results_and_are_not_modified(page_size):
    tok_a = [5, 6, 7, 8, 9, 10]
    idx_a = [0, 1, 2, 3, 4, 5]
    tok_b = [5, 6, 7, 1, 2]
    idx_b = [10, 11, 12, 13, 14]
    query = [5, 6, 7, 1, 2, 3]
    reference = None
    for name in _token_variants([0]):
        cache = RadixCache(page_size=page_size)
        ta, ia = _token_variants(tok_a)[name], _token_variants(idx_a)[name]
        tb, ib = _token_variants(tok_b)[name], _token_variants(idx_b)[name]
        q = _token_variants(query)[name]
        snaps = [_snapshot(x) for x in (ta, ia, tb, ib, q)]
        r1 = cache.insert(ta, ia)
        r2 = cache.insert(tb, ib)
        m = cache.match_prefix(q)
        check(cache)
        for obj, snap in zip((ta, ia, tb, ib, q), snaps, strict=True):
            assert _same(obj, snap), f"{name}: caller's object was modified"
        result = (r1, r2, m.length, m.indices.tolist(), paths(cache), sizes(cache))
        assert m.indices.dtype == np.int64
        if reference is None:
            reference = result
        assert result == reference, name


def test_match_accepts_every_input_type():
    cache = RadixCache()
    cache.insert([3, 1, 4, 1, 5], [0, 1, 2, 3, 4])
    for name, q in _token_variants([3, 1, 4, 2]).items():
        m = cache.match_prefix(q)
        assert (m.length, m.indices.tolist()) == (3, [0, 1, 2]), name
    check(cache)


def test_tree_copies_its_values():
    cache = RadixCache()
    toks = np.array([1, 2, 3, 4], dtype=np.int64)
    idx = np.array([10, 11, 12, 13], dtype=np.int64)
    cache.insert(toks, idx)
    toks[:] = 0
    idx[:] = 99
    assert_match(cache, [1, 2, 3, 4], 4, [10, 11, 12, 13])
    assert_match(cache, [0, 0], 0, [])
    # torch tensors share memory with numpy views: still copied
    t_toks = torch.tensor([7, 8, 9], dtype=torch.int64)
    t_idx = torch.tensor([20, 21, 22], dtype=torch.int64)
    cache.insert(t_toks, t_idx)
    t_toks.fill_(0)
    t_idx.fill_(99)
    assert_match(cache, [7, 8, 9], 3, [20, 21, 22])
    # the match result is a fresh array: mutating it leaves the tree alone
    m = cache.match_prefix([1, 2, 3, 4])
    m.indices[:] = -1
    assert_match(cache, [1, 2, 3, 4], 4, [10, 11, 12, 13])
    # so is to_dict
    d = cache.to_dict()
    d["children"][0]["indices"][0] = -5
    assert_match(cache, [1, 2, 3, 4], 4, [10, 11, 12, 13])
    check(cache)


def test_insert_copies_values_after_a_split():
    cache = RadixCache()
    idx = np.arange(6, dtype=np.int64)
    cache.insert([1, 2, 3, 4, 5, 6], idx)
    cache.match_prefix([1, 2, 3])  # split
    idx[:] = -1
    assert_match(cache, [1, 2, 3, 4, 5, 6], 6, list(range(6)))
    check(cache)


# --------------------------------------------------------------------------- construction / inspection
@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_known_policies_construct(policy):
    cache = RadixCache(page_size=2, eviction_policy=policy)
    assert cache.total_size == 0
    check(cache)


@pytest.mark.parametrize("policy", ["random", "", "lru ", None, "ARC"])
def test_unknown_policy_raises(policy):
    with pytest.raises(ValueError):
        RadixCache(eviction_policy=policy)


@pytest.mark.parametrize("page_size", [0, -1, -4])
def test_bad_page_size_raises(page_size):
    with pytest.raises(ValueError):
        RadixCache(page_size=page_size)


def test_non_integer_tokens_raise():
    cache = RadixCache()
    with pytest.raises(ValueError):
        cache.insert([1.5, 2.5], [0, 1])
    with pytest.raises(ValueError):
        cache.match_prefix(np.zeros((2, 2), dtype=np.int64))
    check(cache)


def test_to_dict_structure():
    cache = RadixCache()
    cache.insert([1, 2, 3], [0, 1, 2])
    cache.insert([1, 2, 4], [5, 6, 7])
    m = cache.match_prefix([1, 2, 3])
    cache.lock(m.node)
    d = cache.to_dict()
    keys = {"tokens", "indices", "lock_count", "last_access", "hit_count", "children"}

    def walk(node):
        assert keys <= set(node)
        assert isinstance(node["children"], list)
        assert len(node["tokens"]) == len(node["indices"])
        for c in node["children"]:
            walk(c)

    walk(d)
    assert d["tokens"] == [] and d["indices"] == [] and d["lock_count"] == 0
    mid = d["children"][0]
    assert mid["tokens"] == [1, 2] and mid["lock_count"] == 1 and mid["hit_count"] == 1
    by_tokens = {tuple(c["tokens"]): c for c in mid["children"]}
    assert by_tokens[(3,)]["lock_count"] == 1 and by_tokens[(3,)]["hit_count"] == 1
    assert by_tokens[(4,)]["lock_count"] == 0 and by_tokens[(4,)]["hit_count"] == 0
    assert by_tokens[(3,)]["last_access"] > by_tokens[(4,)]["last_access"]
    cache.unlock(m.node)
    check(cache)


def test_to_dict_of_unknown_namespace_is_empty():
    cache = RadixCache()
    cache.insert([1], [0])
    d = cache.to_dict("nope")
    assert d["children"] == [] and d["tokens"] == []


def test_pretty_print_returns_text():
    cache = RadixCache()
    assert isinstance(cache.pretty_print(), str)
    cache.insert([11, 22, 33], [0, 1, 2])
    cache.insert([11, 22, 44], [3, 4, 5], namespace="other")
    text = cache.pretty_print()
    assert isinstance(text, str)
    assert "11 22 33" in text and "44" in text
    check(cache)


def test_reset_empties_everything():
    cache = RadixCache()
    cache.insert([1, 2, 3], [0, 1, 2])
    cache.insert([1, 2, 3], [3, 4, 5], namespace="x")
    m = cache.match_prefix([1, 2])
    cache.lock(m.node)
    cache.reset()
    assert sizes(cache) == (0, 0, 0)
    assert paths(cache) == [] and paths(cache, "x") == []
    assert_match(cache, [1, 2, 3], 0, [])
    assert_match(cache, [1, 2, 3], 0, [], namespace="x")
    assert cache.evict(100).size == 0
    assert cache.insert([1, 2, 3], [7, 8, 9]) == 0
    assert_match(cache, [1, 2, 3], 3, [7, 8, 9])
    check(cache)


def test_lock_of_handle_from_before_reset_raises():
    """A handle taken before ``reset()`` names a node that is no longer in the cache;
    ``LockError``'s documented contract (base.py) is that locking such a handle raises.
    It must certainly not protect tokens of the new, empty tree."""
    cache = RadixCache()
    cache.insert([1, 2, 3], [0, 1, 2])
    stale = cache.match_prefix([1, 2, 3])
    cache.reset()
    with pytest.raises(LockError):
        cache.lock(stale.node)
    assert sizes(cache) == (0, 0, 0)
    check(cache)


def test_unlock_of_handle_locked_before_reset_keeps_sizes_consistent():
    """A request still holding a lock when the cache is reset later unlocks its handle:
    that must not push the new tree's protected size negative (a LockError is fine)."""
    cache = RadixCache()
    cache.insert([1, 2, 3], [0, 1, 2])
    held = cache.match_prefix([1, 2, 3])
    cache.lock(held.node)
    cache.reset()
    try:
        cache.unlock(held.node)
    except LockError:
        pass
    assert sizes(cache) == (0, 0, 0)
    check(cache)


def test_check_invariants_names_a_broken_invariant():
    # RadixCache-specific: corrupt a node through its (otherwise opaque) handle.
    cache = RadixCache()
    cache.insert([1, 2, 3], [0, 1, 2])
    m = cache.match_prefix([1, 2, 3])
    m.node.lock_count = -1
    with pytest.raises(AssertionError, match="lock counts"):
        cache.check_invariants()


# --------------------------------------------------------------------------- regressions
def test_regression_lock_count_never_negative():
    cache = RadixCache()
    cache.insert([1, 2, 3, 4], [0, 1, 2, 3])
    leaf = cache.match_prefix([1, 2, 3, 4])
    cache.lock(leaf.node)
    cache.insert([1, 2, 9], [4, 5, 6])  # split the locked edge
    mid = cache.match_prefix([1, 2])
    cache.unlock(leaf.node)
    check(cache)
    for handle in (leaf.node, mid.node):
        with pytest.raises(LockError):
            cache.unlock(handle)
        assert all(c >= 0 for c in lock_counts(cache))
        assert cache.protected_size == 0
        assert cache.evictable_size == cache.total_size == 5
        check(cache)


def test_regression_slots_not_leaked_at_idle():
    rng = np.random.default_rng(1234)
    for page_size in (1, 2, 4):
        alloc = SlotAllocator(96, page_size=page_size)
        cache = RadixCache(page_size=page_size)
        running = []

        for step in range(300):
            if running and (rng.random() < 0.4 or len(running) > 4):
                toks, node = running.pop(int(rng.integers(len(running))))
                cache.unlock(node)
            else:
                n = int(rng.integers(0, 14))
                toks = rng.integers(0, 3, size=n).tolist()
                m = cache.match_prefix(toks)
                cache.lock(m.node)
                need = n - m.length
                pages = -(-need // page_size)
                if alloc.num_free < pages * page_size:
                    alloc.free(cache.evict(pages * page_size - alloc.num_free))
                try:
                    fresh = alloc.alloc(need)
                except OutOfSlotsError:
                    cache.unlock(m.node)
                    continue
                idx = np.concatenate([m.indices, fresh])
                already = cache.insert(toks, idx)
                stored = n - n % page_size
                alloc.free(idx[m.length : already])  # duplicates
                alloc.free(idx[stored:])  # the partial last page the tree does not take
                m2 = cache.match_prefix(toks)
                assert m2.length == stored
                cache.lock(m2.node)
                cache.unlock(m.node)
                running.append((toks, m2.node))
            cache.check_invariants()
            alloc.check_invariants()
            assert alloc.num_free + cache.evictable_size + cache.protected_size == alloc.capacity, step
        for _, node in running:
            cache.unlock(node)
        check(cache)
        # idle: nothing protected, every slot either free or in the tree
        assert cache.protected_size == 0
        assert alloc.num_free + cache.evictable_size + cache.protected_size == alloc.capacity
        alloc.free(cache.evict(10**9))
        assert cache.total_size == 0
        assert alloc.num_free == alloc.capacity
        alloc.check_invariants()


def test_regression_duplicate_kv_not_freed_while_referenced():
    alloc = SlotAllocator(64)
    cache = RadixCache()
    prompt = [1, 2, 3, 4, 5, 6]
    # request A: computes the prompt, inserts it and keeps running on it
    a_slots = alloc.alloc(len(prompt))
    assert cache.insert(prompt, a_slots) == 0
    a = cache.match_prefix(prompt)
    cache.lock(a.node)
    assert a.indices.tolist() == a_slots.tolist()
    # request B started before A's insert (matched nothing), computed the same prompt + 2 tokens
    b_tokens = prompt + [7, 8]
    b_slots = alloc.alloc(len(b_tokens))
    already = cache.insert(b_tokens, b_slots)
    assert already == len(prompt)
    dups = b_slots[0:already]
    tree = set(all_tree_indices(cache))
    assert not set(dups.tolist()) & tree, "duplicates returned by insert must not be in the tree"
    assert set(a_slots.tolist()) <= tree
    alloc.free(dups)
    check(cache)
    # memory pressure: evict everything evictable; A's locked slots never come back
    freed = cache.evict(10**9)
    assert not set(freed.tolist()) & set(a_slots.tolist())
    assert freed.tolist() == b_slots[already:].tolist()
    alloc.free(freed)
    # the slots handed out next never alias A's running KV
    again = alloc.alloc(alloc.num_free)
    assert not set(again.tolist()) & set(a_slots.tolist())
    assert_match(cache, prompt, 6, a_slots.tolist())
    cache.unlock(a.node)
    check(cache)
    alloc.free(again)
    alloc.free(cache.evict(10**9))
    assert alloc.num_free == alloc.capacity


def test_regression_unlock_of_an_ancestor_never_locked_raises():
    """Unlocking a node that holds no lock of its own (only a descendant is locked)
    must raise and change nothing; otherwise the descendant's later unlock drives
    the ancestor's count negative."""
    cache = RadixCache()
    cache.insert([1, 2, 3, 4], [0, 1, 2, 3])
    leaf = cache.match_prefix([1, 2, 3, 4])
    cache.lock(leaf.node)
    mid = cache.match_prefix([1, 2])  # splits the edge: mid.node is an ancestor of leaf.node
    with pytest.raises(LockError):
        cache.unlock(mid.node)
    cache.check_invariants()
    cache.unlock(leaf.node)
    assert cache.protected_size == 0
    cache.check_invariants()


def test_key_of_names_the_prefix_not_the_edges_it_is_split_into():
    """A ghost key (``key_of``: the prefix through an entry's first page) is the same however the prefix is cut
    into edges, before and after a split, and differs with the tokens or the namespace."""
    tokens = list(range(100, 112))
    cut = RadixCache(page_size=2)  # one edge of 12 tokens, then cut after 6
    cut.insert(tokens, list(range(12)))
    before = cut.key_of(cut.match_prefix(tokens).node)
    cut.insert(tokens[:6] + [7, 7], list(range(20, 28)))
    lower = cut.match_prefix(tokens).node
    assert len(lower) == 6 and cut.key_of(lower.parent) == before  # the upper edge starts where it did
    grown = RadixCache(page_size=2)  # tokens[:6] first, then the rest as a child edge
    grown.insert(tokens[:6], list(range(6)))
    grown.insert(tokens, list(range(12)))
    child = grown.match_prefix(tokens).node
    assert len(child) == 6 and grown.key_of(child) == cut.key_of(lower)
    for cache in (cut, grown):
        cache.check_invariants()
    assert cut.key_of(cut.match_prefix(tokens[:6] + [7, 7]).node) != cut.key_of(lower)
    spaced = RadixCache(page_size=2)
    spaced.insert(tokens, list(range(12)), namespace="a")
    assert spaced.key_of(spaced.match_prefix(tokens, namespace="a").node) != before
