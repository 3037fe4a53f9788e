"""Conformance scenarios for HashBlockCache (vLLM v1 semantics) at block size 4."""

from __future__ import annotations

import numpy as np
import pytest
from serving import serve

from radixkv import HashBlockCache, LockError, NoPrefixCache, PrefixCache, RadixCache, SlotAllocator, match_for_prefill

BS = 4


@pytest.fixture
def cache():
    return HashBlockCache(block_size=BS)


@pytest.fixture
def alloc():
    return SlotAllocator(10 * BS, page_size=BS)  # a 10-block budget


def test_cold_prompt_caches_only_full_blocks(cache, alloc):
    assert serve(cache, alloc, range(10)) == 0
    assert cache.total_size == 8 and cache.num_blocks == 2


def test_second_prompt_sharing_ten_tokens_hits_eight(cache, alloc):
    serve(cache, alloc, range(10))
    assert serve(cache, alloc, list(range(10)) + [50, 51, 52]) == 8


def test_sharing_less_than_a_block_hits_nothing(cache, alloc):
    serve(cache, alloc, range(10))
    assert serve(cache, alloc, [0, 1, 2, 60, 61, 62, 63, 64]) == 0


def test_exact_two_block_prompt_recomputes_last_block(cache, alloc):
    prompt = list(range(8))
    serve(cache, alloc, prompt)
    assert serve(cache, alloc, prompt) == 4  # at least one token computed: the whole last block
    assert serve(cache, alloc, prompt + [99]) == 8
    assert cache.match_prefix(prompt).length == 8  # the raw cache matches everything


def test_chained_keys_same_block_after_different_first_block_misses(cache, alloc):
    serve(cache, alloc, [1, 2, 3, 4, 5, 6, 7, 8, 0])
    assert serve(cache, alloc, [9, 9, 9, 9, 5, 6, 7, 8, 0]) == 0
    assert cache.match_prefix([1, 2, 3, 4, 5, 6, 7, 8]).length == 8


def test_eviction_takes_released_chain_tail_first(cache, alloc):
    serve(cache, alloc, range(13))  # blocks A0 A1 A2 released tail first
    a = cache.match_prefix(list(range(12)))
    tail = a.indices[8:12]
    freed = cache.evict(1)
    assert freed.tolist() == tail.tolist()
    assert cache.match_prefix(list(range(12))).length == 8


def test_hit_block_never_evicted_by_the_allocation_it_triggers(cache, alloc):
    serve(cache, alloc, range(9))  # 2 blocks cached
    serve(cache, alloc, range(100, 132))  # 8 blocks: the budget is full, the first chain is oldest
    assert alloc.num_free == 0
    # A request hitting the first chain needs new blocks: eviction must spare its hits.
    assert serve(cache, alloc, list(range(8)) + list(range(200, 209))) == 8


def test_namespaces_isolate(cache, alloc):
    serve(cache, alloc, range(9), namespace="lora-a")
    assert serve(cache, alloc, range(9), namespace="lora-b") == 0
    assert serve(cache, alloc, range(9)) == 0
    assert serve(cache, alloc, range(9), namespace="lora-a") == 8


def test_multi_turn_hits_previous_answer(cache, alloc):
    prompt, answer = list(range(6)), list(range(100, 106))
    serve(cache, alloc, prompt, answer)  # caches prompt + answer[:-1] = 11 tokens -> 2 blocks
    second = prompt + answer + [200, 201]
    assert serve(cache, alloc, second) == 8


def test_fourteen_tokens_ten_shared_hash_hits_eight_tree_hits_ten():
    first = list(range(14))
    second = list(range(10)) + [90, 91, 92, 93]
    hits = {}
    for name, cache in {"hash": HashBlockCache(block_size=4), "radix": RadixCache(page_size=1)}.items():
        alloc = SlotAllocator(64, page_size=cache.page_size)
        serve(cache, alloc, first)
        hits[name] = serve(cache, alloc, second)
    assert hits == {"hash": 8, "radix": 10}


def test_generated_tokens_cacheable_once_their_block_fills(cache, alloc):
    serve(cache, alloc, range(6), output=[100, 101])  # 6 + 1 = 7 tokens: 1 block
    assert cache.total_size == 4
    serve(cache, alloc, range(6), output=[100, 101, 102])  # 6 + 2 = 8 tokens: 2 blocks
    assert cache.total_size == 8


def test_lock_unlock_lock_counts(cache):
    cache.insert(range(8), range(8))
    m = cache.match_prefix(range(8))
    cache.lock(m.node)
    cache.lock(m.node)
    assert cache.protected_size == 8 and cache.evict(100).size == 0
    cache.unlock(m.node)
    cache.unlock(m.node)
    with pytest.raises(LockError):
        cache.unlock(m.node)
    assert cache.protected_size == 0 and cache.evictable_size == 8
    cache.check_invariants()
    cache.lock(cache.root)
    cache.unlock(cache.root)  # the empty handle changes nothing


def test_unlock_of_a_never_locked_shorter_handle_raises(cache):
    """Regression: per-block counts let ``unlock`` of a handle that was never locked through, when a longer locked
    handle shares its blocks; that dropped the shared block's count to 0 and freed it under the longer handle."""
    cache.insert(range(8), range(8))  # blocks of 4: [0..3], [4..7]
    longer, shorter = cache.match_prefix(range(8)), cache.match_prefix(range(4))
    cache.lock(longer.node)
    with pytest.raises(LockError, match="no lock of its own"):
        cache.unlock(shorter.node)
    assert cache.protected_size == 8 and cache.evict(100).size == 0  # nothing changed
    cache.check_invariants()
    cache.lock(shorter.node)  # a lock of its own: now its unlock is fine, and the longer handle keeps both blocks
    cache.unlock(shorter.node)
    assert cache.protected_size == 8
    cache.unlock(longer.node)
    cache.check_invariants()
    assert cache.evictable_size == 8


def test_lock_of_evicted_handle_raises(cache):
    cache.insert(range(8), range(8))
    m = cache.match_prefix(range(8))
    cache.evict(8)
    with pytest.raises(LockError):
        cache.lock(m.node)


def reachable_tokens(cache: HashBlockCache) -> int:
    """Tokens in the blocks ``to_dict`` reaches from the root: every block a lookup can find."""

    def walk(node) -> int:
        return len(node["tokens"]) + sum(walk(child) for child in node["children"])

    return walk(cache.to_dict())


def test_mru_evicts_a_parent_only_after_its_children():
    cache = HashBlockCache(block_size=2, eviction_policy="mru")
    cache.insert([1, 2, 3, 4], [10, 11, 12, 13])
    cache.match_prefix([1, 2])  # block [1 2] is now the most recently used, but [3 4] chains from it
    assert cache.evict(1).tolist() == [12, 13]
    cache.check_invariants()
    assert cache.match_prefix([1, 2, 3, 4]).length == 2 and reachable_tokens(cache) == cache.total_size == 2
    assert cache.evict(1).tolist() == [10, 11]
    assert cache.total_size == 0


def test_regression_deduplicated_chain_strands_no_block_when_evicted_one_at_a_time():
    """Two requests share ``a1 a2`` and add different third blocks; the second insert deduplicates ``a1 a2``.

    Before the fix the LRU free queue held ``b3 a2 a1 c3``: evicting one block at a time took ``a2`` while
    ``c3`` still chained from it, and ``c3`` then kept its slots, unreachable, until it reached the head.
    """
    cache, alloc = HashBlockCache(block_size=2), SlotAllocator(12, page_size=2)
    first, second = alloc.alloc(6), alloc.alloc(6)
    assert cache.insert([1, 2, 3, 4, 5, 6], first) == 0  # a1 a2 b3
    assert cache.insert([1, 2, 3, 4, 7, 8], second) == 4  # a1 a2 are duplicates, c3 is new
    alloc.free(second[:4])  # the caller frees its duplicates
    cache.check_invariants()
    order = []
    while cache.total_size:
        freed = cache.evict(1)  # evict returns the slots; the caller frees them
        cache.check_invariants()
        assert reachable_tokens(cache) == cache.total_size, "a cached block is unreachable (stranded)"
        order.append(freed.tolist())
        alloc.free(freed)
        assert alloc.num_free + cache.evictable_size == alloc.capacity  # idle: nothing locked, nothing lost
    assert order == [first[4:].tolist(), second[4:].tolist(), first[2:4].tolist(), first[:2].tolist()]


@pytest.mark.parametrize("policy", ["lru", "lfu", "fifo", "mru", "filo"])
def test_randomized_inserts_and_single_block_evictions_strand_no_block(policy):
    """Raw inserts (no lock, so shared blocks are deduplicated unlocked), lookups, locked requests and
    one-block evictions in a random order: every cached block stays reachable under every policy."""
    rng = np.random.default_rng(28)
    cache, alloc = HashBlockCache(block_size=2, eviction_policy=policy), SlotAllocator(24, page_size=2)
    held = []  # handles locked by running requests
    for _ in range(400):
        tokens = rng.integers(0, 3, size=int(rng.integers(2, 11))).tolist()
        op = rng.integers(0, 4)
        if op == 0:
            cache.match_prefix(tokens)
        elif op == 1 and len(held) < 3:
            m = cache.match_prefix(tokens)
            cache.lock(m.node)
            held.append(m.node)
        elif op == 2 and held:
            cache.unlock(held.pop(int(rng.integers(0, len(held)))))
        elif alloc.num_free >= len(tokens) or alloc.num_free + cache.evictable_size >= len(tokens) + 2:
            while alloc.num_free < len(tokens):
                alloc.free(cache.evict(1))
                cache.check_invariants()
                assert reachable_tokens(cache) == cache.total_size
            slots = alloc.alloc(len(tokens))
            already = cache.insert(tokens, slots)
            alloc.free(slots[:already])
            alloc.free(slots[cache.cacheable_length(len(tokens)) :])
        cache.check_invariants()
        assert reachable_tokens(cache) == cache.total_size
        assert alloc.num_free + cache.evictable_size + cache.protected_size == alloc.capacity
    for node in held:
        cache.unlock(node)
    assert alloc.num_free + cache.evictable_size == alloc.capacity
    while cache.total_size:
        alloc.free(cache.evict(1))
        cache.check_invariants()
        assert reachable_tokens(cache) == cache.total_size
    assert alloc.num_free == alloc.capacity


@pytest.mark.parametrize("algo", ["sha256", "builtin"])
def test_hash_algos_agree_on_hits(algo):
    cache = HashBlockCache(block_size=4, hash_algo=algo)
    cache.insert(range(12), range(12))
    assert cache.match_prefix(list(range(10)) + [7, 7]).length == 8
    cache.check_invariants()


def test_xxhash_works_or_fails_clearly():
    try:
        import xxhash  # noqa: F401
    except ImportError:
        with pytest.raises(ValueError, match="xxhash"):
            HashBlockCache(hash_algo="xxhash")
        return
    cache = HashBlockCache(block_size=4, hash_algo="xxhash")
    cache.insert(range(8), range(8))
    assert cache.match_prefix(range(8)).length == 8


def test_xxhash_missing_is_a_clear_error(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_xxhash(name, *args, **kwargs):
        if name == "xxhash":
            raise ImportError("no xxhash")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_xxhash)
    with pytest.raises(ValueError, match="pip install xxhash"):
        HashBlockCache(hash_algo="xxhash")


def test_sha256_keys_are_deterministic_across_instances():
    a, b = HashBlockCache(block_size=4), HashBlockCache(block_size=4)
    assert a.block_keys(range(8)) == b.block_keys(np.arange(8))
    assert a.block_keys(range(8)) != a.block_keys(range(8), namespace="salt")


@pytest.mark.parametrize("kwargs", [{"block_size": 0}, {"hash_algo": "md5"}, {"eviction_policy": "random"}])
def test_bad_arguments_raise_value_error(kwargs):
    with pytest.raises(ValueError):
        HashBlockCache(**kwargs)


def test_insert_length_mismatch_raises(cache):
    with pytest.raises(ValueError):
        cache.insert(range(8), range(7))


def test_stats_are_token_weighted(cache):
    cache.insert(range(8), range(8))
    cache.match_prefix(range(10))
    cache.match_prefix([5] * 6)
    assert cache.stats() == {"queried_tokens": 16, "hit_tokens": 8, "hit_rate": 0.5}


def test_to_dict_and_pretty_print(cache):
    cache.insert(range(8), range(100, 108))
    cache.insert(list(range(4)) + [9, 9, 9, 9], range(200, 208))
    tree = cache.to_dict()
    assert [c["tokens"] for c in tree["children"]] == [[0, 1, 2, 3]]
    assert sorted(c["tokens"] for c in tree["children"][0]["children"]) == [[4, 5, 6, 7], [9, 9, 9, 9]]
    assert "HashBlockCache" in cache.pretty_print()


def test_no_prefix_cache_never_matches_and_stores_nothing():
    cache, alloc = NoPrefixCache(), SlotAllocator(64)
    assert isinstance(cache, PrefixCache)
    for _ in range(3):
        assert serve(cache, alloc, range(20), output=[1, 2, 3]) == 0
    assert cache.total_size == 0 and alloc.num_free == 64
    assert cache.evict(10).size == 0


@pytest.mark.parametrize("make", [lambda: RadixCache(page_size=4), lambda: HashBlockCache(block_size=4), NoPrefixCache])
def test_at_least_one_token_rule(make):
    cache = make()
    prompt = list(range(8))
    cache.insert(prompt, range(8))
    m = match_for_prefill(cache, prompt)
    assert m.length < len(prompt)
    assert m.length == (4 if not isinstance(cache, NoPrefixCache) else 0)
    assert match_for_prefill(cache, prompt + [1]).length == (8 if not isinstance(cache, NoPrefixCache) else 0)
    assert match_for_prefill(cache, []).length == 0


@pytest.mark.parametrize("make", [RadixCache, lambda: HashBlockCache(block_size=4), NoPrefixCache])
def test_every_cache_rejects_the_same_bad_inputs(make):
    """A 2-D or non-integer query is a ValueError for all three caches (NoPrefixCache used to count rows)."""
    cache = make()
    for bad in (np.zeros((2, 3), dtype=np.int64), [1.5, 2.5]):
        with pytest.raises(ValueError):
            cache.match_prefix(bad)
    assert cache.stats()["queried_tokens"] == 0


def test_handles_from_before_reset_cannot_be_locked_or_unlocked(cache):
    cache.insert(range(8), range(8))
    m = cache.match_prefix(range(8))
    cache.lock(m.node)
    cache.reset()
    with pytest.raises(LockError):
        cache.lock(m.node)
    with pytest.raises(LockError):
        cache.unlock(m.node)
    assert (cache.total_size, cache.protected_size) == (0, 0)
    cache.check_invariants()


def test_regression_insert_refreshes_recency_of_cached_blocks_for_priority_policies():
    """A block touched by insert must be re-ranked: mru then evicts it first (as the radix tree does)."""
    for cache in (HashBlockCache(block_size=2, eviction_policy="mru"), RadixCache(page_size=2, eviction_policy="mru")):
        cache.insert([1, 1], [0, 1])
        cache.insert([2, 2], [2, 3])
        cache.insert([1, 1], [4, 5])  # touches [1, 1]: now the most recently used
        assert cache.evict(2).tolist() == [0, 1]


def test_remembered_key_chains_stay_within_their_byte_bound_and_change_no_key():
    """Regression: the memo of key chains was bounded by count alone, so long agent prompts (100k+ tokens,
    a first block per session) held gigabytes (17 GB in a full agentic replay at 4M tokens)."""
    from radixkv.cache.block_hash import BlockHasher

    bounded = BlockHasher(16, "sha256", memo_entries=1024, memo_chains=32, memo_bytes=200_000)
    fresh = BlockHasher(16, "sha256", memo_entries=0, memo_chains=1)
    rng = np.random.default_rng(0)
    for session in range(40):
        prompt = rng.integers(0, 50_000, 4_000).tolist()
        for _turn in range(3):  # each turn extends the last, as an agent's prompts do
            prompt += rng.integers(0, 50_000, 500).tolist()
            assert bounded.keys(prompt, namespace=session % 3) == fresh.keys(prompt, namespace=session % 3)
            assert bounded.memo_size <= 200_000 + 8 * len(prompt) + 80 * (len(prompt) // 16)
    assert bounded.memo_size == sum(len(c[0]) + 80 * len(c[1]) for chains in bounded._memo.values() for c in chains)
