"""Cache events (radixkv.cache.events) from every cache, and KVEventIndex built from them alone.

The index fed by a cache's listener must answer every probe exactly as the cache's ``match_prefix`` does,
and count exactly the cache's blocks, after every operation of a randomized run (match, serve, start,
commit, finish, evict, unlock_all, reset); several caches as replicas of one index must each agree with it;
with no listener no event is ever built.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

import radixkv.cache.radix as radix_module
from radixkv import HashBlockCache, HashV0Cache, NoPrefixCache, OutOfSlotsError, RadixCache, SlotAllocator
from radixkv.cache import events
from radixkv.cache.events import AllBlocksCleared, BlockRemoved, BlockStored, CacheEvent
from radixkv.cache.eviction.belady import Belady
from radixkv.cache.future import FutureUses
from radixkv.cache.lifecycle import commit_prefix, release_sequence, serve_once
from radixkv.routing.kv_index import KVEventIndex

ALPHABET = 3  # few token ids: many shared prefixes, so splits and dedup happen a lot
NAMESPACES = [None, "tenant-b"]
CAPACITY = 96

CACHES: dict[str, tuple[Callable[[], Any], int]] = {
    "radix-page1": (lambda: RadixCache(page_size=1), 1),
    "radix-page4": (lambda: RadixCache(page_size=4), 4),
    "radix-page4-lfu": (lambda: RadixCache(page_size=4, eviction_policy="lfu"), 4),
    "hash-block4": (lambda: HashBlockCache(block_size=4), 4),
    "hash-block4-mru": (lambda: HashBlockCache(block_size=4, eviction_policy="mru"), 4),
    "hash-v0-block4": (lambda: HashV0Cache(block_size=4), 4),
    "none": (NoPrefixCache, 1),
}


class Recorder:
    """A listener that keeps every event and checks each against the ones before it: hashes consistent
    within the cache (a removal names a stored block, under the namespace it was stored in; a store's parent
    is stored), token ids plain ints, ``len(token_ids) == blocks x block_size``."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self.events: list[CacheEvent] = []
        self.live: dict[Hashable, Hashable] = {}  # stored and not removed: hash -> namespace

    def __call__(self, event: CacheEvent) -> None:
        self.events.append(event)
        if isinstance(event, BlockStored):
            assert event.block_size == self.block_size
            assert len(event.token_ids) == len(event.block_hashes) * self.block_size > 0
            assert all(type(t) is int for t in event.token_ids)
            assert event.parent_block_hash is None or event.parent_block_hash in self.live
            for h in event.block_hashes:
                assert h not in self.live, "stored twice without a removal"
                self.live[h] = event.namespace
        elif isinstance(event, BlockRemoved):
            assert event.block_hashes
            for h in event.block_hashes:
                assert self.live.pop(h) == event.namespace, "removed under another namespace"
        else:
            assert isinstance(event, AllBlocksCleared)
            self.live.clear()

    def take(self) -> list[CacheEvent]:
        out, self.events = self.events, []
        return out


@dataclass
class Running:
    tokens: list[int]
    namespace: Hashable
    slots: np.ndarray
    cached: int
    node: Any


class Driver:
    """Random requests through the lifecycle helpers (what the engine and simulator do), on one cache."""

    def __init__(self, cache: Any, page: int, rng: random.Random):
        self.cache, self.rng = cache, rng
        self.alloc = SlotAllocator(CAPACITY, page_size=page)
        self.running: list[Running] = []
        self.seen: list[tuple[Hashable, tuple[int, ...]]] = []  # every sequence inserted or asked for

    def tokens(self) -> list[int]:
        rng = self.rng
        if self.seen and rng.random() < 0.6:  # extend or cut a sequence seen before: shared prefixes
            base = list(rng.choice(self.seen)[1])[: rng.randint(0, 16)]
        else:
            base = []
        return base + [rng.randrange(ALPHABET) for _ in range(rng.randint(0, 10))]

    def make_room(self, n: int) -> bool:
        if self.alloc.num_free < n:
            self.alloc.free(self.cache.evict(n - self.alloc.num_free))
        return self.alloc.num_free >= n

    def step(self) -> str:
        ops = {"match": 3, "serve": 5, "start": 3, "commit": 3, "finish": 3, "evict": 2, "unlock_all": 1, "reset": 1}
        op = self.rng.choices(list(ops), weights=list(ops.values()))[0]
        getattr(self, op)()
        return op

    def match(self) -> None:
        self.cache.match_prefix(self.tokens(), self.rng.choice(NAMESPACES))

    def serve(self) -> None:
        ns, prompt = self.rng.choice(NAMESPACES), self.tokens()
        output = [self.rng.randrange(ALPHABET) for _ in range(self.rng.randint(0, 6))]
        self.seen.append((ns, tuple(prompt + output[:-1])))
        try:
            serve_once(self.cache, self.alloc, prompt, output, ns)
        except OutOfSlotsError:
            pass

    def start(self) -> None:
        ns, prompt = self.rng.choice(NAMESPACES), self.tokens()
        m = self.cache.match_prefix(prompt[: max(len(prompt) - 1, 0)], ns)
        self.cache.lock(m.node)
        if not self.make_room(len(prompt) - m.length):
            self.cache.unlock(m.node)
            return
        slots = np.concatenate([m.indices, self.alloc.alloc(len(prompt) - m.length)])
        self.running.append(Running(prompt, ns, slots, m.length, m.node))

    def commit(self) -> None:
        """A running request decodes a few tokens and caches what it computed so far."""
        if not self.running:
            return
        r = self.rng.choice(self.running)
        extra = [self.rng.randrange(ALPHABET) for _ in range(self.rng.randint(1, 5))]
        if not self.make_room(len(extra)):
            return
        r.slots = np.concatenate([r.slots, self.alloc.alloc(len(extra))])
        r.tokens = r.tokens + extra
        self.seen.append((r.namespace, tuple(r.tokens)))
        r.node, r.cached, r.slots = commit_prefix(self.cache, self.alloc, r.tokens, r.slots, r.cached, r.node,
                                                  r.namespace)

    def finish(self) -> None:
        if self.running:
            r = self.running.pop(self.rng.randrange(len(self.running)))
            self.seen.append((r.namespace, tuple(r.tokens)))
            release_sequence(self.cache, self.alloc, r.tokens, r.slots, r.cached, r.node, r.namespace)

    def evict(self) -> None:
        self.alloc.free(self.cache.evict(self.rng.choice([1, 4, 9, 40])))

    def unlock_all(self) -> None:
        """The caller's books are lost: every lock dropped, the requests' own slots freed."""
        self.cache.unlock_all()
        for r in self.running:
            self.alloc.free(r.slots[r.cached :])
        self.running.clear()

    def reset(self) -> None:
        """Finish every running request, then drop everything (cache and allocator alike)."""
        while self.running:
            self.finish()
        self.cache.reset()
        self.alloc.reset()

    def probes(self) -> list[tuple[Hashable, list[int]]]:
        """Every sequence seen lately, a prefix and a one-token variant of each, in every namespace."""
        out = []
        for ns, seq in self.seen[-25:]:
            seq = list(seq)
            out += [(ns, seq), (ns, seq[: len(seq) // 2]), (ns, seq[:-1] + [(seq[-1] + 1) % ALPHABET] if seq else [])]
            out.append((NAMESPACES[1] if ns is None else None, seq))
        return out


def check_agrees(index: KVEventIndex, replicas: dict[int, Driver]) -> None:
    """For every probe: the index's match of each replica is that replica's cache's match; block counts agree."""
    probes = [p for d in replicas.values() for p in d.probes()]
    for r, d in replicas.items():
        d.cache.check_invariants()
        assert index.num_blocks(r) * d.cache.page_size == d.cache.total_size, r
    for ns, probe in probes:
        got = index.match(probe, ns)
        want = {r: d.cache.match_prefix(probe, ns).length for r, d in replicas.items()}
        assert got == {r: n for r, n in want.items() if n}, (ns, probe, got, want)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("kind", list(CACHES))
def test_index_fed_by_events_matches_the_cache_after_every_operation(kind, seed):
    factory, page = CACHES[kind]
    cache = factory()
    index, recorder = KVEventIndex(page), Recorder(page)

    def listener(event: CacheEvent) -> None:
        recorder(event)
        index.apply(0, event)

    cache.listener = listener
    driver = Driver(cache, page, random.Random(seed))
    ops = set()
    for _ in range(120):
        ops.add(driver.step())
        check_agrees(index, {0: driver})
    assert ops >= {"serve", "evict", "commit", "reset"}
    if kind == "none":
        assert recorder.events == [] and index.num_blocks(0) == 0
    else:
        kinds = {type(e) for e in recorder.events}
        assert kinds == {BlockStored, BlockRemoved, AllBlocksCleared}, kinds


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("kinds", [("radix-page4", "hash-block4", "hash-v0-block4"), ("radix-page1",) * 3])
def test_events_fed_index_is_the_union_of_the_replicas_caches_at_every_step(kinds, seed):
    """Three caches as replicas 0, 1, 2 of one index (different caches hash blocks differently: the index
    keys blocks by content, so it does not care)."""
    rng = random.Random(seed)
    page = CACHES[kinds[0]][1]
    index = KVEventIndex(page)
    replicas: dict[int, Driver] = {}
    for r, kind in enumerate(kinds):
        cache = CACHES[kind][0]()
        cache.listener = lambda event, r=r: index.apply(r, event)
        replicas[r] = Driver(cache, page, rng)
    for _ in range(150):
        replicas[rng.randrange(len(replicas))].step()
        check_agrees(index, replicas)
    assert index.replicas == (0, 1, 2)


@pytest.mark.parametrize("kind", list(CACHES))
def test_no_listener_no_event_is_built(kind, monkeypatch):
    """With ``listener`` None nothing of the event path runs: no event, no page hash, no namespace walk."""

    def boom(*args, **kwargs):
        raise AssertionError("an event was built without a listener")

    for name in ("BlockStored", "BlockRemoved", "AllBlocksCleared", "page_states", "namespace_seed",
                 "block_hashes", "block_hash", "mix_states"):
        monkeypatch.setattr(events, name, boom)
    for cls, names in [(HashBlockCache, ("_namespace_of",)), (HashV0Cache, ("_stored",))]:
        for name in names:
            monkeypatch.setattr(cls, name, boom)
    for name in ("stored", "removed"):  # the radix tree's event builders (radixkv.cache.radix_events)
        monkeypatch.setattr(radix_module, name, boom)
    factory, page = CACHES[kind]
    cache = factory()
    driver = Driver(cache, page, random.Random(0))
    ops = {driver.step() for _ in range(200)}
    assert cache.listener is None and {"serve", "evict", "reset"} <= ops


def test_a_split_emits_nothing_and_the_new_branch_chains_from_the_split_point():
    cache, rec = RadixCache(page_size=1), Recorder(1)
    cache.listener = rec
    cache.insert([1, 2, 3, 4], [10, 11, 12, 13])
    (first,) = rec.take()
    assert first == BlockStored(first.block_hashes, None, (1, 2, 3, 4), 1, None) and len(first.block_hashes) == 4
    nodes = cache.num_nodes
    assert cache.match_prefix([1, 2, 9]).length == 2 and cache.num_nodes == nodes + 1  # split: no page changed
    assert rec.take() == []
    assert cache.insert([1, 2, 5, 6], [20, 21, 22, 23]) == 2
    (branch,) = rec.take()
    assert branch.token_ids == (5, 6) and branch.parent_block_hash == first.block_hashes[1]
    assert not set(branch.block_hashes) & set(first.block_hashes)
    assert cache.insert([1, 2, 3, 4], [30, 31, 32, 33]) == 4 and rec.take() == []  # nothing new


def test_page_hashes_name_the_prefix_however_the_tree_is_cut():
    """A page's hash depends on its prefix only: the same page stored through a split tree and through a
    single edge gets the same hash (and so the same parent for what comes after)."""
    one, two = RadixCache(page_size=2), RadixCache(page_size=2)
    rec_one, rec_two = Recorder(2), Recorder(2)
    one.listener, two.listener = rec_one, rec_two
    one.insert([1, 2, 3, 4, 5, 6], list(range(6)))
    two.insert([1, 2, 7, 7], list(range(4)))
    two.insert([1, 2, 3, 4, 5, 6], list(range(10, 16)))
    assert set(rec_one.live) <= set(rec_two.live)
    assert rec_two.events[-1].parent_block_hash == rec_one.events[0].block_hashes[0]


def stored_prefixes(stored: list[CacheEvent]) -> dict[Hashable, list[int]]:
    """Each stored block's whole prefix, rebuilt from the events alone (parent links and token ids)."""
    prefix: dict[Hashable, list[int]] = {}
    for e in stored:
        before = [] if e.parent_block_hash is None else prefix[e.parent_block_hash]
        for i, h in enumerate(e.block_hashes):
            prefix[h] = before + list(e.token_ids[: (i + 1) * e.block_size])
    return prefix


@pytest.mark.parametrize("kind", ["radix-page1", "radix-page4", "hash-block4", "hash-v0-block4"])
def test_evict_emits_exactly_the_evicted_pages(kind):
    """After each evict the removed hashes are exactly the stored pages the cache no longer matches, and as
    many pages as slots came back."""
    factory, page = CACHES[kind]
    cache, rec = factory(), Recorder(page)
    cache.listener = rec
    slot = 0
    for seq in ([0] * 12, [0] * 4 + [1] * 8, [0] * 4 + [1] * 4 + [2] * 8, [3] * 8):
        cache.insert(seq, list(range(slot, slot + len(seq))))
        slot += len(seq)
    prefix = stored_prefixes(rec.take())
    assert len(prefix) * page == cache.total_size
    gone: set[Hashable] = set()
    for n in (1, page + 1, 8, 1, 100):
        freed = cache.evict(n)
        removed = [h for e in rec.take() for h in e.block_hashes]
        assert len(removed) * page == len(freed) and not gone & set(removed)
        gone |= set(removed)
        still = {h for h, p in prefix.items() if cache.match_prefix(p).length == len(p)}
        assert gone == set(prefix) - still
    assert cache.total_size == 0 and not rec.live


@pytest.mark.parametrize("kind", ["radix-page1", "radix-page4", "hash-block4", "hash-v0-block4"])
def test_reset_emits_all_blocks_cleared_and_keeps_the_listener(kind):
    factory, page = CACHES[kind]
    cache, rec = factory(), Recorder(page)
    cache.listener = rec
    cache.reset()
    assert rec.take() == [AllBlocksCleared()]
    cache.insert(list(range(8)), list(range(8)), "ns")
    (stored,) = rec.take()
    assert len(stored.token_ids) == len(stored.block_hashes) * page == 8 and stored.namespace == "ns"
    cache.reset()
    assert rec.take() == [AllBlocksCleared()] and cache.listener is rec


def test_no_prefix_cache_never_emits():
    cache, rec = NoPrefixCache(), Recorder(1)
    cache.listener = rec
    assert serve_once(cache, SlotAllocator(16), [1, 2, 3], [4, 5]) == 0
    cache.evict(10)
    cache.reset()
    assert rec.events == [] and cache.listener is rec


def test_hash_block_removals_name_their_namespace_along_a_deep_chain():
    """HashBlockCache finds a removed block's namespace from its chain's seed (children first, one walk)."""
    cache, rec = HashBlockCache(block_size=2, hash_algo="builtin"), Recorder(2)
    cache.listener = rec
    for ns in NAMESPACES:
        cache.insert(list(range(40)), list(range(0 if ns is None else 40, 40 if ns is None else 80)), ns)
    rec.take()
    cache.evict(1000)
    removed = rec.take()
    assert len(removed) == 40 and {e.namespace for e in removed} == set(NAMESPACES) and not rec.live


def test_hash_v0_stranding_and_revival_agree_with_the_index():
    """v0 can evict a parent before its child (stamps set by hand): the child stays but is unreachable, in
    the cache and in the index; re-inserting the prefix strands it (removed) and stores the caller's copy."""
    cache, alloc, index, rec = HashV0Cache(block_size=4), SlotAllocator(64), KVEventIndex(4), Recorder(4)
    cache.listener = lambda event: (rec(event), index.apply(0, event))
    tokens = list(range(8))
    cache.insert(tokens, alloc.alloc(8))
    child = cache._blocks[(cache.hash_of_block(tokens, 1)[0], None)]
    cache._clock += 1
    cache._touch([child])  # the child alone made more recent than its parent (no public call does that)
    alloc.free(cache.evict(1))
    assert cache.stranded() == 1 and index.num_blocks(0) == cache.num_blocks == 1
    assert index.match(tokens) == {} and cache.match_prefix(tokens).length == 0
    rec.take()
    assert cache.insert(tokens, alloc.alloc(8)) == 0
    removed, stored = rec.take()
    assert removed == BlockRemoved(((child.key, None),), None)
    assert len(stored.block_hashes) == 2 and stored.block_hashes[1] == (child.key, None)
    assert index.match(tokens) == {0: 8} == {0: cache.match_prefix(tokens).length}
    assert index.num_blocks(0) == cache.num_blocks == 2


def test_belady_tree_emits_like_the_radix_tree():
    seqs = [np.arange(6), np.array([0, 1, 9, 9])]
    cache = RadixCache(page_size=1, eviction_policy=Belady(FutureUses([(s, None) for s in seqs])))
    index = KVEventIndex(1)
    cache.listener = lambda event: index.apply(0, event)
    for i, s in enumerate(seqs):
        cache.insert(s, np.arange(10 * i, 10 * i + len(s)))
    assert index.match(np.arange(6)) == {0: 6} and index.match([0, 1, 9, 9, 9]) == {0: 4}
    cache.evict(2)
    assert index.num_blocks(0) == cache.total_size
    assert index.match(np.arange(6)).get(0, 0) == cache.match_prefix(np.arange(6)).length


def test_index_rejects_and_tolerates():
    index = KVEventIndex(2)
    with pytest.raises(ValueError):
        index.apply(0, BlockStored((1,), None, (1, 2, 3, 4), 4))  # another block size
    with pytest.raises(ValueError):
        index.apply(0, BlockStored((1, 2), None, (1, 2), 2))  # tokens for one block, two hashes
    with pytest.raises(TypeError):
        index.apply(0, "not an event")
    with pytest.raises(ValueError):
        KVEventIndex(0)
    index.apply(0, BlockRemoved(("never stored",)))  # ignored
    index.apply(0, BlockStored(("orphan",), "unknown parent", (1, 2), 2))  # kept, but unreachable
    assert index.num_blocks(0) == 1 and index.match([1, 2]) == {}
    index.apply(1, BlockStored(("a", "b"), None, (1, 2, 3, 4), 2, "ns"))
    assert index.match([1, 2, 3, 4], "ns") == {1: 4} and index.match([1, 2, 3, 4]) == {}
    index.apply(1, AllBlocksCleared())
    index.apply(0, BlockRemoved(("orphan",)))
    assert index.match([1, 2, 3, 4], "ns") == {} and index.num_blocks(0) == index.num_blocks(1) == 0
    assert index.replicas == (0, 1) and not index._holders


def test_page_hashes_are_the_documented_polynomial():
    """The vectorized uint64 hash is P_k = P_(k-1) * B + t mod 2^64 from the start state, one per page end."""
    base, mod = 0x9E3779B97F4A7C15, 1 << 64
    tokens = np.array([2**63 - 1, -1, 0, 5, 7, 31999, 3, 3], dtype=np.int64)
    state, want = (1 << 64) - 1, []
    for i, t in enumerate(tokens.tolist()):
        state = (state * base + t % mod) % mod
        if i % 2 == 1:
            want.append(state)
    got = events.page_states((1 << 64) - 1, tokens, 2)
    assert got.tolist() == want
    assert events.block_hashes(got)[-1] == events.block_hash(want[-1]) and len(set(events.block_hashes(got))) == 4
