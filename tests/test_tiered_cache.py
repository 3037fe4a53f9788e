"""The hierarchical prefix cache (``radixkv.cache.tiered``): a device tier over host and storage tiers.

Every test drives ``TieredCache`` through a ``Rig``: each tier has a KV array (one int64 per slot) and a
``mover`` that really copies between them. A token's "KV" is a fingerprint of its namespace and its whole
prefix, written into the device array when the test "computes" it; every allocator poisons the slots it
frees. So a copy that reads freed KV, a tier entry whose slot never got its copy, a load into the wrong
slots or a lower tier that hands out a slot it still holds all show up as a wrong value.

Covered, for a radix device at pages of 1 and 4 and a hash device at blocks of 4, under every write policy:
named unit tests of the writes, loads, locks and capacities; host copies equal device copies after random
operations; a mover that fails on its k-th copy, then recovery; a Hypothesis state machine against a naive
model; and the simulator's tiers (hit rates by tier, load time in TTFT, a store shared across replicas).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from radixkv import HashBlockCache, RadixCache, SlotAllocator
from radixkv.cache.base import NO_HINTS, LockError, as_token_array
from radixkv.cache.events import BlockStored
from radixkv.cache.eviction import POLICIES
from radixkv.cache.hash_v0 import HashV0Cache
from radixkv.cache.lifecycle import commit_prefix, release_sequence
from radixkv.cache.segments import TIER_KINDS, Segment, SegmentTier
from radixkv.cache.segments import prefix_digest as segment_digest
from radixkv.cache.tiered import WRITE_POLICIES, Copy, Tier, TieredCache
from radixkv.cache.tiers import HOST_LAYOUTS
from radixkv.sim import CostModel, simulate, simulate_cluster
from radixkv.workloads import Request, make

KINDS = {"radix-p1": ("radix", 1), "radix-p4": ("radix", 4), "hash-b4": ("hash", 4)}
NAMESPACES = (None, "b")
POISON = -1  # what a freed slot holds; fingerprints are >= 0
GARBAGE = -7  # what a failed copy leaves in the slots it did not reach
_MOD = (1 << 61) - 1


def make_cache(kind: str, eviction: str = "lru") -> Any:
    name, page = KINDS[kind]
    return RadixCache(page_size=page, eviction_policy=eviction) if name == "radix" else \
        HashBlockCache(block_size=page, eviction_policy=eviction)


def _step(h: int, token: int) -> int:
    return (h * 1_000_003 + token + 7) % _MOD


def fingerprints(namespace: Any, tokens: Any) -> np.ndarray:
    """The KV of each token of ``tokens``: a hash of the namespace and the whole prefix through it."""
    h, out = zlib.crc32(repr(namespace).encode()) + 1, []
    for t in as_token_array(tokens).tolist():
        h = _step(h, t)
        out.append(h)
    return np.array(out, dtype=np.int64)


class MoverFault(RuntimeError):
    """The injected failure of a copy."""


class KVAllocator(SlotAllocator):
    """A ``SlotAllocator`` whose freed slots are poisoned in its tier's KV array."""

    def __init__(self, num_slots: int, page_size: int, kv: np.ndarray):
        super().__init__(num_slots, page_size)
        self.kv = kv

    def free(self, indices: Any) -> None:
        idx = as_token_array(indices)
        super().free(idx)
        self.kv[idx] = POISON


def walk(tree: dict, prefix: tuple = (), h: int = 0):
    """``(prefix through a token, its slot, its fingerprint)`` for every token of a ``to_dict`` snapshot."""
    for child in tree["children"]:
        p, hh = prefix, h
        for tok, slot in zip(child["tokens"], child["indices"], strict=True):
            p, hh = (*p, tok), _step(hh, tok)
            yield p, slot, hh
        yield from walk(child, p, hh)


class Rig:
    """A ``TieredCache`` over a device ``SlotAllocator``, with a KV array per tier and a copying ``mover``.

    The caller holds no slots between operations but the cached ones its locks protect, so at rest: device
    free + evictable + locked == capacity. ``inserted`` is the naive model: every page-aligned prefix ever
    computed and inserted, per namespace."""

    def __init__(self, kind: str, policy: str = "write_through", *, device: int = 32, host: int = 24,
                 storage: int = 0, threshold: int = 2, worth_loading: Any = None, eviction: str = "lru",
                 layout: str = "prefix"):
        self.kind, self.policy, self.ps = kind, policy, KINDS[kind][1]
        sizes = {"device": device, "host": host, "storage": storage}
        self.kv = {name: np.full(max(n, 1), POISON, dtype=np.int64) for name, n in sizes.items()}
        self.alloc = KVAllocator(device, self.ps, self.kv["device"])
        kind_of_tier = TIER_KINDS[layout]
        tiers = [kind_of_tier(name, make_cache(kind, eviction), KVAllocator(sizes[name], self.ps, self.kv[name]))
                 for name in ("host", "storage") if sizes[name]]
        self.cache = TieredCache(make_cache(kind, eviction), tiers, policy, threshold, worth_loading, self.move)
        self.device = self.cache.device
        self.fail_at: int | None = None  # the number of the copy that fails (1-based)
        self.moved = 0
        self.inserted: set[tuple] = set()
        self.history: dict[tuple, np.ndarray] = {}  # (namespace, tokens) of every computed sequence

    def tier(self, name: str) -> Tier:
        return next(t for t in self.cache.tiers if t.name == name)

    @property
    def host(self) -> Tier:
        return self.tier("host")

    # ------------------------------------------------------------ the mover
    def move(self, copy: Copy) -> None:
        assert isinstance(copy, Copy) and copy.src != copy.dst and "device" in (copy.src, copy.dst)
        assert len(copy.src_slots) == len(copy.dst_slots) == len(copy) > 0
        assert copy.src_slots.dtype == copy.dst_slots.dtype == np.int64
        assert len(copy) % self.ps == 0, f"{copy} copies part of a page"
        src = self.kv[copy.src][copy.src_slots]
        assert (src != POISON).all(), f"{copy} reads freed KV"
        self.moved += 1
        if self.moved == self.fail_at:
            half = len(copy) // 2
            self.kv[copy.dst][copy.dst_slots[:half]] = src[:half]
            self.kv[copy.dst][copy.dst_slots[half:]] = GARBAGE
            raise MoverFault(f"copy {self.moved} failed half way")
        self.kv[copy.dst][copy.dst_slots] = src

    # ------------------------------------------------------------ the caller's steps
    def evict(self, n: int) -> np.ndarray:
        freed = self.cache.evict(n)
        assert not set(freed.tolist()) & set(self.device.held_slots().tolist()), "evict returned held slots"
        self.alloc.free(freed)
        return freed

    def make_room(self, n: int) -> bool:
        need = -(-n // self.ps) * self.ps
        if self.alloc.num_free < need:
            self.evict(need - self.alloc.num_free)
        return self.alloc.num_free >= need

    def compute(self, namespace: Any, tokens: np.ndarray, start: int) -> np.ndarray:
        """Fresh device slots for ``tokens[start:]`` holding their KV (the model ran); the room is made."""
        fresh = self.alloc.alloc(len(tokens) - start)
        self.kv["device"][fresh] = fingerprints(namespace, tokens)[start:]
        L = self.device.cacheable_length(len(tokens))
        self.inserted.update((namespace, tuple(tokens[:k].tolist())) for k in range(self.ps, L + 1, self.ps))
        self.history[(namespace, tuple(tokens.tolist()))] = tokens
        return fresh

    def put(self, tokens: Any, namespace: Any = None, known: int | None = None) -> bool:
        """A finished request: match (using ``known`` of the match, to make duplicates), lock, compute the
        rest, insert, free the duplicates and the tail, unlock (``release_sequence``). False: no room."""
        tokens = as_token_array(tokens)
        m = self.cache.match_prefix(tokens, namespace)
        self.check_content("device", namespace, tokens, m.indices)
        k = m.length if known is None else min(known, m.length)
        mine = m if k == m.length else self.cache.match_prefix(tokens[:k], namespace)
        self.cache.lock(mine.node)
        if not self.make_room(len(tokens) - k):
            self.cache.unlock(mine.node)
            return False
        slots = np.concatenate([mine.indices, self.compute(namespace, tokens, k)])
        release_sequence(self.cache, self.alloc, tokens, slots, k, mine.node, namespace)
        return True

    def match_and_load(self, tokens: Any, namespace: Any = None, cancel: bool = False) -> tuple[Any, dict]:
        """Match and lock, then extend the match from the lower tiers (evicting device entries first when
        short of slots) or cancel the plan: the match now held (locked) and the plan's tokens by tier."""
        tokens = as_token_array(tokens)
        m = self.cache.match_prefix(tokens, namespace)
        self.check_content("device", namespace, tokens, m.indices)
        self.cache.lock(m.node)
        plan = self.cache.plan_load(tokens, m, namespace)
        by_tier = plan.by_tier()
        assert plan.match is m and sum(by_tier.values()) == m.length + plan.length
        assert plan.length % self.ps == 0 and m.length + plan.length <= len(tokens)
        for tier, tm, start, stop in plan.parts:  # what the plan reads is locked and holds its KV
            assert tier.cache.protected_size >= stop - own_start(tm) and stop > start
            self.check_content(tier.name, namespace, tokens, tm.indices, own_start(tm))
        if not plan.length:
            return m, by_tier
        if cancel or not self.make_room(plan.length):
            self.cache.cancel(plan)
            assert not plan.parts and all(t.cache.protected_size == 0 for t in self.cache.tiers)
            return m, {"device": m.length}
        slots = self.alloc.alloc(plan.length)
        new = self.cache.load(plan, slots)
        assert new.length == m.length + len(slots)
        assert new.indices[: m.length].tolist() == m.indices.tolist()
        assert new.indices[m.length :].tolist() == slots.tolist()
        self.check_content("device", namespace, tokens, new.indices)
        return new, by_tier

    def recover(self) -> None:
        """What ``Scheduler.recover`` does after a failure: every lock goes, the books follow the caches."""
        self.cache.unlock_all()
        self.alloc.retain(self.cache.held_slots())

    # ------------------------------------------------------------ checks
    def check_content(self, name: str, namespace: Any, tokens: np.ndarray, indices: np.ndarray,
                      start: int = 0) -> None:
        """The slots of a match (from ``start``: a segment's) hold the KV of the prefix they were matched for."""
        got = self.kv[name][np.asarray(indices[start:], dtype=np.int64)]
        np.testing.assert_array_equal(got, fingerprints(namespace, tokens[: len(indices)])[start:],
                                      err_msg=f"{name} slots hold the wrong KV")

    def segments(self, tier: Tier) -> list[tuple[Any, Any, tuple, int]]:
        """A ``SegmentTier``'s segments: (its namespace, the original one, the prefix before it from the
        history of computed sequences, that prefix's fingerprint state)."""
        out = []
        for ns, starts in getattr(tier, "_starts", {}).items():
            for p, digests in starts.items():
                for d in digests:
                    key = Segment(ns, p, d)
                    if tier.cache.root_of(key) is None:
                        continue
                    prefix = next(tuple(t[:p].tolist()) for (n, _), t in self.history.items()
                                  if n == ns and len(t) >= p and segment_digest(t[:p]) == d)
                    h = zlib.crc32(repr(ns).encode()) + 1
                    for tok in prefix:
                        h = _step(h, tok)
                    out.append((key, ns, prefix, h))
        return out

    def check(self, locked: int = 0) -> None:
        """Every invariant at rest: each cache's own, no slot lost or held twice in any tier (``locked``
        device tokens under the caller's locks, none in a lower tier), every cached token of every tier holds
        the KV of its prefix, and every cached prefix was once inserted (nothing invented)."""
        c = self.cache
        c.check_invariants()
        self.alloc.check_invariants()
        assert c.protected_size == self.device.protected_size == locked
        assert self.alloc.num_free + c.evictable_size + c.protected_size == self.alloc.capacity
        for t in c.tiers:
            t.allocator.check_invariants()
            assert t.allocator.num_free + t.cache.total_size == t.allocator.capacity, t.name
            assert t.cache.protected_size == 0, f"{t.name} still locked"
        for name, cache in [("device", self.device)] + [(t.name, t.cache) for t in c.tiers]:
            count = 0
            roots = [(ns, ns, (), zlib.crc32(repr(ns).encode()) + 1) for ns in NAMESPACES]
            for key, ns, p0, h0 in roots + (self.segments(self.tier(name)) if name != "device" else []):
                for prefix, slot, fp in walk(cache.to_dict(key), p0, h0):
                    count += 1
                    assert self.kv[name][slot] == fp, f"{name} slot {slot} of {ns!r} {prefix} holds the wrong KV"
                    if len(prefix) % self.ps == 0:
                        assert (ns, prefix) in self.inserted, f"{name} invented {ns!r} {prefix}"
            assert count == cache.total_size, f"{name}: entries outside the known namespaces"

    def check_host_equals_device(self) -> None:
        """Every token cached in the device tree and a lower tier (each looked up with ``match_prefix`` on
        that tier's cache) holds the same KV in both, and it is the KV of its prefix."""
        for (ns, _), tokens in self.history.items():
            dm = self.device.match_prefix(tokens, ns)
            self.check_content("device", ns, tokens, dm.indices)
            for t in self.cache.tiers:
                for tm in t.find(tokens, ns, NO_HINTS, 0, 0):
                    a, n = own_start(tm), min(dm.length, tm.length)
                    np.testing.assert_array_equal(self.kv["device"][dm.indices[a:n]],
                                                  self.kv[t.name][tm.indices[a:n]])
                    self.check_content(t.name, ns, tokens, tm.indices, a)


def own_start(match: Any) -> int:
    """Where a lower tier's match starts holding slots: 0, or a segment's start (its indices before are -1)."""
    return int(np.argmax(match.indices >= 0)) if len(match.indices) else 0


def write_down(rig: Rig, tokens: Any, namespace: Any = None) -> None:
    """Cache ``tokens`` and get them written down under the rig's policy, then empty the device tier."""
    assert rig.put(tokens, namespace)
    if rig.policy == "write_through_selective":
        for _ in range(rig.cache.write_threshold):
            reuse(rig, tokens, namespace)
    rig.evict(10**6)  # write_back copies here
    assert rig.device.total_size == 0


def reuse(rig: Rig, tokens: Any, namespace: Any = None) -> None:
    """An admission reusing the device's match of ``tokens``: lock, plan a load and cancel it, count the reuse
    (``admitted``, as the scheduler does at a request's first admission), unlock."""
    m = rig.cache.match_prefix(tokens, namespace)
    rig.cache.lock(m.node)
    rig.cache.cancel(rig.cache.plan_load(tokens, m, namespace))
    rig.cache.admitted(tokens, m, namespace)
    rig.cache.unlock(m.node)


def copied(rig: Rig, src: str, dst: str) -> list[Copy]:
    return [c for c in rig.cache.take_copies() if (c.src, c.dst) == (src, dst)]


kinds = pytest.mark.parametrize("kind", list(KINDS))
policies = pytest.mark.parametrize("policy", WRITE_POLICIES)
# every cache kind in the prefix layout, and the radix ones in segments and chains (``SegmentTier``, ``ChainTier``)
layouts = pytest.mark.parametrize("kind, layout", [(k, "prefix") for k in KINDS] +
                                  [(k, lay) for k in KINDS if KINDS[k][0] == "radix" for lay in ("segments", "chains")])


# ==================================================================== construction
@kinds
def test_constructor_rejects_what_it_cannot_run(kind):
    tier = Tier("host", make_cache(kind), SlotAllocator(8, KINDS[kind][1]))
    with pytest.raises(ValueError, match="write_policy"):
        TieredCache(make_cache(kind), [tier], "write_around")
    for bad in (0, True, 1.5):
        with pytest.raises(ValueError, match="write_threshold"):
            TieredCache(make_cache(kind), [tier], "write_through_selective", bad)
    with pytest.raises(ValueError, match="lower tier"):
        TieredCache(make_cache(kind), [])
    with pytest.raises(ValueError, match="lower tier"):
        TieredCache(RadixCache(page_size=2), [tier])
    with pytest.raises(ValueError, match="page"):
        Tier("host", make_cache(kind), SlotAllocator(8, 2))
    with pytest.raises(ValueError, match="chunk and request ends"):
        TieredCache(HashV0Cache(block_size=KINDS[kind][1]), [tier])


# ==================================================================== writes
@kinds
def test_write_through_copies_on_insert(kind):
    rig = Rig(kind, "write_through")
    toks = np.arange(10)
    L = rig.device.cacheable_length(10)
    assert rig.put(toks)
    (copy,) = rig.cache.take_copies()
    dm, hm = rig.device.match_prefix(toks), rig.host.cache.match_prefix(toks)
    assert (copy.src, copy.dst) == ("device", "host") and dm.length == hm.length == L
    assert len(copy.src_slots) == len(copy.dst_slots) == L
    assert copy.src_slots.tolist() == dm.indices.tolist() and copy.dst_slots.tolist() == hm.indices.tolist()
    np.testing.assert_array_equal(rig.kv["host"][hm.indices], rig.kv["device"][dm.indices])
    assert rig.cache.written_tokens == {"host": L} and rig.cache.loaded_tokens == {"host": 0}
    assert rig.put(toks) and rig.cache.take_copies() == []  # the host holds it already
    longer = np.arange(18)
    L2 = rig.device.cacheable_length(18)
    assert rig.put(longer)
    (copy,) = rig.cache.take_copies()  # only the new pages
    assert copy.src_slots.tolist() == rig.device.match_prefix(longer).indices[L:L2].tolist()
    assert rig.host.cache.match_prefix(longer).length == L2 and len(copy) == L2 - L
    assert rig.cache.stats()["tier_tokens"] == {"device": L2, "host": L2}
    rig.check()


@kinds
def test_write_back_copies_only_on_device_eviction(kind):
    rig = Rig(kind, "write_back")
    a, b = np.array([1, 2, 3, 4, 5, 6, 7, 8]), np.array([1, 2, 3, 4, 9, 9, 9, 9])
    assert rig.put(a) and rig.put(b)
    for _ in range(3):
        rig.cache.match_prefix(a)
    assert rig.cache.take_copies() == [] and rig.host.cache.total_size == 0
    a_own = rig.device.match_prefix(a).indices[4:].tolist()
    m = rig.device.match_prefix(b)  # b is now the most recent: a's own pages go first (both caches)
    freed = rig.evict(1)
    assert sorted(freed.tolist()) == sorted(a_own)
    assert rig.device.match_prefix(b).indices.tolist() == m.indices.tolist()
    copies = rig.cache.take_copies()
    assert all((c.src, c.dst) == ("device", "host") for c in copies) and sum(map(len, copies)) == 8
    assert rig.host.cache.match_prefix(a).length == 8  # the evicted entry's whole prefix
    assert rig.host.cache.match_prefix(b).length == 4
    rig.check()
    rig.evict(10**6)
    assert sum(map(len, rig.cache.take_copies())) == 4  # b's own pages; the shared ones are there
    assert rig.host.cache.match_prefix(b).length == 8 and rig.host.cache.total_size == 12
    assert rig.cache.written_tokens == {"host": 12}
    rig.check()


@kinds
@pytest.mark.parametrize("threshold", [1, 3])
def test_write_through_selective_copies_at_the_threshold(kind, threshold):
    rig = Rig(kind, "write_through_selective", threshold=threshold)
    toks = np.arange(12)
    assert rig.put(toks)  # its insertion is the first hit (SGLang's count): at threshold 1, write_through
    if threshold > 1:
        assert rig.cache.take_copies() == []
        for _ in range(3):  # lookups are not reuses: only admissions count
            assert rig.cache.match_prefix(toks).length == 12
        assert rig.cache.take_copies() == []
        for _ in range(threshold - 2):
            reuse(rig, toks)
            assert rig.cache.take_copies() == [] and rig.host.cache.total_size == 0
        reuse(rig, toks)
    (copy,) = rig.cache.take_copies()
    assert (copy.src, copy.dst, len(copy)) == ("device", "host", 12)
    assert rig.host.cache.match_prefix(toks).length == 12
    reuse(rig, toks)
    reuse(rig, toks[:8])
    assert rig.cache.take_copies() == []  # written once
    rig.check()


@kinds
@policies
def test_a_small_host_tier_takes_the_whole_pages_that_fit(kind, policy):
    rig = Rig(kind, policy, host=10)
    toks = np.arange(14)
    write_down(rig, toks)
    cap = rig.host.allocator.capacity  # 10 slots, or 8 in whole pages of 4
    hm = rig.host.cache.match_prefix(toks)
    assert hm.length == min(rig.device.cacheable_length(14), cap) and hm.length % rig.ps == 0
    assert rig.host.cache.total_size == hm.length
    copies = copied(rig, "device", "host")
    assert sum(map(len, copies)) == hm.length and all(len(c) % rig.ps == 0 for c in copies)
    rig.check()


@kinds
def test_host_eviction_spares_the_path_it_extends(kind):
    """A write that must evict to fit finds only the path it extends evictable: the tier's store locks that
    path, so it keeps it and adds what fits after it (without the lock it would free the slots it builds on)."""
    rig = Rig(kind, "write_through", host=12)
    a = np.arange(8)
    assert rig.put(a)
    a_slots = rig.host.cache.match_prefix(a).indices.tolist()
    rig.cache.take_copies()
    longer = np.arange(16)
    assert rig.put(longer)
    (copy,) = rig.cache.take_copies()
    assert len(copy) == 4 and not set(copy.dst_slots.tolist()) & set(a_slots)
    hm = rig.host.cache.match_prefix(longer)
    assert hm.length == 12 and hm.indices[:8].tolist() == a_slots
    rig.check()
    # full, and only the path itself evictable: nothing is evicted, nothing written
    assert rig.put(np.arange(20)) and rig.cache.take_copies() == []
    assert rig.host.cache.match_prefix(longer).indices.tolist() == hm.indices.tolist()
    rig.check()


@kinds
def test_host_eviction_frees_other_entries_for_a_write(kind):
    rig = Rig(kind, "write_through", host=12)
    a, other = np.arange(8), np.array([50, 51, 52, 53])
    assert rig.put(a) and rig.put(other)
    assert rig.host.allocator.num_free == 0
    assert rig.put(np.arange(16))  # needs 8: evicts `other` only, then 4 fit
    assert rig.host.cache.match_prefix(np.arange(16)).length == 12
    assert rig.host.cache.match_prefix(other).length == 0
    rig.check()


# whose orders rank a demoted copy first (``continuum`` and ``infercept`` are ``session`` with other holds)
EXCLUSIVE_POLICIES = ("lru", "ttl", "session", "continuum", "infercept")


@kinds
@pytest.mark.parametrize("policy", ["write_through", "write_back"])
@pytest.mark.parametrize("eviction", EXCLUSIVE_POLICIES)
def test_the_host_drops_copies_the_device_holds_first(kind, policy, eviction):
    """The lower tier stays nearly exclusive: its copies of what the device holds are demoted and go first,
    a device eviction writes down what the host dropped, and a write_through copy never displaces a prefix
    only the host keeps. Device and host of 16 then keep three 8-token prefixes (inclusive tiers: two). Under
    ``ttl`` and ``session`` too: a held copy the device holds goes before a held prefix only the host keeps
    (these tiers were inclusive, and an agent replay's host held half duplicates)."""
    rig = Rig(kind, policy, device=16, host=16, eviction=eviction)
    assert rig.host.exclusive
    a, b, c = (np.arange(8) + 100 * k for k in range(1, 4))
    assert rig.put(a) and rig.put(b)
    assert rig.put(c)  # the device evicts a (least recent): its copy becomes the host's own
    assert rig.device.match_prefix(a).length == 0 and rig.host.cache.match_prefix(a).length == 8
    for p in (b, c):
        assert rig.device.match_prefix(p).length == 8
    rig.check()
    rig.evict(8)  # b leaves the device: written down again where the host dropped it, c's spare copy goes
    assert rig.host.cache.match_prefix(a).length == rig.host.cache.match_prefix(b).length == 8
    assert rig.host.cache.match_prefix(c).length == 0 and rig.device.match_prefix(c).length == 8
    rig.check()
    rig.check_host_equals_device()


radix_kinds = pytest.mark.parametrize("kind", [k for k in KINDS if KINDS[k][0] == "radix"])


@radix_kinds
def test_segments_keep_the_tail_the_device_dropped_not_its_prefix(kind):
    """Under write_back the device drops a tail whose prefix it keeps: a segment tier of 8 takes the tail and
    a load reads it after the device's match; a prefix tier of 8 spends itself on the prefix instead."""
    a = np.arange(8)
    longer = np.concatenate([a, np.full(8, 50)])
    for layout, host_has in (("segments", 8), ("prefix", 0)):
        rig = Rig(kind, "write_back", device=16, host=8, layout=layout)
        assert rig.put(a) and rig.put(longer)
        rig.evict(8)  # the leaf, longer's tail
        assert rig.device.match_prefix(longer).length == 8
        m, by_tier = rig.match_and_load(longer)
        assert by_tier == {"device": 8, **({"host": host_has} if host_has else {})}, layout
        rig.cache.unlock(m.node)
        rig.check()


@radix_kinds
@pytest.mark.parametrize("layout, kept", [("chains", 24), ("segments", 32)])
def test_a_chain_tier_keeps_a_context_written_back_again_once(kind, layout, kept):
    """A context loaded from the tier, grown and written back whole: a ``ChainTier`` continues the chain it
    has (each token kept once, 24), a ``SegmentTier`` writes the whole context again from the tier's own
    match in the namespace on (its segment from 8 stays: 8 tokens twice, 32)."""
    a, b, c = np.arange(8), np.full(8, 50), np.full(8, 60)
    rig = Rig(kind, "write_back", device=32, host=32, layout=layout)
    assert rig.put(a) and rig.put(np.concatenate([a, b]))
    rig.evict(8)  # the tail: a segment from 8
    rig.evict(8)  # then the prefix, from 0
    assert rig.host.cache.total_size == 16
    m, by_tier = rig.match_and_load(np.concatenate([a, b, c]))  # 16 from the host
    assert by_tier == {"device": 0, "host": 16}
    rig.cache.unlock(m.node)
    assert rig.put(np.concatenate([a, b, c]))  # grown by 8
    rig.evict(24)  # all of it, written back from 0
    assert rig.host.cache.total_size == kept
    m, by_tier = rig.match_and_load(np.concatenate([a, b, c, [1]]))
    assert by_tier == {"device": 0, "host": 24}
    rig.cache.unlock(m.node)
    rig.check()


@radix_kinds
def test_a_segment_write_makes_nodes_of_at_most_node_tokens(kind):
    """A context written whole lands in nodes of node_tokens, so making room frees no more than a node over."""
    ps = KINDS[kind][1]
    host = SegmentTier("host", make_cache(kind), SlotAllocator(16, ps), node_tokens=4)
    cache = TieredCache(make_cache(kind), [host], "write_back")
    toks = np.arange(16)
    cache.insert(toks, np.arange(16))
    cache.evict(16)
    assert host.cache.total_size == 16 and host.cache.num_nodes == 4
    freed = host.cache.evict(1)
    host.allocator.free(freed)
    assert len(freed) == 4  # the last node, not the whole context
    cache.check_invariants()


def test_every_host_layout_names_a_tier_class():
    assert tuple(TIER_KINDS) == HOST_LAYOUTS


@pytest.mark.parametrize("node_tokens", [0, 6, 2.0, True])
def test_a_segment_tier_rejects_what_it_cannot_run(node_tokens):
    with pytest.raises(ValueError, match="node_tokens"):
        SegmentTier("host", RadixCache(page_size=4), SlotAllocator(16, 4), node_tokens=node_tokens)
    with pytest.raises(ValueError, match="radix"):
        SegmentTier("host", HashBlockCache(block_size=4), SlotAllocator(16, 4))


@kinds
def test_held_length_touches_nothing(kind):
    cache = make_cache(kind)
    ps = KINDS[kind][1]
    cache.insert(np.arange(8), np.arange(8))
    before = (cache.stats(), cache.to_dict())
    assert cache.held_length(np.concatenate([np.arange(8), [9] * 8])) == 8
    assert cache.held_length(np.arange(6)) == 6 - 6 % ps
    assert cache.held_length(np.arange(8), "other") == 0
    assert (cache.stats(), cache.to_dict()) == before


@kinds
def test_write_through_selective_stays_inclusive(kind):
    """It writes only what was reused and never writes back, so it demotes nothing: the host's LRU decides."""
    rig = Rig(kind, "write_through_selective", threshold=1, device=16, host=16)
    a, b, c = (np.arange(8) + 100 * k for k in range(1, 4))
    assert rig.put(a) and rig.put(b) and rig.put(c)
    assert rig.host.cache.match_prefix(a).length == 0  # the oldest copy went for c's
    assert rig.host.cache.match_prefix(b).length == rig.host.cache.match_prefix(c).length == 8
    rig.evict(10**6)
    assert rig.cache.take_copies()[-1].dst == "host" and rig.host.cache.match_prefix(a).length == 0
    rig.check()


@kinds
def test_demote_ranks_a_prefix_below_everything_and_a_match_restores_it(kind):
    cache = make_cache(kind)
    a, b = np.arange(8), np.arange(8) + 50
    cache.insert(a, np.arange(8))
    cache.insert(b, np.arange(8) + 8)
    assert cache.evict(4, demoted_only=True).size == 0  # nothing demoted: nothing taken
    assert cache.demote(b) == 8 and cache.demote(np.arange(100, 104)) == 0
    cache.check_invariants()
    assert sorted(cache.evict(8).tolist()) == list(range(8, 16))  # b, though a is older
    cache.insert(b, np.arange(8) + 8)
    cache.demote(b)
    m = cache.match_prefix(b)  # used again (hash lru: its queue moves at the release, as vLLM's)
    cache.lock(m.node)
    cache.unlock(m.node)  # back in recency order, after a
    assert cache.evict(8, demoted_only=True).size == 0
    assert sorted(cache.evict(8).tolist()) == list(range(8))
    cache.check_invariants()


@kinds
def test_insert_of_mismatched_lengths_changes_no_tier(kind):
    """``insert`` raises ``ValueError`` and changes nothing when tokens and slots differ in length (the
    caches' contract), the lower tiers included: write_through must not copy first."""
    rig = Rig(kind, "write_through")
    slots = rig.alloc.alloc(8)
    rig.kv["device"][slots] = fingerprints(None, np.arange(8))
    with pytest.raises(ValueError, match="differ in length"):
        rig.cache.insert(np.arange(8), slots[:6])
    assert rig.cache.take_copies() == [] and rig.host.cache.total_size == 0 and rig.device.total_size == 0
    assert rig.host.allocator.num_free == rig.host.allocator.capacity
    rig.alloc.free(slots)
    rig.check()


@kinds
def test_events_carry_their_tier(kind):
    rig = Rig(kind, "write_through")
    events: list = []
    rig.cache.listener = events.append
    assert rig.put(np.arange(8))
    stored = {e.medium for e in events if isinstance(e, BlockStored)}
    assert stored == {"GPU", "CPU"}
    rig.cache.listener = None
    assert rig.device.listener is None and rig.host.cache.listener is None


@kinds
def test_reset_keeps_a_shared_store(kind):
    ps = KINDS[kind][1]
    host = Tier("host", make_cache(kind), SlotAllocator(16, ps))
    store = Tier("storage", make_cache(kind), SlotAllocator(16, ps), shared=True)
    cache = TieredCache(make_cache(kind), [host, store])
    alloc = SlotAllocator(16, ps)
    slots = alloc.alloc(8)
    cache.insert(np.arange(8), slots)
    assert cache.stats()["tier_tokens"] == {"device": 8, "host": 8, "storage": 8}
    cache.reset()
    assert cache.device.total_size == host.cache.total_size == 0 and host.allocator.num_free == 16
    assert store.cache.match_prefix(np.arange(8)).length == 8
    assert cache.written_tokens == {"host": 0, "storage": 0} and cache.take_copies() == []


@kinds
def test_a_shared_store_demotes_nothing_and_takes_every_write(kind):
    """Another replica may need what this device holds, so a shared store keeps its copies in LRU order and
    a write_through copy displaces its oldest entry when it is full."""
    ps = KINDS[kind][1]
    store = Tier("storage", make_cache(kind), SlotAllocator(8, ps), shared=True)
    cache = TieredCache(make_cache(kind), [store])
    alloc = SlotAllocator(16, ps)
    a, b = np.arange(8), np.arange(8) + 50
    cache.insert(a, alloc.alloc(8))
    cache.plan_load(a, cache.match_prefix(a))  # nothing to load: the device holds it all
    cache.insert(b, alloc.alloc(8))
    assert store.cache.match_prefix(a).length == 0 and store.cache.match_prefix(b).length == 8
    assert cache.written_tokens == {"storage": 16}
    cache.check_invariants()


# ==================================================================== loads
@kinds
@policies
def test_load_extends_a_device_match_from_host(kind, policy):
    rig = Rig(kind, policy, device=32, host=32)
    toks = np.arange(100, 116)
    write_down(rig, toks)
    assert rig.put(toks[:4])  # the device holds the first page again
    rig.cache.take_copies()
    query = toks[:15]  # the at-least-one-token rule's query
    L = rig.device.cacheable_length(15)
    m = rig.cache.match_prefix(query)
    assert m.length == 4
    rig.cache.lock(m.node)
    plan = rig.cache.plan_load(query, m)
    assert plan.length == L - 4 and plan.by_tier() == {"device": 4, "host": L - 4}
    assert rig.host.cache.protected_size == L  # what it reads is locked
    host_slots = rig.host.cache.match_prefix(query).indices
    slots = rig.alloc.alloc(plan.length)
    new = rig.cache.load(plan, slots)
    assert new.length == L and new.indices.tolist() == m.indices.tolist() + slots.tolist()
    assert rig.device.match_prefix(query).indices.tolist() == new.indices.tolist()
    (copy,) = rig.cache.take_copies()
    assert (copy.src, copy.dst) == ("host", "device")
    assert copy.src_slots.tolist() == host_slots[4:L].tolist() and copy.dst_slots.tolist() == slots.tolist()
    assert rig.cache.loaded_tokens == {"host": L - 4}
    rig.check_content("device", None, query, new.indices)
    assert rig.host.cache.protected_size == 0 and rig.device.protected_size == L
    with pytest.raises(LockError):
        rig.cache.unlock(m.node)  # the lock moved to the new match
    rig.check(locked=L)
    rig.cache.unlock(new.node)
    rig.check()


@kinds
def test_plan_takes_each_tier_nearest_first(kind):
    rig = Rig(kind, "write_through", host=8, storage=32)
    toks = np.arange(16)
    write_down(rig, toks)  # the host fits 8, the store all 16
    assert rig.host.cache.total_size == 8 and rig.tier("storage").cache.total_size == 16
    m = rig.cache.match_prefix(toks)
    assert m.length == 0
    new, by_tier = rig.match_and_load(toks)
    assert by_tier == {"device": 0, "host": 8, "storage": 8} and new.length == 16
    loads = [c for c in rig.cache.take_copies() if c.dst == "device"]
    assert [(c.src, len(c)) for c in loads] == [("host", 8), ("storage", 8)]
    assert np.concatenate([c.dst_slots for c in loads]).tolist() == new.indices.tolist()
    assert rig.cache.loaded_tokens == {"host": 8, "storage": 8}
    rig.cache.unlock(new.node)
    rig.check()


@kinds
def test_worth_loading_decides_per_tier(kind):
    calls: list = []

    def only_host(tier: str, tokens: int, prefix: int) -> bool:
        calls.append((tier, tokens, prefix))
        return tier == "host"

    rig = Rig(kind, "write_through", host=8, storage=32, worth_loading=only_host)
    toks = np.arange(16)
    write_down(rig, toks)
    assert rig.put(toks[:4])
    new, by_tier = rig.match_and_load(toks)
    assert by_tier == {"device": 4, "host": 4} and new.length == 8
    assert calls == [("host", 4, 4), ("storage", 8, 8)]
    rig.cache.unlock(new.node)
    rig.check()


@kinds
def test_worth_loading_false_stops_loading(kind):
    calls: list = []

    def never(tier: str, tokens: int, prefix: int) -> bool:
        calls.append((tier, tokens, prefix))
        return False

    rig = Rig(kind, "write_through", host=32, storage=32, worth_loading=never)
    toks = np.arange(16)
    write_down(rig, toks)
    assert rig.put(toks[:4])
    rig.cache.take_copies()
    m = rig.cache.match_prefix(toks)
    rig.cache.lock(m.node)
    plan = rig.cache.plan_load(toks, m)
    assert plan.length == 0 and plan.parts == [] and plan.by_tier() == {"device": 4}
    assert calls == [("host", 12, 4)]  # "while worth_loading agrees": the store behind it is not asked
    assert all(t.cache.protected_size == 0 for t in rig.cache.tiers)
    assert rig.cache.load(plan, np.zeros(0, np.int64)).length == 4  # an empty plan loads nothing
    assert not [c for c in rig.cache.take_copies() if c.dst == "device"]
    rig.check(locked=4)
    rig.cache.unlock(rig.cache.match_prefix(toks).node)
    rig.check()


@kinds
def test_cancel_releases_the_tier_locks(kind):
    rig = Rig(kind, "write_through", host=16, storage=32)
    toks = np.arange(16)
    write_down(rig, toks)
    m = rig.cache.match_prefix(toks)
    rig.cache.lock(m.node)
    plan = rig.cache.plan_load(toks, m)
    assert plan.length == 16 and rig.host.cache.protected_size == 16
    rig.cache.cancel(plan)
    assert plan.parts == [] and plan.length == 0
    assert all(t.cache.protected_size == 0 for t in rig.cache.tiers)
    assert rig.device.total_size == 0 and not [c for c in rig.cache.take_copies() if c.dst == "device"]
    rig.cache.unlock(m.node)
    rig.check()
    rig.host.allocator.free(rig.host.cache.evict(10**6))  # unlocked: all of it can go
    assert rig.host.cache.total_size == 0
    rig.check()


@kinds
def test_load_of_the_wrong_slot_count_raises(kind):
    rig = Rig(kind, "write_through")
    toks = np.arange(8)
    write_down(rig, toks)
    m = rig.cache.match_prefix(toks)
    plan = rig.cache.plan_load(toks, m)
    with pytest.raises(ValueError, match="slots"):
        rig.cache.load(plan, rig.alloc.alloc(4))
    assert rig.host.cache.protected_size == 8 and rig.device.total_size == 0  # the plan stands, nothing loaded
    rig.alloc.retain([])
    rig.cache.cancel(plan)
    rig.check()


@kinds
def test_namespaces_stay_apart_in_the_lower_tiers(kind):
    rig = Rig(kind, "write_through")
    toks = np.arange(8)
    write_down(rig, toks, namespace="b")
    new, by_tier = rig.match_and_load(toks)  # another namespace: nothing to load
    assert new.length == 0 and by_tier == {"device": 0}
    new, by_tier = rig.match_and_load(toks, "b")
    assert new.length == 8 and by_tier == {"device": 0, "host": 8}
    rig.cache.unlock(new.node)
    rig.check()


# ==================================================================== data: host copies equal device copies
def draw(rng: np.random.Generator, stems: list[np.ndarray]) -> tuple[Any, np.ndarray]:
    """A sequence sharing a prefix with others: a cut of a stem and a short random tail, in a namespace."""
    stem = stems[rng.integers(len(stems))]
    cut = len(stem) if rng.random() < 0.6 else int(rng.integers(0, len(stem) + 1))
    tail = rng.integers(0, 3, size=int(rng.integers(0, 6)))
    ns = NAMESPACES[int(rng.random() < 0.2)]
    return ns, np.concatenate([stem[:cut], tail]).astype(np.int64)


@layouts
@policies
def test_host_copies_equal_device_copies_under_random_operations(kind, layout, policy):
    rng = np.random.default_rng(11)
    # selective: write at a first reuse
    rig = Rig(kind, policy, device=32, host=24, storage=48, threshold=1, layout=layout)
    stems = [rng.integers(0, 40, size=n) for n in (4, 8, 9, 12)]
    held: list = []
    for _ in range(120):
        op = rng.choice(["put", "put", "match", "load", "load", "evict", "unlock"])
        ns, toks = draw(rng, stems)
        if op == "put":
            rig.put(toks, ns, known=int(rng.integers(0, 4)) * rig.ps)
        elif op == "match":
            rig.check_content("device", ns, toks, rig.cache.match_prefix(toks, ns).indices)
        elif op == "load":
            m, _ = rig.match_and_load(toks, ns, cancel=rng.random() < 0.2)
            held.append(m.node)
        elif op == "evict":
            rig.evict(int(rng.integers(1, 12)))
        if held and (op == "unlock" or len(held) > 3):
            rig.cache.unlock(held.pop(0))
        rig.check_host_equals_device()
    for node in held:
        rig.cache.unlock(node)
    rig.check()
    assert all(rig.cache.written_tokens.values()) and rig.cache.loaded_tokens["host"]  # every tier written


@layouts
@pytest.mark.parametrize("eviction", sorted(POLICIES))
def test_every_eviction_policy_keeps_the_tiers_consistent(kind, layout, eviction):
    """Each tier runs the policy (lru's, ttl's and session's tiers nearly exclusive, with demotions and
    demoted-only evictions; the others' inclusive): no slot lost or held twice, every copy the KV of its
    prefix, the policies' books intact."""
    rng = np.random.default_rng(5)
    rig = Rig(kind, "write_through", device=24, host=24, storage=32, eviction=eviction, layout=layout)
    assert rig.host.exclusive == (eviction in EXCLUSIVE_POLICIES)
    stems = [rng.integers(0, 40, size=n) for n in (4, 8, 9, 12)]
    for _ in range(90):
        ns, toks = draw(rng, stems)
        op = rng.choice(["put", "put", "load", "evict"])
        if op == "put":
            rig.put(toks, ns, known=int(rng.integers(0, 4)) * rig.ps)
        elif op == "load":
            m, _ = rig.match_and_load(toks, ns)
            rig.cache.unlock(m.node)
        else:
            rig.evict(int(rng.integers(1, 12)))
        rig.check()
    rig.check_host_equals_device()
    assert rig.cache.written_tokens["host"] and rig.cache.loaded_tokens["host"]


# ==================================================================== faults
def script(rig: Rig) -> None:
    """A fixed run with every kind of copy: writes under each policy, write-backs, loads from both tiers."""
    a = np.arange(16)
    b = np.concatenate([np.arange(8), np.full(8, 90)])
    c = np.full(12, 70)
    for toks in (a, b, a, c, b):
        assert rig.put(toks)
        reuse(rig, toks)
        reuse(rig, toks)
    rig.evict(10**6)
    for toks in (a, c, b):
        m, _ = rig.match_and_load(toks)
        rig.cache.unlock(m.node)
    assert rig.put(np.concatenate([a, np.full(8, 5)]), known=4)
    for toks in (b, c):
        m, _ = rig.match_and_load(toks)
        rig.cache.unlock(m.node)
    rig.evict(10**6)


@layouts
@policies
def test_a_failed_copy_leaves_every_tier_consistent(kind, layout, policy):
    def fresh() -> Rig:
        return Rig(kind, policy, device=32, host=16, storage=40, layout=layout)

    clean = fresh()
    script(clean)
    clean.check()
    total = clean.moved
    assert {(c.src, c.dst) for c in clean.cache.copies} == {("device", "host"), ("device", "storage"),
                                                            ("host", "device"), ("storage", "device")}
    for k in range(1, total + 1):
        rig = fresh()
        rig.fail_at = k
        with pytest.raises(MoverFault):
            script(rig)
        rig.recover()
        rig.check()  # nothing locked, free + held == capacity everywhere, no half-copied KV cached
        rig.fail_at = None
        script(rig)  # and it works on
        rig.check()


# ==================================================================== the state machine
ALPHABET = 3
DEVICE, HOST, STORAGE = 24, 16, 32
STEMS = ((0, 1, 2, 0, 1, 2, 0, 1, 2, 0, 1, 2), (2, 2, 1, 1, 0, 0, 2, 2), (1, 0, 1, 0, 2, 1, 2, 1, 0, 0))
_tail_st = st.lists(st.integers(0, ALPHABET - 1), max_size=5)
# sequences sharing a few stems (so prefixes are reused, evicted and wanted back), or anything short
tokens_st = st.one_of(st.builds(lambda stem, cut, tail: list(stem[:cut]) + tail, st.sampled_from(STEMS),
                                st.integers(0, 12), _tail_st),
                      st.lists(st.integers(0, ALPHABET - 1), max_size=10))
namespace_st = st.sampled_from(NAMESPACES)
pick_st = st.integers(0, 10**6)


@dataclass
class Held:
    """A running request: a lock on the device match of ``prefix``."""

    namespace: Any
    prefix: np.ndarray
    indices: np.ndarray
    node: Any


class TieredMachine(RuleBasedStateMachine):
    """A ``TieredCache`` over host and storage tiers driven as the scheduler does, against the naive model
    (``Rig.inserted``: every page-aligned prefix ever computed) and the KV the mover moved."""

    kind: str
    policy: str
    threshold: int = 1  # selective writes at a first hit, so short runs load its copies back (the count: unit tests)

    def __init__(self):
        super().__init__()
        self.rig = Rig(self.kind, self.policy, device=DEVICE, host=HOST, storage=STORAGE, threshold=self.threshold)
        self.ps = self.rig.ps
        self.held: list[Held] = []

    def locked_tokens(self) -> int:
        keys = {(h.namespace, tuple(h.prefix[:k].tolist())) for h in self.held
                for k in range(self.ps, len(h.prefix) + 1, self.ps)}
        return len(keys) * self.ps

    @rule(namespace=namespace_st, tokens=tokens_st, known_pages=st.integers(0, 3))
    def insert(self, namespace, tokens, known_pages):
        """A finished request caches its sequence (duplicates where it used less than the match)."""
        self.rig.put(tokens, namespace, known=known_pages * self.ps)

    @precondition(lambda self: len(self.held) < 4)
    @rule(namespace=namespace_st, tokens=tokens_st)
    def match_and_lock(self, namespace, tokens):
        toks = as_token_array(tokens)
        m = self.rig.cache.match_prefix(toks, namespace)
        self.rig.check_content("device", namespace, toks, m.indices)
        self.rig.cache.lock(m.node)
        self.held.append(Held(namespace, toks[: m.length], m.indices, m.node))

    @precondition(lambda self: len(self.held) < 4)
    @rule(namespace=namespace_st, tokens=tokens_st, cancel=st.booleans())
    def match_and_load(self, namespace, tokens, cancel):
        """Admission through the lower tiers: plan, evict device entries if short, load (or cancel)."""
        toks = as_token_array(tokens)
        m, _ = self.rig.match_and_load(toks, namespace, cancel)
        self.held.append(Held(namespace, toks[: m.length], m.indices, m.node))

    @precondition(lambda self: self.held)
    @rule(pick=pick_st, extra=st.lists(st.integers(0, ALPHABET - 1), min_size=1, max_size=6))
    def extend(self, pick, extra):
        """A running request caches a computed chunk (``commit_prefix``), its lock moving along."""
        h = self.held[pick % len(self.held)]
        toks = np.concatenate([h.prefix, np.asarray(extra, dtype=np.int64)])
        if not self.rig.make_room(len(extra)):
            return
        slots = np.concatenate([h.indices, self.rig.compute(h.namespace, toks, len(h.prefix))])
        node, cached, slots = commit_prefix(self.rig.cache, self.rig.alloc, toks, slots, len(h.prefix), h.node,
                                            h.namespace)
        assert cached == self.rig.device.cacheable_length(len(toks))
        self.rig.alloc.free(slots[cached:])  # the partial page stays the request's: it drops it here
        self.rig.check_content("device", h.namespace, toks, slots[:cached])
        h.prefix, h.indices, h.node = toks[:cached], slots[:cached], node

    @precondition(lambda self: self.held)
    @rule(pick=pick_st)
    def unlock(self, pick):
        self.rig.cache.unlock(self.held.pop(pick % len(self.held)).node)

    @rule(num_tokens=st.integers(1, DEVICE + 4))
    def evict(self, num_tokens):
        locked = {s for h in self.held for s in h.indices.tolist()}
        freed = self.rig.evict(num_tokens)
        assert not locked & set(freed.tolist()), "evict freed a locked slot"

    @rule(namespace=namespace_st, tokens=tokens_st, at=st.integers(1, 3))
    def failed_copy(self, namespace, tokens, at):
        """A request whose admission or caching meets a copy that fails; the caller recovers its books."""
        rig = self.rig
        rig.fail_at = rig.moved + at
        try:
            m, _ = rig.match_and_load(tokens, namespace)
            rig.cache.unlock(m.node)
            rig.put(tokens, namespace)
        except MoverFault:
            rig.recover()
            self.held.clear()
        finally:
            rig.fail_at = None

    @invariant()
    def consistent(self):
        self.rig.check(locked=self.locked_tokens())
        for h in self.held:  # what a request holds is still cached where it was
            m = self.rig.device.match_prefix(h.prefix, h.namespace)
            assert m.indices[: len(h.prefix)].tolist() == h.indices.tolist()

    def teardown(self):
        for h in self.held:
            self.rig.cache.unlock(h.node)
        self.rig.check()


MACHINE_SETTINGS = settings(max_examples=60, stateful_step_count=40, deadline=None, derandomize=True,
                            database=None, suppress_health_check=[HealthCheck.too_slow])


def _machine(kind: str, policy: str) -> tuple[str, type]:
    """The machine over one device kind and write policy, as a ``unittest`` case named after them."""
    name = f"TestTieredMachine_{kind.replace('-', '_')}_{policy}"
    machine = type(name, (TieredMachine,), {"kind": kind, "policy": policy})
    machine.TestCase.settings = MACHINE_SETTINGS
    return name, machine.TestCase


for _kind in KINDS:
    for _policy in WRITE_POLICIES:
        _name, _case = _machine(_kind, _policy)
        globals()[_name] = _case
del _kind, _policy, _name, _case


# ==================================================================== the simulator
def chats() -> list[Request]:
    return make("multi_turn", sessions=6, turns=4, user_tokens=(20, 40), output_tokens=(3, 6))


def _rows(result) -> list[dict]:
    return [{k: v for k, v in row.items() if k != "hit_by_tier"} for row in result.per_request]


@pytest.mark.parametrize("cache", ["radix", "hash"])
def test_simulate_without_a_host_tier_is_unchanged(cache):
    reqs = chats()
    base = simulate(reqs, cache=cache, capacity_tokens=200, block_size=4)
    zero = simulate(reqs, cache=cache, capacity_tokens=200, block_size=4, host_capacity_tokens=0)
    assert _rows(zero) == _rows(base) and zero.steps == base.steps
    assert zero.hit_rate == base.hit_rate and zero.load_seconds == 0.0
    assert all(row["hit_by_tier"] == {"device": row["hit"]} for row in zero.per_request)
    assert set(zero.hit_rate_by_tier) == {"device"}


@pytest.mark.parametrize("cache", ["radix", "hash"])
@pytest.mark.parametrize("policy", WRITE_POLICIES)
def test_simulate_splits_the_hit_rate_by_tier(cache, policy):
    reqs = chats()
    base = simulate(reqs, cache=cache, capacity_tokens=200, block_size=4)
    tiered = simulate(reqs, cache=cache, capacity_tokens=200, block_size=4, host_capacity_tokens=3000,
                      write_policy=policy, write_threshold=1)
    by_tier = tiered.hit_rate_by_tier
    assert sum(by_tier.values()) == pytest.approx(tiered.hit_rate)
    assert set(by_tier) <= {"device", "host"}
    assert by_tier.get("host", 0) > 0 and tiered.hit_rate > base.hit_rate
    assert tiered.summary()["hit_rate_by_tier"] == by_tier
    for row in tiered.per_request:
        assert sum(row["hit_by_tier"].values()) == row["hit"]


@pytest.mark.parametrize("layout", ["segments", "chains"])
@pytest.mark.parametrize("policy", WRITE_POLICIES)
def test_simulate_over_a_segment_tier(policy, layout):
    """``host_layout="segments"`` / ``"chains"`` build SegmentTiers / ChainTiers; the hits split by tier as
    over a prefix tier."""
    reqs = chats()
    tiered = simulate(reqs, cache="radix", capacity_tokens=200, page_size=4, host_capacity_tokens=3000,
                      write_policy=policy, write_threshold=1, host_layout=layout)
    assert tiered.hit_rate_by_tier.get("host", 0) > 0
    assert sum(tiered.hit_rate_by_tier.values()) == pytest.approx(tiered.hit_rate)
    with pytest.raises(ValueError, match="host_layout"):
        simulate(reqs, cache="radix", capacity_tokens=200, host_capacity_tokens=3000, host_layout="rows")
    with pytest.raises(ValueError, match=f"{layout} works below the radix cache"):
        simulate(reqs, cache="hash", capacity_tokens=200, host_capacity_tokens=3000, host_layout=layout)


def _evict_then_return() -> list[Request]:
    """P, then Q evicting it from a device of 700 slots, then P plus a question: a host hit of len(P)."""
    rng = np.random.default_rng(0)
    p, q, s = rng.integers(0, 1000, 600), rng.integers(1000, 2000, 600), rng.integers(2000, 3000, 50)
    return [Request(arrival=0.0, session=0, prompt=p, output_len=4, rid=0),
            Request(arrival=10.0, session=1, prompt=q, output_len=4, rid=1),
            Request(arrival=20.0, session=2, prompt=np.concatenate([p, s]), output_len=4, rid=2)]


def test_ttft_of_a_host_hit_includes_its_load_time():
    reqs = _evict_then_return()
    runs = {bw: simulate(reqs, cache="radix", capacity_tokens=700, host_capacity_tokens=4000,
                         cost_model=CostModel(host_bandwidth=bw)) for bw in (1e8, 1e12)}  # both beat recomputing
    slow, fast = runs[1e8], runs[1e12]
    for run in (slow, fast):
        assert run.per_request[2]["hit_by_tier"] == {"device": 0, "host": 600}
    loads = {bw: 600 * CostModel().kv_bytes_per_token / bw for bw in runs}
    assert slow.load_seconds == pytest.approx(loads[1e8]) and fast.load_seconds == pytest.approx(loads[1e12])
    assert slow.per_request[2]["ttft"] - fast.per_request[2]["ttft"] == pytest.approx(loads[1e8] - loads[1e12])
    assert [r["ttft"] for r in slow.per_request[:2]] == [r["ttft"] for r in fast.per_request[:2]]
    never = simulate(reqs, cache="radix", capacity_tokens=700, host_capacity_tokens=4000,
                     cost_model=CostModel(host_bandwidth=1e6))  # slower than recomputing: not loaded
    assert never.per_request[2]["hit"] == 0 and never.load_seconds == 0.0


@pytest.mark.parametrize("cache", ["radix", "hash"])
def test_replicas_share_one_store(cache):
    rng = np.random.default_rng(1)
    p, s = rng.integers(0, 1000, 600), rng.integers(1000, 2000, 50)
    reqs = [Request(arrival=0.0, session=0, prompt=p, output_len=4, rid=0),
            Request(arrival=10.0, session=1, prompt=np.concatenate([p, s]), output_len=4, rid=1)]
    common = dict(replicas=2, router="round_robin", references=False, cache=cache, block_size=4)
    alone = simulate_cluster(reqs, **common)
    shared = simulate_cluster(reqs, storage_capacity_tokens=4000, **common)
    assert [len(r.per_request) for r in shared.replicas] == [1, 1]  # round robin: one each
    assert alone.replicas[1].per_request[0]["hit"] == 0
    assert shared.replicas[1].per_request[0]["hit_by_tier"] == {"device": 0, "storage": 600}
    assert shared.hit_rate_by_tier["storage"] == pytest.approx(600 / 1250)
    assert sum(shared.hit_rate_by_tier.values()) == pytest.approx(shared.hit_rate)


def test_a_request_that_is_not_admitted_loads_nothing():
    """Regression: the load ran before the admission's own slots were checked, so a request that then did not
    fit had already copied its host hit into the device (and counted it as a device hit on its next try)."""
    from radixkv.scheduling import RequestState
    from radixkv.stack import StackConfig, build_stack

    stack = build_stack(StackConfig(capacity_tokens=64, host_capacity_tokens=256, schedule_policy="fcfs",
                                    max_batch_tokens=None, chunked_prefill_size=None), 64)
    cache, sched, alloc = stack.cache, stack.scheduler, stack.allocator
    first = list(range(1, 21))
    sched.add(RequestState(0, first))
    batch = sched.schedule()
    sched.commit(batch)
    sched.finish(batch[0][0], first)  # write-through: the host tier holds it too
    alloc.free(cache.evict(cache.evictable_size))  # the device forgets it
    held = alloc.alloc(40)  # a running request holds most of the pool: 24 free, 40 needed
    sched.add(RequestState(1, first + list(range(100, 120))))
    assert sched.schedule() == [] and cache.loaded_tokens["host"] == 0 and cache.device.total_size == 0
    alloc.free(held)
    batch = sched.schedule()
    assert batch and batch[0][0].hit_by_tier == {"device": 0, "host": 20}
