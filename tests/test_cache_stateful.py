"""Stateful property test: a prefix cache against a naive reference model.

The reference model knows nothing about trees. It is a dict mapping every cached
page-aligned prefix ``(namespace, tokens[:k])`` (``k`` a positive multiple of the page
size) to the KV slots of its last page (with page size 1: the slot of its last token).
The longest cached prefix of a query is the longest page-aligned ``k`` with
``(namespace, query[:k])`` in the dict, and the dict must stay prefix-closed.

The machine drives the cache only through the public ``PrefixCache`` protocol
(``match_prefix``, ``insert``, ``lock``, ``unlock``, ``evict``, the size properties,
``check_invariants``, ``reset``) together with a real ``SlotAllocator``, so the same
machine runs over any cache with that protocol: see ``make_machine``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from radixkv import HashBlockCache, HashV0Cache, OutOfSlotsError, RadixCache, SlotAllocator

ALPHABET = 4  # token ids 0..3: many shared prefixes, so splits happen a lot
MAX_LEN = 12
CAPACITY = 48  # small enough that eviction pressure is common
NAMESPACES = [None, "tenant-b"]

tokens_st = st.lists(st.integers(0, ALPHABET - 1), min_size=0, max_size=MAX_LEN)
namespace_st = st.sampled_from(NAMESPACES)
pick_st = st.integers(0, 10**6)

STATEFUL_SETTINGS = settings()  # the loaded profile (tests/conftest.py): fast locally, thorough under CI=true


@dataclass
class Request:
    """A running request: it holds a lock on the node where its cached prefix ends."""

    namespace: Any
    prefix: tuple  # the cached tokens the lock covers
    indices: list  # their slots, as matched
    node: Any


class PrefixCacheMachine(RuleBasedStateMachine):
    """The machine over one cache configuration: ``make_machine`` subclasses it with ``factory`` and ``page_size``."""

    factory: Callable[[], Any]
    page_size: int

    def __init__(self):
        super().__init__()
        self.ps = self.page_size
        self.cache = self.factory()
        self.alloc = SlotAllocator(CAPACITY, page_size=self.page_size)
        # (namespace, page-aligned prefix) -> slots of its last page
        self.ref: dict[tuple, tuple[int, ...]] = {}
        self.owner: dict[int, tuple] = {}  # slot -> (namespace, prefix)
        self.requests: list[Request] = []

    # ------------------------------------------------------------ reference
    def ref_match(self, namespace, tokens) -> tuple[int, list[int]]:
        tokens = tuple(tokens)
        k, slots = 0, []
        while k + self.ps <= len(tokens) and (namespace, tokens[: k + self.ps]) in self.ref:
            k += self.ps
            slots.extend(self.ref[(namespace, tokens[:k])])
        return k, slots

    def ref_add(self, namespace, tokens, indices, start: int, stop: int) -> None:
        assert start % self.ps == 0 and stop % self.ps == 0
        for k in range(start + self.ps, stop + 1, self.ps):
            key = (namespace, tuple(tokens[:k]))
            assert key not in self.ref
            page = tuple(int(x) for x in indices[k - self.ps : k])
            for slot in page:
                assert slot not in self.owner, f"slot {slot} stored twice"
                self.owner[slot] = key
            self.ref[key] = page

    def locked_keys(self) -> set:
        """The page-aligned prefixes some running request has locked."""
        keys = set()
        for r in self.requests:
            for k in range(self.ps, len(r.prefix) + 1, self.ps):
                keys.add((r.namespace, r.prefix[:k]))
        return keys

    # ------------------------------------------------------------ helpers
    def checked_match(self, namespace, tokens):
        expected_len, expected_idx = self.ref_match(namespace, tokens)
        m = self.cache.match_prefix(list(tokens), namespace=namespace)
        assert m.node is not None
        assert m.length % self.ps == 0
        assert m.length == expected_len, (m.length, expected_len, tokens)
        assert isinstance(m.indices, np.ndarray) and m.indices.dtype == np.int64
        assert m.indices.ndim == 1 and len(m.indices) == m.length
        assert m.indices.tolist() == expected_idx
        return m

    def do_evict(self, num_tokens: int, demoted_only: bool = False) -> np.ndarray:
        before_total = self.cache.total_size
        locked = self.locked_keys()
        freed = self.cache.evict(num_tokens, demoted_only=True) if demoted_only else self.cache.evict(num_tokens)
        assert isinstance(freed, np.ndarray) and freed.dtype == np.int64 and freed.ndim == 1
        slots = freed.tolist()
        assert len(set(slots)) == len(slots), "evict returned a slot twice"
        assert before_total - self.cache.total_size == len(slots)
        assert demoted_only or len(slots) >= num_tokens or self.cache.evictable_size == 0, (
            f"asked for {num_tokens}, freed {len(slots)}, evictable {self.cache.evictable_size} left"
        )
        freed_set = set(slots)
        for slot in slots:
            assert slot in self.owner, f"evict returned slot {slot}, which the cache never held"
            key = self.owner.pop(slot)
            assert key not in locked, f"evict freed {key}, which a running request has locked"
            if key in self.ref:
                assert freed_set.issuperset(self.ref[key]), f"evict freed only part of page {key}"
                del self.ref[key]
        # whole leaves were removed: what is left is still prefix-closed
        for ns, prefix in self.ref:
            if len(prefix) > self.ps:
                assert (ns, prefix[: -self.ps]) in self.ref, f"evict left {prefix} without its parent"
        self.alloc.free(freed)
        return freed

    def make_room(self, n: int) -> bool:
        """Ensure ``n`` slots can be allocated, evicting if needed."""
        pages = -(-n // self.ps)
        if self.alloc.num_free < pages * self.ps:
            self.do_evict(pages * self.ps - self.alloc.num_free)
        return self.alloc.num_free >= pages * self.ps

    def store(self, namespace, tokens, known: int, known_indices) -> int | None:
        """What an engine does after prefill: the request knew ``known`` cached tokens
        (slots ``known_indices``, locked by the caller) and computed the rest into fresh
        slots; insert everything, free the duplicates and the partial last page."""
        tokens = list(tokens)
        n = len(tokens)
        stored = n - n % self.ps
        if not self.make_room(n - known):
            return None
        try:
            fresh = self.alloc.alloc(n - known)
        except OutOfSlotsError:
            return None
        indices = np.concatenate([np.asarray(known_indices, dtype=np.int64), fresh])
        expected, _ = self.ref_match(namespace, tokens)
        assert expected >= known
        snapshot = indices.copy()
        already = self.cache.insert(tokens, indices, namespace=namespace)
        assert np.array_equal(indices, snapshot), "insert modified the caller's indices"
        assert already == expected, (already, expected, tokens)
        self.ref_add(namespace, tokens, indices, already, stored)
        self.alloc.free(indices[known:already])  # duplicates the tree did not take
        self.alloc.free(indices[stored:])  # the partial last page the tree does not take
        return already

    # ------------------------------------------------------------ rules
    @rule(namespace=namespace_st, tokens=tokens_st)
    def match(self, namespace, tokens):
        self.checked_match(namespace, tokens)

    @rule(namespace=namespace_st, tokens=tokens_st, known_pages=st.integers(0, MAX_LEN))
    def insert(self, namespace, tokens, known_pages):
        """A request that matched (and locked) ``known`` of the cached tokens some time
        ago inserts its whole sequence; ``known`` below the cached length produces duplicates,
        and the cached entries past ``known`` are not locked by it (the hash cache deduplicates
        unlocked blocks and must still evict the new ones before them)."""
        m = self.checked_match(namespace, tokens)
        known = min(m.length, known_pages * self.ps)
        mine = self.checked_match(namespace, tokens[:known])
        self.cache.lock(mine.node)
        self.store(namespace, tokens, known, mine.indices)
        self.cache.unlock(mine.node)

    @rule(namespace=namespace_st, tokens=tokens_st)
    def start_request(self, namespace, tokens):
        m = self.checked_match(namespace, tokens)
        self.cache.lock(m.node)
        self.requests.append(Request(namespace, tuple(tokens[: m.length]), m.indices.tolist(), m.node))

    @precondition(lambda self: self.requests)
    @rule(pick=pick_st, extra=st.lists(st.integers(0, ALPHABET - 1), min_size=1, max_size=6))
    def extend_request(self, pick, extra):
        """A running request decodes more tokens, inserts its sequence and moves its lock."""
        r = self.requests[pick % len(self.requests)]
        tokens = list(r.prefix) + extra
        if self.store(r.namespace, tokens, len(r.prefix), r.indices) is None:
            return
        m = self.checked_match(r.namespace, tokens)
        assert m.length == len(tokens) - len(tokens) % self.ps
        assert m.indices.tolist()[: len(r.prefix)] == r.indices
        self.cache.lock(m.node)
        self.cache.unlock(r.node)
        r.prefix, r.indices, r.node = tuple(tokens[: m.length]), m.indices.tolist(), m.node

    @precondition(lambda self: self.requests)
    @rule(pick=pick_st)
    def finish_request(self, pick):
        r = self.requests.pop(pick % len(self.requests))
        self.cache.unlock(r.node)

    @rule(num_tokens=st.integers(0, CAPACITY + 4))
    def evict(self, num_tokens):
        self.do_evict(num_tokens)

    @rule()
    def evict_one(self):
        """One block (hash) or one leaf (tree) at a time: what leaves must never strand what is left."""
        self.do_evict(1)

    @precondition(lambda self: hasattr(self.cache, "demote"))
    @rule(namespace=namespace_st, tokens=tokens_st)
    def demote(self, namespace, tokens):
        """A lower tier's copy of what a nearer tier holds: ranked to go first; nothing is added or removed."""
        sizes = (self.cache.total_size, self.cache.protected_size)
        assert 0 <= self.cache.demote(tokens, namespace) <= self.ref_match(namespace, tokens)[0]
        assert (self.cache.total_size, self.cache.protected_size) == sizes

    @precondition(lambda self: hasattr(self.cache, "demote"))
    @rule(num_tokens=st.integers(1, CAPACITY + 4))
    def evict_demoted(self, num_tokens):
        """Only demoted entries (a write that must not displace what only this tier keeps)."""
        self.do_evict(num_tokens, demoted_only=True)

    @precondition(lambda self: self.requests)
    @rule()
    def unlock_all(self):
        """A caller whose books are lost (``Scheduler.recover``): every lock dropped at once, every entry kept."""
        self.cache.unlock_all()
        self.requests.clear()

    @precondition(lambda self: not self.requests)
    @rule()
    def reset(self):
        self.cache.reset()
        self.alloc.free(sorted(self.owner))
        self.ref.clear()
        self.owner.clear()
        assert self.cache.total_size == 0

    # ------------------------------------------------------------ invariants
    @invariant()
    def cache_invariants(self):
        self.cache.check_invariants()

    @invariant()
    def sizes_match_the_model(self):
        c = self.cache
        assert c.total_size == c.evictable_size + c.protected_size
        assert c.evictable_size >= 0 and c.protected_size >= 0
        assert c.total_size == len(self.ref) * self.ps
        assert c.protected_size == len(self.locked_keys()) * self.ps

    @invariant()
    def held_slots_are_the_models(self):
        assert sorted(self.cache.held_slots().tolist()) == sorted(self.owner)

    @invariant()
    def no_slot_leaked(self):
        self.alloc.check_invariants()
        c = self.cache
        assert self.alloc.num_free + c.evictable_size + c.protected_size == self.alloc.capacity

    @invariant()
    def locked_prefixes_still_cached(self):
        for r in self.requests:
            for k in range(self.ps, len(r.prefix) + 1, self.ps):
                key = (r.namespace, r.prefix[:k])
                page = tuple(r.indices[k - self.ps : k])
                assert self.ref.get(key) == page, f"locked prefix {key} lost or changed"

    def teardown(self):
        for r in self.requests:
            self.cache.unlock(r.node)
        self.requests.clear()
        self.cache.check_invariants()
        assert self.cache.protected_size == 0
        assert self.alloc.num_free + self.cache.evictable_size == self.alloc.capacity  # idle
        self.do_evict(10**9)
        assert self.cache.total_size == 0 and not self.ref
        assert self.alloc.num_free == self.alloc.capacity


def make_machine(factory: Callable[[], Any], page_size: int) -> type[RuleBasedStateMachine]:
    """A state machine class testing caches built by ``factory`` (``page_size`` must match)."""
    machine = type(f"PrefixCacheMachine_page{page_size}", (PrefixCacheMachine,),
                   {"factory": staticmethod(factory), "page_size": page_size})
    machine.TestCase.settings = STATEFUL_SETTINGS
    return machine


TestRadixPage1LRU = make_machine(lambda: RadixCache(page_size=1, eviction_policy="lru"), 1).TestCase
TestRadixPage1LFU = make_machine(lambda: RadixCache(page_size=1, eviction_policy="lfu"), 1).TestCase
TestRadixPage2LRU = make_machine(lambda: RadixCache(page_size=2, eviction_policy="lru"), 2).TestCase
TestRadixPage2LFU = make_machine(lambda: RadixCache(page_size=2, eviction_policy="lfu"), 2).TestCase
# The same machine over the hash-block baseline, through the same protocol. Its reference model
# requires eviction to keep the cache prefix-closed (do_evict), and check_invariants that every cached
# block is reachable from its root: children leave before their parents under every policy, the
# lru queue by release order, the others (mru and fifo rank parents first) by passing parents over.
TestHashBlock1LRU = make_machine(lambda: HashBlockCache(block_size=1, eviction_policy="lru"), 1).TestCase
TestHashBlock2LRU = make_machine(lambda: HashBlockCache(block_size=2, eviction_policy="lru"), 2).TestCase
TestHashBlock2LFU = make_machine(lambda: HashBlockCache(block_size=2, eviction_policy="lfu"), 2).TestCase
TestHashBlock2MRU = make_machine(lambda: HashBlockCache(block_size=2, eviction_policy="mru"), 2).TestCase
TestHashBlock1FIFO = make_machine(lambda: HashBlockCache(block_size=1, eviction_policy="fifo"), 1).TestCase
TestHashBlock2Builtin = make_machine(
    lambda: HashBlockCache(block_size=2, hash_algo="builtin", eviction_policy="lru"), 2
).TestCase
# vLLM v0's cache (whole-prefix hashes, LRU ties deepest first). Its evictor ignores the tree, but every
# access through this protocol walks from the root, so a child is never more recent than its parent
# and the deepest-first tie keeps eviction children-first here: the prefix-closed model holds.
TestHashV0Block1 = make_machine(lambda: HashV0Cache(block_size=1), 1).TestCase
TestHashV0Block2 = make_machine(lambda: HashV0Cache(block_size=2), 2).TestCase
