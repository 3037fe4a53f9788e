"""``SegmentTier``: a lower tier that keeps what the device dropped as segments, each hung below the prefix
the device still held when it dropped it, so the tier holds no copy of that prefix (SGLang's HiCache layout,
one tree whose nodes live on the device, the host or both, built from a prefix cache per segment).

A ``Tier`` is a prefix tree: keeping a context's tail keeps its whole prefix, so below a device that still
holds the prefix the tier spends its memory on copies of it. A ``SegmentTier`` writes a write-back's tokens
from ``start``, the device's held length after the eviction, into a namespace of their own, named by the
original namespace, ``start`` and a digest of the ``start`` tokens before it (``Segment``). A lookup walks the
segments that start where the prompt's cover so far ends (the device's match, then each segment's end), so a
prompt is read from the device, then from segment after segment; whole-prefix writes (start 0, as
``write_through``'s at insert) stay in the namespace itself. A segment whose prefix neither the device nor
the tier holds any longer cannot be reached: its entries are never refreshed and go in the policy's order.

The digest is checked only for the starts this tier holds in the prompt's namespace (a sorted index), by one
incremental hash over the prompt: O(prompt tokens) per lookup, on top of the matches.

``ChainTier`` (``host_layout="chains"``) writes the same segments, each write continuing the chain a lookup
would read, so no token is kept twice.
"""

from __future__ import annotations

import hashlib
from collections.abc import Hashable, Iterator
from typing import Any, NamedTuple

import numpy as np
from sortedcontainers import SortedDict

from radixkv.cache.base import NO_HINTS, CacheHints, MatchResult, PrefixCache
from radixkv.cache.tiered import Tier
from radixkv.memory import SlotAllocator


class Segment(NamedTuple):
    """The namespace of the tokens a tier keeps from ``start`` on below ``prefix``, a digest of the tokens of
    ``namespace`` before ``start``."""

    namespace: Hashable
    start: int
    prefix: bytes


def prefix_digest(tokens: np.ndarray) -> bytes:
    """The digest naming a segment's prefix: BLAKE2b (16 bytes) of the int64 token ids. O(tokens)."""
    return hashlib.blake2b(np.ascontiguousarray(tokens, dtype=np.int64), digest_size=16).digest()


def segment_key(namespace: Hashable, tokens: np.ndarray, start: int) -> Hashable:
    """The namespace a tier keeps ``tokens`` from ``start`` on in: the namespace itself at 0, else their
    ``Segment``. O(start): the digest."""
    return namespace if start == 0 else Segment(namespace, start, prefix_digest(tokens[:start]))


class SegmentTier(Tier):
    """A ``Tier`` keeping write-backs as segments below the prefix the device holds (see the module doc).

    ``node_tokens``: the longest node a write makes (a multiple of the page). The tier evicts whole leaves, so
    a write that makes room frees up to a node more than it needs; a context written as one 100k-token node
    would leave that much of the tier empty until the next writes fill it. Writes cost O(tokens /
    node_tokens) inserts; lookups O(prompt tokens) hashing plus a match per segment met."""

    def __init__(self, name: str, cache: PrefixCache, allocator: SlotAllocator, shared: bool = False,
                 buffer: Any = None, node_tokens: int = 1024):
        super().__init__(name, cache, allocator, shared, buffer)
        if not hasattr(cache, "root_of"):
            raise ValueError(f"tier {name!r}: segments need a radix cache (one that names its namespaces' roots)")
        if isinstance(node_tokens, bool) or not isinstance(node_tokens, int) or node_tokens < 1 \
                or node_tokens % cache.page_size:
            raise ValueError(f"tier {name!r}: node_tokens must be a positive multiple of the page "
                             f"{cache.page_size}, got {node_tokens!r}")
        self.node_tokens = node_tokens
        self._starts: dict[Hashable, SortedDict] = {}  # namespace -> {start: {digests}}: the segments written
        self._count, self._bound = 0, 1024  # registered segments; when to drop the emptied ones
        self._last: tuple | None = None  # the last key made, for the write that made it (store, then keep)

    def writes_from(self, start: int) -> int:
        """A write begins where the device's held prefix ends."""
        return start

    def _key(self, namespace: Hashable, tokens: np.ndarray, start: int, made: bool = False) -> Hashable:
        """The namespace of ``tokens`` from ``start`` on; ``made``: the one ``store`` just made for this write
        (``keep`` right after it), if it is (the digest is O(start))."""
        if start == 0:
            return namespace
        last, self._last = self._last, None
        if made and last is not None and last[0] is tokens and last[1] == (namespace, start):
            return last[2]
        key = segment_key(namespace, tokens, start)
        self._last = None if made else (tokens, (namespace, start), key)
        return key

    def store(self, tokens: np.ndarray, namespace: Hashable, hints: CacheHints = NO_HINTS, displace: bool = True,
              start: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """``Tier.store`` for the tokens from ``start`` on, in their segment (the namespace itself at 0)."""
        return super().store(tokens[start:], self._key(namespace, tokens, start), hints, displace)

    def keep(self, tokens: np.ndarray, held: np.ndarray, fresh: np.ndarray, namespace: Hashable,
             hints: CacheHints = NO_HINTS, start: int = 0) -> None:
        """``Tier.keep`` for the tokens from ``start`` on, in nodes of at most ``node_tokens``; the segment joins
        the index."""
        key = self._key(namespace, tokens, start, made=True)
        self._insert(tokens[start:], held, fresh, key, hints)
        if start and len(fresh):
            self._register(key)

    def _insert(self, own: np.ndarray, held: np.ndarray, fresh: np.ndarray, key: Hashable, hints: CacheHints) -> None:
        """Insert the leading tokens of ``own`` at ``held`` (the tier's already) then ``fresh`` into ``key``'s tree,
        in nodes of at most ``node_tokens``; fresh slots another writer filled first are freed."""
        slots = np.concatenate([held, fresh])
        n = len(slots)
        already = self.cache.held_length(own[:n], key)  # another writer's since ``store``: those stay theirs
        self.allocator.free(fresh[: max(already - len(held), 0)])
        step = self.node_tokens
        for stop in range(min(already + step, n), n + step, step):  # nodes of at most node_tokens
            self.cache.insert(own[: min(stop, n)], slots[: min(stop, n)], key, hints)

    def _register(self, key: Segment) -> None:
        """A segment written: it joins the sorted index of its namespace's starts."""
        digests = self._starts.setdefault(key.namespace, SortedDict()).setdefault(key.start, set())
        if key.prefix not in digests:
            digests.add(key.prefix)
            self._count += 1
            if self._count > self._bound:
                self._drop_emptied()

    def _segments(self, tokens: np.ndarray, namespace: Hashable) -> Iterator[tuple[int, Segment]]:
        """The segments of ``namespace`` below a prefix of ``tokens``, ascending by start, lazily (a caller
        stops once the starts pass what it reads): (start, key). Emptied ones leave the index. O(tokens
        hashed, up to the last start yielded) + O(starts in the namespace)."""
        starts = self._starts.get(namespace)
        if not starts:
            return
        tokens = np.ascontiguousarray(tokens, dtype=np.int64)  # hashed in place
        h, done = hashlib.blake2b(digest_size=16), 0
        for p in list(starts.irange(1, len(tokens) - 1)):  # a copy: emptied segments leave as we go
            h.update(tokens[done:p])
            done = p
            key = Segment(namespace, p, h.copy().digest())
            if key.prefix not in starts.get(p, ()):
                continue
            if self.cache.root_of(key) is None:  # emptied by the tier's evictions
                self._forget(key)
                continue
            yield p, key

    def find(self, tokens: np.ndarray, namespace: Hashable, hints: CacheHints, start: int, held: int
             ) -> list[MatchResult]:
        """The namespace's own match, then each segment that extends the cover, in order (indices before a
        segment's start are -1: the tier holds none of them); copies of the ``held`` leading tokens are demoted.
        O(tokens) hashing plus a match per segment met."""
        matches = super().find(tokens, namespace, hints, start, held)  # the namespace's own, whole prefixes
        cover = matches[-1].length if matches else start
        for p, key in self._segments(tokens, namespace):
            if p > max(cover, held):  # nothing reaches it: the prompt's cover ends before
                break
            sm = self.cache.match_prefix(tokens[p:], key, hints)
            if held > p:
                self.cache.demote(tokens[p:held], key)
            if p + sm.length > cover:
                matches.append(MatchResult(p + sm.length, np.concatenate([np.full(p, -1, np.int64), sm.indices]),
                                           sm.node))
                cover = p + sm.length
        return matches

    def demote(self, tokens: np.ndarray, namespace: Hashable) -> None:
        """Demote the copies of ``tokens`` in the namespace itself and in every segment below a prefix of it."""
        self.cache.demote(tokens, namespace)
        for p, key in self._segments(tokens, namespace):
            self.cache.demote(tokens[p:], key)

    def _forget(self, key: Segment) -> None:
        starts = self._starts[key.namespace]
        digests = starts[key.start]
        digests.discard(key.prefix)
        self._count -= 1
        if not digests:
            del starts[key.start]
            if not starts:
                del self._starts[key.namespace]

    def _drop_emptied(self) -> None:
        for ns, starts in list(self._starts.items()):
            for p, digests in list(starts.items()):
                for d in list(digests):
                    if self.cache.root_of(Segment(ns, p, d)) is None:
                        self._forget(Segment(ns, p, d))
        self._bound = max(1024, 2 * self._count)

    def reset(self) -> None:
        super().reset()
        self._starts.clear()
        self._count, self._bound, self._last = 0, 1024, None


class ChainTier(SegmentTier):
    """``chains``: a ``SegmentTier`` whose writes continue the chain a lookup would read instead of starting a
    segment of their own. ``SegmentTier`` writes every write-back into the segment at its start, so a context
    written back in parts, or again after a load, can be kept twice (a piece in an older segment and a copy
    in the new one); here a write walks the chain from its start first (as ``find``: each piece refreshed,
    the device's ``start`` tokens demoted again), keeps what the tier covers and hangs only the rest below the
    chain's last piece, in that piece's namespace. Each token is kept once and a context ages as one chain.

    On the agentic trace (``llama3-70b-8xh100``, radix page 64, ``write_back``, ``session``; docs/agentic.md,
    *Sessions at the cliff*) it is the better layout at 64 sessions (4M + 4M: 7.84 s mean TTFT against 10.11
    s) and the worse at 16 (1M + 1M: 5.18 s against 4.09 s) in the first arrival order, and within 3% of
    ``segments`` at both in a second (3.17 s against 3.11 s, 5.12 against 5.29): the replays near the cliff
    turn on small differences of timing. Radix only, as ``SegmentTier``."""

    def __init__(self, name: str, cache: PrefixCache, allocator: SlotAllocator, shared: bool = False,
                 buffer: Any = None, node_tokens: int = 1024):
        super().__init__(name, cache, allocator, shared, buffer, node_tokens)
        self._write_plan: tuple | None = None  # what ``store`` found for the ``keep`` that follows it

    def store(self, tokens: np.ndarray, namespace: Hashable, hints: CacheHints = NO_HINTS, displace: bool = True,
              start: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """``Tier.store`` for the tokens from ``start`` on. What the tier's segments already cover from there (the
        chain ``find`` walks, each piece refreshed, the device's ``start`` tokens demoted again) is ``held``,
        and room is made for the rest, which ``keep`` hangs below the chain's last piece (in its namespace) or,
        with no chain, in a segment of its own at ``start``. So a context written back in parts, or again after
        a load, is kept once, as one chain that ages as one: a copy in a second segment would go in LRU order
        before the first and cut the chain. O(tokens) hashing plus a match per segment met, and the eviction."""
        n = self.cache.cacheable_length(len(tokens))
        chain = self.find(tokens[:n], namespace, hints, start, start)
        cover, pieces = start, []
        for m in chain:  # each match's indices are in the prompt's coordinates, reaching past the cover so far
            pieces.append(m.indices[cover : m.length])
            cover = m.length
        held = np.concatenate(pieces) if pieces else np.zeros(0, np.int64)
        last = chain[-1] if chain else None
        p = start if last is None else int(np.count_nonzero(last.indices < 0))  # where the last piece starts
        key = segment_key(namespace, tokens, p) if last is None or p else namespace
        self._write_plan = (tokens, namespace, start, p, key, held[:0] if last is None else last.indices[p:cover])
        if cover >= n:
            return held, held[:0]
        return held, self._fresh([m.node for m in chain], n - cover, displace)

    def keep(self, tokens: np.ndarray, held: np.ndarray, fresh: np.ndarray, namespace: Hashable,
             hints: CacheHints = NO_HINTS, start: int = 0) -> None:
        """Insert the pages ``store`` made room for (at ``fresh``, their KV copied) below the chain it found, in
        nodes of at most ``node_tokens``; a new segment joins the index."""
        cover = start + len(held)
        plan, self._write_plan = self._write_plan, None
        if plan is not None and plan[0] is tokens and plan[1:3] == (namespace, start):
            _, _, _, p, key, below = plan  # below the chain's last piece, in its namespace (or a new segment)
        else:  # not the write ``store`` planned: a segment of its own from the cover on
            p, key, below = cover, segment_key(namespace, tokens, cover), held[:0]
        self._insert(tokens[p:], below, fresh, key, hints)
        if p and len(fresh):
            self._register(key)

    def reset(self) -> None:
        super().reset()
        self._write_plan = None


# the class of a lower tier per ``HOST_LAYOUTS`` name (``radixkv.stack.lower_tier`` builds them)
TIER_KINDS: dict[str, type[Tier]] = {"prefix": Tier, "segments": SegmentTier, "chains": ChainTier}
