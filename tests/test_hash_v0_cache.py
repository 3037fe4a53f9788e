"""Conformance scenarios for HashV0Cache (vLLM v0's APC, BlockSpaceManagerV1) at block size 4."""

from __future__ import annotations

import random

import numpy as np
import pytest
from serving import serve

from radixkv import HashBlockCache, HashV0Cache, LockError, PrefixCache, SlotAllocator, make_cache
from radixkv.cache.lifecycle import commit_prefix
from radixkv.config import EngineConfig

BS = 4


@pytest.fixture
def cache():
    return HashV0Cache(block_size=BS)


@pytest.fixture
def alloc():
    return SlotAllocator(10 * BS, page_size=BS)


def test_protocol_factory_and_config():
    c = make_cache("hash-v0", block_size=8)
    assert isinstance(c, HashV0Cache) and isinstance(c, PrefixCache)
    assert c.block_size == c.page_size == 8
    assert EngineConfig(prefix_cache="hash-v0", block_size=8, page_size=1).kv_page_size == 8
    for bad in [dict(eviction_policy="lfu"), dict(eviction_policy="belady"), dict(colour=1)]:
        with pytest.raises(ValueError):
            make_cache("hash-v0", **bad)
    with pytest.raises(ValueError):
        HashV0Cache(block_size=0)


def test_only_full_blocks_and_the_contract_scenarios(cache, alloc):
    assert serve(cache, alloc, range(10)) == 0
    assert cache.total_size == 8 and cache.num_blocks == 2
    assert serve(cache, alloc, list(range(10)) + [50, 51, 52]) == 8
    assert serve(cache, alloc, [0, 1, 2, 60, 61, 62, 63, 64]) == 0
    prompt = list(range(8))
    assert serve(cache, alloc, prompt) == 4  # at least one token computed: the whole last block
    assert cache.match_prefix(prompt).length == 8
    assert cache.cacheable_length(11) == 8


def test_whole_prefix_keys_same_block_after_different_first_block_misses(cache, alloc):
    serve(cache, alloc, [1, 2, 3, 4, 5, 6, 7, 8, 0])
    assert serve(cache, alloc, [9, 9, 9, 9, 5, 6, 7, 8, 0]) == 0
    assert cache.match_prefix([1, 2, 3, 4, 5, 6, 7, 8]).length == 8


def test_namespaces_isolate(cache, alloc):
    serve(cache, alloc, range(9), namespace="lora-a")
    assert serve(cache, alloc, range(9), namespace="lora-b") == 0
    assert serve(cache, alloc, range(9)) == 0
    assert serve(cache, alloc, range(9), namespace="lora-a") == 8


def test_hashing_is_quadratic_in_the_prefix(cache):
    """Every block hashes the whole prefix up to its end: b blocks cost bs x b (b + 1) / 2 tokens."""
    n_blocks = 20
    tokens = list(range(n_blocks * BS))
    cache.insert(tokens, list(range(len(tokens))))
    quadratic = BS * n_blocks * (n_blocks + 1) // 2
    assert cache.stats()["hashed_tokens"] == quadratic
    assert cache.match_prefix(tokens).length == len(tokens)
    assert cache.stats()["hashed_tokens"] == 2 * quadratic
    cache.match_prefix([99] + tokens[1:])  # misses at the first block: one block hashed
    assert cache.stats()["hashed_tokens"] == 2 * quadratic + BS


def test_insert_dedups_and_never_overwrites(cache):
    assert cache.insert(list(range(8)), [0, 1, 2, 3, 4, 5, 6, 7]) == 0
    # Another request computed the same two blocks plus one more (a block promoted during decode).
    assert cache.insert(list(range(12)), list(range(100, 112))) == 8  # caller frees 100..107
    assert cache.match_prefix(list(range(12))).indices.tolist() == list(range(8)) + list(range(108, 112))
    assert cache.total_size == 12
    cache.check_invariants()


def test_commit_prefix_frees_the_duplicate_of_a_promoted_block(cache):
    alloc = SlotAllocator(16, page_size=BS)
    cache.insert(list(range(8)), alloc.alloc(8))
    slots = alloc.alloc(8)  # a second request computed the same 8 tokens itself
    node, cached, slots = commit_prefix(cache, alloc, list(range(8)), slots, 0, cache.root)
    assert cached == 8 and alloc.num_free == 8 and cache.total_size == 8
    cache.unlock(node)
    cache.check_invariants()


def test_eviction_least_recent_first_ties_deepest_first(cache):
    cache.insert(list(range(12)), list(range(12)))  # A0 A1 A2, one stamp
    cache.insert(list(range(100, 108)), list(range(100, 108)))  # B0 B1, newer
    assert cache.evict(1).tolist() == [8, 9, 10, 11]  # A2: oldest stamp, most hashed tokens
    assert cache.evict(1).tolist() == [4, 5, 6, 7]
    cache.match_prefix([0, 1, 2, 3])  # A0 is now the most recent
    assert cache.evict(1).tolist() == [104, 105, 106, 107]
    assert cache.evict(100).tolist() == [100, 101, 102, 103, 0, 1, 2, 3]
    assert cache.total_size == 0


def test_locked_blocks_are_never_evicted(cache):
    cache.insert(list(range(8)), list(range(8)))
    m = cache.match_prefix(list(range(8)))
    cache.lock(m.node)
    assert cache.protected_size == 8 and cache.evictable_size == 0
    assert cache.evict(100).size == 0
    cache.unlock(m.node)
    assert cache.evict(100).size == 8


def test_parent_evicted_before_child_strands_the_child(cache, alloc):
    """v0's evictor ignores the tree: an older parent leaves first, its child stays but never matches."""
    tokens = list(range(8))
    cache.insert(tokens, alloc.alloc(8))
    child = cache._blocks[(cache.hash_of_block(tokens, 1)[0], None)]
    cache._clock += 1
    cache._touch([child])  # the child alone made more recent than its parent (no public call does that)
    alloc.free(cache.evict(1))
    assert cache.num_blocks == 1 and cache.stranded() == 1 and cache.total_size == 4
    assert cache.match_prefix(tokens).length == 0  # the walk stops at the missing parent
    assert cache.to_dict()["children"] == []
    cache.check_invariants()
    # Re-inserting the prefix replaces the stranded child by the caller's copy (which the caller goes on
    # using: it must never also be the cache's spare); the stranded copy's slots are spare.
    slots = alloc.alloc(8)
    assert cache.insert(tokens, slots) == 0
    assert cache.match_prefix(tokens).indices.tolist() == slots.tolist()
    assert cache.total_size == 12 and cache.evictable_size == 12
    cache.check_invariants()
    assert cache.evict(1).tolist() == child.slots.tolist()  # spare slots leave first
    assert cache.match_prefix(tokens).length == 8


def test_lock_errors_and_foreign_handles(cache):
    cache.insert(list(range(8)), list(range(8)))
    long, short = cache.match_prefix(list(range(8))), cache.match_prefix(list(range(4)))
    with pytest.raises(LockError):
        cache.unlock(long.node)
    cache.lock(long.node)
    with pytest.raises(LockError):
        cache.unlock(short.node)  # its block is locked only through the longer handle
    cache.unlock(long.node)
    with pytest.raises(LockError):
        cache.unlock(long.node)
    other = HashV0Cache(block_size=BS)
    other.insert(list(range(8)), list(range(8)))
    foreign = other.match_prefix(list(range(8))).node
    with pytest.raises(LockError):
        cache.lock(foreign)
    with pytest.raises(LockError):
        cache.unlock(foreign)
    hb = HashBlockCache(block_size=BS)
    hb.insert(list(range(8)), list(range(8)))
    with pytest.raises(LockError):
        cache.lock(hb.match_prefix(list(range(8))).node)
    cache.evict(100)
    with pytest.raises(LockError):
        cache.lock(long.node)
    cache.check_invariants()


def test_reset_stats_to_dict_and_pretty_print(cache):
    cache.insert(list(range(9)), list(range(9)))
    cache.match_prefix(list(range(6)))
    st = cache.stats()
    assert st["queried_tokens"] == 6 and st["hit_tokens"] == 4 and st["hit_rate"] == 4 / 6
    tree = cache.to_dict()
    assert tree["children"][0]["tokens"] == [0, 1, 2, 3]
    assert tree["children"][0]["children"][0]["tokens"] == [4, 5, 6, 7]
    assert "HashV0Cache" in cache.pretty_print() and "[4 5 6 7]" in cache.pretty_print()
    handle = cache.match_prefix(list(range(8))).node
    cache.reset()
    assert cache.total_size == 0 and cache.stats()["hashed_tokens"] == 0
    with pytest.raises(LockError):
        cache.lock(handle)


def test_insert_length_mismatch_raises(cache):
    with pytest.raises(ValueError):
        cache.insert([1, 2, 3, 4], [1, 2, 3])


@pytest.mark.parametrize("seed", range(4))
def test_randomized_operations_keep_invariants(seed):
    rng = random.Random(seed)
    cache, alloc = HashV0Cache(block_size=2), SlotAllocator(40, page_size=2)
    held = []
    for _ in range(400):
        op = rng.random()
        tokens = [rng.randrange(3) for _ in range(rng.randrange(12))]
        ns = rng.choice([None, "b"])
        if op < 0.4:
            try:
                serve(cache, alloc, tokens, [rng.randrange(3) for _ in range(rng.randrange(4))], ns)
            except Exception as exc:  # OutOfSlotsError while locks are held
                assert type(exc).__name__ == "OutOfSlotsError"
        elif op < 0.6:
            m = cache.match_prefix(tokens, ns)
            cache.lock(m.node)
            held.append(m.node)
        elif op < 0.75 and held:
            cache.unlock(held.pop(rng.randrange(len(held))))
        else:
            alloc.free(cache.evict(rng.randrange(1, 12)))
        cache.check_invariants()
        assert alloc.num_free + cache.evictable_size + cache.protected_size == alloc.capacity
    for node in held:
        cache.unlock(node)
    alloc.free(cache.evict(10**9))
    assert cache.total_size == 0 and alloc.num_free == alloc.capacity
    assert np.all(np.isfinite([cache.stats()["hit_rate"]]))


def test_simulator_accepts_hash_v0_and_hits_as_v1_without_pressure():
    from radixkv import workloads
    from radixkv.sim import simulate

    reqs = workloads.make("multi_turn", seed=3, sessions=3, turns=3, user_tokens=(20, 40), output_tokens=(3, 6))
    v0, v1 = (simulate(reqs, cache=c, block_size=4, max_running=1) for c in ("hash-v0", "hash"))
    assert v0.hit_tokens == v1.hit_tokens > 0
    assert v0.config["allocator_page"] == 4


# ------------------------------------------------ where v0 and v1 differ (docs/hash_vs_radix.md)
@pytest.mark.parametrize("name", ["hash-v0", "hash"])
def test_v0_v1_difference_eviction_order_after_a_lookup(name):
    """Under pressure, v0 evicts the least recently *accessed* blocks (a plain lookup counts); v1 the least
    recently *released* (a lookup that locks nothing leaves its free queue as it was)."""
    cache, alloc = make_cache(name, block_size=BS), SlotAllocator(6 * BS, page_size=BS)
    serve(cache, alloc, list(range(8)) + [99])  # A: 2 blocks, released first
    serve(cache, alloc, list(range(100, 108)) + [99])  # B: 2 blocks, released second
    assert cache.match_prefix(list(range(8))).length == 8  # e.g. a policy ranking the waiting queue
    freed = sorted(cache.evict(2 * BS).tolist())
    cached_a = cache.match_prefix(list(range(8))).length
    if name == "hash-v0":
        assert cached_a == 8 and cache.match_prefix(list(range(100, 108))).length == 0  # B went
    else:
        assert cached_a == 0 and cache.match_prefix(list(range(100, 108))).length == 8  # A went
    assert len(freed) == 2 * BS


@pytest.mark.parametrize("name", ["hash-v0", "hash"])
def test_v0_v1_difference_two_running_requests_filling_the_same_block(name):
    """Two running requests generate the same blocks: v0 promotes each filled block as it fills, so the
    second request moves onto the first one's block and frees its copy while both still run (and a third
    request could already hit them); v1 (as radixkv inserts it) caches generated blocks at finish, so until
    then each request keeps its own copy. The outputs and the cache after both finish are the same."""
    from radixkv import LLM, SamplingParams

    greedy = SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True)
    llm = LLM("tiny-random", prefix_cache=name, block_size=BS, kv_cache_tokens=256)
    prompt = list(range(10, 20))  # 2 full blocks + 2 tokens
    for _ in range(2):
        llm.add_request(prompt, greedy)
    for _ in range(8):  # the prefill, then 7 decodes: 17 tokens computed, 4 full blocks
        llm.step()
    assert [s.computed for s in llm.running] == [17, 17]
    own = llm.allocator.capacity - llm.allocator.num_free - llm.cache.total_size  # slots outside the cache
    if name == "hash-v0":
        assert [s.cached for s in llm.running] == [16, 16] and llm.cache.total_size == 16
        assert own == 2 * BS  # each one's partial fifth block
    else:
        assert [s.cached for s in llm.running] == [8, 8] and llm.cache.total_size == 8
        assert own == 2 * 3 * BS  # each one's copies of blocks 3 and 4 and its partial fifth
    outs = []
    while llm.has_unfinished():
        outs += llm.step()
    assert outs[0].token_ids == outs[1].token_ids
    assert llm.cache.total_size == 20  # prompt + 11 generated tokens: 5 full blocks either way
    llm.check_idle()
