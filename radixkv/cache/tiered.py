"""A hierarchical prefix cache (SGLang's HiCache, vLLM's KV offloading): the device tier the model attends
from, and lower tiers (host memory, shared storage) that keep KV the device tier had to drop.

Each tier is a prefix cache of the same kind and page over its own slots, with its own capacity (its
``SlotAllocator``) and its own eviction order; the device tier is the cache the engine always had, so
its locks protect the device copies as before. A prefix is in one of three states: on the device only,
in a lower tier only, or on both. Lower tiers hold no locks but while a load reads them.

Write policies (SGLang's names) decide when device KV is copied down:

* ``write_through``: when it is inserted;
* ``write_through_selective``: when an entry's hits reach ``write_threshold``, counting as SGLang does its
  insertion as the first and each admitted request that reuses it as one more (``admitted``, which the
  scheduler calls once per request, at its first admission, against the device match's last entry: reuses,
  not lookups, and never a retry of a request that waited for memory); 1 is ``write_through``;
* ``write_back``: when the device tier evicts it (the whole prefix through the entry, ancestors the device
  still holds included: a lower tier is a prefix tree too; a ``SegmentTier``, ``radixkv.cache.segments``,
  takes it from where the device's held prefix ends); ``write_through`` too, into an exclusive tier that
  dropped the copy it made at insert.

Under ``write_through`` and ``write_back`` an *exclusive* tier (``Tier.exclusive``: one replica's own,
evicting ``lru``, ``ttl`` or ``session``, whose orders put spare copies first) holds little of what the device
holds: its copy of a prefix the device holds is ``demote``d, ranked below everything else, whenever the device
gets or keeps that prefix (an insert, an admission's device match, a load), and the device's evictions are
written down where it dropped the copy. ``write_through`` copies each insert into its free slots or slots of
such spare copies only, never displacing a prefix only that tier keeps. A device of C tokens over a host of R
x C then keeps about what one tier of (1 + R) x C keeps, where SGLang's host tier, which never drops the copy
of a prefix the device holds, keeps what one tier of R x C does (docs/tiers.md). The other tiers are
*inclusive*, as SGLang's: a shared store (its copies serve other replicas), a tier under another eviction
policy (demotion would fight its own order: frequencies, ghosts, classes), and every tier under
``write_through_selective``.

``match_prefix`` is the device tier's. ``plan_load`` then says how far the lower tiers extend a match
(per tier, nearest first, each only where ``worth_loading`` says loading beats recomputing), and locks
what it will read; ``load`` takes device slots the caller allocated (evicting as usual), copies the KV into
them and inserts them into the device tier, moving the caller's lock; ``cancel`` gives a plan up.

Copies (``Copy``) are recorded in order in ``copies`` (the simulator charges them: ``take_copies``) and,
where a ``mover`` is given (the engine's real buffers), run at once: a load's before its slots join the
device tier, a write's before its slots join the lower tier, so a copy that fails leaves nothing pointing
at half-copied KV (``unlock_all`` then returns the lower tiers' orphaned slots, as ``Scheduler.recover``
does the device's). Sources stay valid until the copy runs: a write-back reads slots ``evict`` just
returned, which nothing reuses before the copy.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from radixkv.cache.base import NO_HINTS, CacheHints, Evicted, MatchResult, PrefixCache, TokenSeq, as_token_array
from radixkv.cache.events import CacheListener
from radixkv.cache.tiers import DEVICE, MEDIUM, Copy, LoadPlan, Part
from radixkv.memory import SlotAllocator

WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")
EXCLUSIVE = ("write_through", "write_back")  # where exclusive tiers demote what the device holds

class Tier:
    """One lower tier, built whole: ``name`` (a ``TierSpec``'s), a prefix cache over this tier's slots, their
    allocator and, where the tier is real memory (the engine's), its KV ``buffer``. ``shared``: one store
    several replicas' caches use (a cluster's storage). ``medium``: what its KV events name (``MEDIUM``). ``exclusive``:
    whether a tiered cache keeps it nearly exclusive of the device (one replica's own tier under a policy that
    ``keeps_order_under_demotion``; see the module doc)."""

    def __init__(self, name: str, cache: PrefixCache, allocator: SlotAllocator, shared: bool = False,
                 buffer: Any = None):
        if allocator.page_size != cache.page_size:
            raise ValueError(f"tier {name!r}: the allocator's page {allocator.page_size} is not the cache's "
                             f"{cache.page_size}")
        self.name, self.cache, self.allocator, self.shared = name, cache, allocator, shared
        self.buffer, self.medium = buffer, MEDIUM.get(name, name.upper())
        self.exclusive = not shared and getattr(getattr(cache, "policy", None), "keeps_order_under_demotion", False)

    def writes_from(self, start: int) -> int:
        """Where a write of a prefix the device holds up to ``start`` begins in this tier: 0, a prefix tree
        keeps the whole prefix (``SegmentTier``: ``start``)."""
        return 0

    def find(self, tokens: np.ndarray, namespace: Hashable, hints: CacheHints, start: int, held: int
             ) -> list[MatchResult]:
        """The matches of ``tokens`` this tier extends past ``start`` by, in order (one here: the tree's longest
        match), each in the prompt's coordinates; its copy of the ``held`` leading tokens (the device's) is
        demoted first when ``held``. O(tokens)."""
        m = self.cache.match_prefix(tokens, namespace, hints)
        if held:
            self.cache.demote(tokens[:held], namespace)
        return [m] if m.length > start else []

    def demote(self, tokens: np.ndarray, namespace: Hashable) -> None:
        """Rank this tier's copy of ``tokens``, which the device holds, below everything else. O(tokens)."""
        self.cache.demote(tokens, namespace)

    def store(self, tokens: np.ndarray, namespace: Hashable, hints: CacheHints = NO_HINTS, displace: bool = True,
              start: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """Make room for the whole pages of ``tokens`` this tier lacks, evicting its own entries (with
        ``displace`` False, only demoted ones): ``(held, fresh)``, the slots of the leading tokens it holds
        (refreshed) and fresh slots for as many further whole pages as fit (none when it holds them all).
        The caller copies, then ``keep``s them. ``hints``: the writing request's (none for a write-back), for
        the tier's eviction policy. ``start``: where the write begins (``writes_from``: 0 in a prefix tree,
        which this class is; ``SegmentTier`` answers from there on). O(tokens) + the eviction."""
        n = self.cache.cacheable_length(len(tokens))
        m = self.cache.match_prefix(tokens[:n], namespace, hints)
        if m.length >= n:
            if self.exclusive:  # a lock's release refreshes what the match found (a hash queue's lookup does not)
                self.cache.lock(m.node)
                self.cache.unlock(m.node)
            return m.indices, m.indices[:0]
        return m.indices, self._fresh([m.node], n - m.length, displace)

    def _fresh(self, nodes: Sequence[Any], wanted: int, displace: bool) -> np.ndarray:
        """Fresh slots for as many whole pages of ``wanted`` tokens as fit, after evicting this tier's own
        entries where it is short (only demoted ones when not ``displace``); ``nodes``, the path the new pages
        hang from, are locked meanwhile so the eviction spares it. O(the eviction)."""
        for node in nodes:
            self.cache.lock(node)
        try:
            short = wanted - self.allocator.num_free
            if short > 0:
                self.allocator.free(self.cache.evict(short, demoted_only=not displace))
            page = self.allocator.page_size
            fit = min(wanted, self.allocator.num_free // page * page)
            return self.allocator.alloc(fit) if fit else np.zeros(0, np.int64)
        finally:
            for node in nodes:
                self.cache.unlock(node)

    def keep(self, tokens: np.ndarray, held: np.ndarray, fresh: np.ndarray, namespace: Hashable,
             hints: CacheHints = NO_HINTS, start: int = 0) -> None:
        """Insert the leading tokens ``store`` answered for: those at ``held`` and then those at ``fresh``
        (their KV copied); what the cache already had (nothing, unless another writer came first) is freed.
        ``start``: as ``store``'s."""
        n = len(held)
        already = self.cache.insert(tokens[: n + len(fresh)], np.concatenate([held, fresh]), namespace, hints)
        self.allocator.free(fresh[: max(already - n, 0)])

    def check_invariants(self) -> None:
        """The tier's cache and allocator hold, and every slot is either free or the cache's, once."""
        self.cache.check_invariants()
        self.allocator.check_invariants()
        held = self.allocator.num_free + self.cache.total_size
        if held != self.allocator.capacity:
            raise AssertionError(f"tier {self.name!r}: free + held = {held} != {self.allocator.capacity}")

    def reset(self) -> None:
        self.cache.reset()
        self.allocator.reset()


class TieredCache:
    """A device prefix cache (``RadixCache`` or ``HashBlockCache``) over lower ``tiers``; see the module doc.

    Args:
        device: the device tier; the ``PrefixCache`` surface is its own (sizes, locks, events).
        tiers: lower tiers, nearest first (host, then storage), each of ``device``'s page.
        write_policy: one of ``WRITE_POLICIES``.
        write_threshold: hits before ``write_through_selective`` copies an entry down (>= 1).
        worth_loading: ``(tier name, tokens, prefix length) -> bool``, whether loading that many tokens
            after that many cached ones beats computing them (the simulator's cost model; None: always).
        mover: runs each ``Copy`` at once (the engine's buffers; None: copies are only recorded).
    """

    def __init__(self, device: PrefixCache, tiers: Sequence[Tier], write_policy: str = "write_through",
                 write_threshold: int = 2, worth_loading: Callable[[str, int, int], bool] | None = None,
                 mover: Callable[[Copy], None] | None = None):
        if write_policy not in WRITE_POLICIES:
            raise ValueError(f"unknown write_policy {write_policy!r}; choose one of {WRITE_POLICIES}")
        if isinstance(write_threshold, bool) or not isinstance(write_threshold, int) or write_threshold < 1:
            raise ValueError(f"write_threshold must be an integer >= 1, got {write_threshold!r}")
        if not tiers or any(t.cache.page_size != device.page_size for t in tiers):
            raise ValueError("a tiered cache needs at least one lower tier, each of the device tier's page")
        if device.caches_during_decode:
            raise ValueError("tiers work over caches that insert at chunk and request ends (radix, hash)")
        self.device, self.tiers = device, list(tiers)
        self._own_tiers = [t for t in self.tiers if not t.shared]  # those no other replica uses
        self.write_policy, self.write_threshold = write_policy, write_threshold
        self.worth_loading, self.mover = worth_loading, mover
        self.page_size = device.page_size
        self.caches_during_decode = False
        self.eviction_policy = getattr(device, "eviction_policy", None)
        self.copies: list[Copy] = []
        self._uses: dict[Any, int] = {}  # write_through_selective: reuses per device entry not yet copied
        self.loaded_tokens = dict.fromkeys((t.name for t in self.tiers), 0)  # into the device, by source tier
        self.written_tokens = dict.fromkeys((t.name for t in self.tiers), 0)  # from the device, by target tier
        self._listener: CacheListener | None = None

    # ------------------------------------------------------------------ the device tier's surface
    @property
    def listener(self) -> CacheListener | None:
        return self._listener

    @listener.setter
    def listener(self, listener: CacheListener | None) -> None:
        """Every tier's events, each with its tier's ``medium`` (a shared store's go to no replica)."""
        self._listener = listener
        self.device.listener = None if listener is None else _with_medium(listener, MEDIUM[DEVICE])
        for tier in self._own_tiers:
            tier.cache.listener = None if listener is None else _with_medium(listener, tier.medium)

    total_size = property(lambda self: self.device.total_size, doc="Tokens on the device tier.")
    evictable_size = property(lambda self: self.device.evictable_size, doc="Unlocked device tokens.")
    protected_size = property(lambda self: self.device.protected_size, doc="Locked device tokens.")

    def lock(self, node: Any) -> None:
        self.device.lock(node)

    def unlock(self, node: Any) -> None:
        self.device.unlock(node)

    def cacheable_length(self, num_tokens: int) -> int:
        return self.device.cacheable_length(num_tokens)

    def held_slots(self) -> np.ndarray:
        """The device slots the cache holds (the lower tiers' are their allocators' business)."""
        return self.device.held_slots()

    @property
    def clock(self) -> Callable[[], float]:
        """The device tier's clock; setting it sets every tier's (a shared store keeps the first it got)."""
        return self.device.clock

    @clock.setter
    def clock(self, clock: Callable[[], float]) -> None:
        self.device.clock = clock
        for tier in self._own_tiers:
            tier.cache.clock = clock

    def match_prefix(self, tokens: TokenSeq, namespace: Hashable = None, hints: CacheHints = NO_HINTS) -> MatchResult:
        """The device tier's longest match (``plan_load`` extends it). O(device match)."""
        return self.device.match_prefix(tokens, namespace, hints)

    def insert(self, tokens: TokenSeq, indices: TokenSeq, namespace: Hashable = None,
               hints: CacheHints = NO_HINTS) -> int:
        """The device tier's insert; ``write_through`` first copies what the lower tiers lack (from
        ``indices``, which hold the KV now, duplicates included). Unequal lengths raise ``ValueError``
        before anything is copied, as the device's own check would, so no tier changes."""
        through = self.write_policy == "write_through"
        if through or (self.write_policy == "write_through_selective" and self.write_threshold == 1):  # a hit
            arr, idx = as_token_array(tokens), as_token_array(indices)
            if len(arr) != len(idx):
                raise ValueError(f"tokens and indices differ in length: {len(arr)} != {len(idx)}")
            self._write(arr, idx, namespace, hints, displace=not through)
            self._demote(arr, namespace)
        return self.device.insert(tokens, indices, namespace, hints)

    def evict(self, num_tokens: int, victims: list[Evicted] | None = None, demoted_only: bool = False) -> np.ndarray:
        """The device tier's eviction; ``write_back`` and ``write_through`` copy each evicted entry's prefix
        down first where a tier lacks it (``victims`` gets them too, when given)."""
        if self.write_policy not in EXCLUSIVE:
            return self.device.evict(num_tokens, victims, demoted_only)
        mine: list[Evicted] = []
        freed = self.device.evict(num_tokens, mine, demoted_only)
        if victims is not None:
            victims.extend(mine)
        last: Evicted | None = None
        for v in mine:
            if last is not None and _within(v, last):  # a chain leaves tail first: its prefix was just written
                continue
            self._write(v.tokens, v.slots, v.namespace, back=True, start=self._held(v))
            last = v
        return freed

    def demote(self, tokens: TokenSeq, namespace: Hashable = None) -> int:
        """The device tier's ``demote`` (a tiered cache below another one)."""
        return self.device.demote(tokens, namespace)

    def held_length(self, tokens: TokenSeq, namespace: Hashable = None) -> int:
        """The device tier's ``held_length``."""
        return self.device.held_length(tokens, namespace)

    # ------------------------------------------------------------------ loads
    def plan_load(self, tokens: TokenSeq, match: MatchResult, namespace: Hashable = None,
                  hints: CacheHints = NO_HINTS) -> LoadPlan:
        """How far the lower tiers extend ``match`` (the device's for ``tokens``, locked by the caller): per
        tier, nearest first, the whole pages after what nearer tiers supply, while ``worth_loading`` agrees.
        The tiers' matches (with the request's ``hints``) are locked until ``load`` or ``cancel``. O(tokens)
        per tier."""
        arr = as_token_array(tokens)
        plan = LoadPlan(arr, namespace, match)
        start = match.length
        for tier in self.tiers:
            held = match.length if self.write_policy in EXCLUSIVE and tier.exclusive else 0  # to demote
            for m in tier.find(arr, namespace, hints, start, held):
                if self.worth_loading is not None and not self.worth_loading(tier.name, m.length - start, start):
                    return plan
                tier.cache.lock(m.node)
                plan.parts.append(Part(tier, m, start, m.length))
                start = m.length
        return plan

    def cancel(self, plan: LoadPlan) -> None:
        """Give a plan up (no device slots for it): the tiers' locks go."""
        for part in plan.parts:
            part.tier.cache.unlock(part.match.node)
        plan.parts.clear()

    def load(self, plan: LoadPlan, slots: np.ndarray) -> MatchResult:
        """Copy the plan's tokens into ``slots`` (``plan.length`` fresh device slots) and insert them into the
        device tier: the new match, locked in place of ``plan.match``. O(plan tokens) plus the copies."""
        m0 = plan.match.length
        if len(slots) != plan.length:
            raise ValueError(f"load: {len(slots)} slots for {plan.length} tokens")
        try:
            for tier, m, start, stop in plan.parts:
                self._copy(Copy(tier.name, DEVICE, m.indices[start:stop], slots[start - m0 : stop - m0]))
                self.loaded_tokens[tier.name] += stop - start
        finally:
            tiers = [part.tier for part in plan.parts]
            self.cancel(plan)
        stop = m0 + len(slots)
        self._demote(plan.tokens[:stop], plan.namespace, tiers)
        already = self.device.insert(plan.tokens[:stop], np.concatenate([plan.match.indices, slots]), plan.namespace)
        # the plan's device path is locked and nothing inserts between plan_load and load (evictions only)
        assert already == m0, f"load: the device tier held {already} tokens, the plan {m0}"
        m = self.device.match_prefix(plan.tokens[:stop], plan.namespace)
        self.device.lock(m.node)
        self.device.unlock(plan.match.node)
        return m

    def admitted(self, tokens: TokenSeq, match: MatchResult, namespace: Hashable = None,
                 hints: CacheHints = NO_HINTS) -> None:
        """A request was admitted reusing ``match``, the device tier's match of ``tokens`` (still locked: the
        caller calls this once per request, at its first admission, never for a retry). Under
        ``write_through_selective`` the reuse counts against the match's last entry (its insertion was hit 1),
        and the prefix is copied down when the hits reach ``write_threshold``; other policies count nothing.
        Counts of entries that left the device are dropped once they outnumber the device's entries. O(1),
        plus the copy."""
        if self.write_policy != "write_through_selective" or not match.length:
            return
        entry = _last_entry(match.node)
        uses = self._uses[entry] = self._uses.get(entry, 1) + 1
        if uses >= self.write_threshold:
            del self._uses[entry]
            self._write(as_token_array(tokens)[: match.length], match.indices, namespace, hints)
        elif len(self._uses) > 2 * max(self.device.total_size // self.page_size, 1024):
            self._uses = {e: n for e, n in self._uses.items() if _attached(e)}

    # ------------------------------------------------------------------ writes
    def _held(self, victim: Evicted) -> int:
        """How much of an evicted entry's prefix the device still holds, where a tier writes from there on."""
        if any(t.writes_from(1) for t in self.tiers):
            return self.device.held_length(victim.tokens, victim.namespace)
        return 0

    def _write(self, tokens: np.ndarray, slots: np.ndarray, namespace: Hashable,
               hints: CacheHints = NO_HINTS, displace: bool = True, back: bool = False, start: int = 0) -> None:
        """Copy the whole pages of ``tokens`` (device KV at ``slots``) into every lower tier lacking them; the
        tiers' caches get the writing request's ``hints`` (none for a write-back). ``displace``: see
        ``Tier.store`` (an inclusive tier demotes nothing, so it always may). ``back``: a device eviction's,
        which ``write_through`` writes into exclusive tiers only."""
        for tier in self.tiers:
            if back and self.write_policy == "write_through" and not tier.exclusive:
                continue
            first = tier.writes_from(start)
            held, fresh = tier.store(tokens, namespace, hints, displace or not tier.exclusive, first)
            if len(fresh):
                skip = first + len(held)
                self._copy(Copy(DEVICE, tier.name, slots[skip : skip + len(fresh)], fresh))
                tier.keep(tokens, held, fresh, namespace, hints, first)
                self.written_tokens[tier.name] += len(fresh)

    def _demote(self, tokens: np.ndarray, namespace: Hashable, tiers: Sequence[Tier] | None = None) -> None:
        """The device holds ``tokens``: under ``EXCLUSIVE`` write policies each exclusive tier of ``tiers`` (all
        by default) demotes its copy of them."""
        if self.write_policy in EXCLUSIVE and len(tokens):
            for tier in self.tiers if tiers is None else tiers:
                if tier.exclusive:
                    tier.demote(tokens, namespace)

    def _copy(self, copy: Copy) -> None:
        if self.mover is not None:
            self.mover(copy)
        self.copies.append(copy)

    def take_copies(self) -> list[Copy]:
        """The copies since the last call, in order (the simulator charges their time)."""
        out, self.copies = self.copies, []
        return out

    def flush(self, allocator: SlotAllocator) -> int:
        """Drop every unlocked entry of the device tier (its slots to ``allocator``, the device's) and of each
        lower tier but a shared store (other replicas use it), writing nothing down: a flush discards, under
        ``write_back`` too. The device slots freed. Not all or nothing: after a fault part way (a listener's)
        the caller recovers as after a failed step (``unlock_all``, then its allocator ``retain``s). O(cache)."""
        freed = self.device.evict(self.device.evictable_size)
        allocator.free(freed)
        for tier in self._own_tiers:
            tier.allocator.free(tier.cache.evict(tier.cache.evictable_size))
        return len(freed)

    # ------------------------------------------------------------------ books
    def stats(self) -> dict[str, Any]:
        """The device tier's lookup statistics, and tokens loaded and written per lower tier."""
        return {**self.device.stats(), "loaded_tokens": dict(self.loaded_tokens),
                "written_tokens": dict(self.written_tokens),
                "tier_tokens": {DEVICE: self.device.total_size, **{t.name: t.cache.total_size for t in self.tiers}}}

    def unlock_all(self) -> None:
        """Every tier's locks go, and each lower tier's allocator takes back what its cache does not hold
        (a write that failed between allocating and inserting)."""
        self.device.unlock_all()
        for tier in self.tiers:
            tier.cache.unlock_all()
            tier.allocator.retain(tier.cache.held_slots())

    def check_invariants(self) -> None:
        """Each tier's own invariants (no slot held twice in any tier, every lower slot free or held)."""
        self.device.check_invariants()
        for tier in self.tiers:
            tier.check_invariants()

    def reset(self) -> None:
        """Empty every tier (a shared store stays: other replicas use it) and zero the counters."""
        self.device.reset()
        for tier in self._own_tiers:
            tier.reset()
        self.copies, self._uses = [], {}
        self.reset_transfer_counts()

    def reset_transfer_counts(self) -> None:
        """Zero the tokens loaded and written per tier (the engine's ``reset_stats``)."""
        self.loaded_tokens = dict.fromkeys(self.loaded_tokens, 0)
        self.written_tokens = dict.fromkeys(self.written_tokens, 0)

    def to_dict(self, namespace: Hashable = None) -> dict:
        return self.device.to_dict(namespace)

    def pretty_print(self) -> str:
        tiers = [f"{t.name}: {t.cache.pretty_print()}" for t in self.tiers]
        return "\n".join([f"device: {self.device.pretty_print()}", *tiers])

    def __repr__(self) -> str:
        sizes = ", ".join(f"{t.name}={t.cache.total_size}/{t.allocator.capacity}" for t in self.tiers)
        return f"TieredCache({self.device!r}, {sizes}, write_policy={self.write_policy!r})"


def _within(a: Evicted, b: Evicted) -> bool:
    """Whether ``a``'s prefix is a prefix of ``b``'s (the same namespace). O(len(a))."""
    n = len(a.tokens)
    return a.namespace == b.namespace and n <= len(b.tokens) and np.array_equal(a.tokens, b.tokens[:n])


def _last_entry(node: Any) -> Any:
    """A device match handle's last entry: the radix node itself, a block chain's last block."""
    blocks = getattr(node, "blocks", None)
    return node if blocks is None else blocks[-1]


def _attached(entry: Any) -> bool:
    """Whether a radix node or a block is still in its cache."""
    return entry.cached if hasattr(entry, "cached") else entry.parent is not None


def _with_medium(listener: CacheListener, medium: str) -> CacheListener:
    def tagged(event: Any) -> None:
        listener(replace(event, medium=medium) if hasattr(event, "medium") else event)
    return tagged


def device_policy(cache: PrefixCache) -> Any:
    """The eviction policy of ``cache``'s device tier, with what it learned (None: a cache without one)."""
    return getattr(cache.device if isinstance(cache, TieredCache) else cache, "policy", None)


def eviction_policies(cache: PrefixCache) -> list:
    """The eviction policy objects of ``cache``: its own, or a tiered cache's device tier's and each lower
    tier's (each tier ranks by a policy of its own); none for a cache without one (``NoPrefixCache``)."""
    if isinstance(cache, TieredCache):
        return [p for each in (cache.device, *(t.cache for t in cache.tiers)) for p in eviction_policies(each)]
    policy = getattr(cache, "policy", None)
    return [] if policy is None else [policy]
