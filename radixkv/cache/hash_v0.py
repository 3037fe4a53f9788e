"""vLLM v0's Automatic Prefix Caching (``BlockSpaceManagerV1``, vLLM 0.4-0.5), behind the ``PrefixCache`` contract.

The ancestor of :class:`~radixkv.cache.hash_block.HashBlockCache` (v1), kept
to pin down how the two differ:

* **Whole-prefix hashes.** Block i's identity is v0's ``hash_of_block``:
  ``hash((tuple(tokens[:(i + 1) * block_size]), namespace))``, Python's
  built-in hash of the request's *whole* token prefix up to the end of the
  block (the namespace stands in for v0's LoRA id). Nothing is chained or
  remembered: every lookup and insert hashes each full block's prefix from
  token 0, O(prefix length) per block, so a request of L tokens costs
  O(L^2 / block_size) hashed tokens (``stats()["hashed_tokens"]`` counts
  them). The flat ``hash -> block`` table still acts as a prefix tree, a key
  naming the path from the root.
* **Collisions are trusted.** The hash is 64 bits and, as in v0, a lookup
  never compares tokens (namespaces it does, below): two prefixes with the
  same hash would share a block, and the second request would silently
  attend to the first one's KV (wrong outputs, no error). ``check_invariants`` only checks that each block's key
  is the hash of the prefix it stored.
* Only full blocks are cached; a partial last block stays with the request.
* **v0's evictor.** Among unlocked blocks (v0's ``ref_count == 0``) the least
  recently accessed leaves first, ties to the block with the most hashed
  tokens (the deepest). It never looks at the tree, so it can evict a parent
  before its child: the child stays in the table (and in ``total_size``) but
  can never be matched again, since a match walks from the first block and
  stops at the missing parent, until a later insert of the same prefix
  replaces it. v1 never strands a block that way (children first). With the
  access stamps below a child is never more recent than its parent (every
  access walks from the root), so through this API the stranding needs
  stamps set by hand; the evictor's rule is kept as v0 had it.
* **Access stamps.** A logical clock ticks once per operation; ``match_prefix``
  stamps the blocks it hits, ``insert`` every block it covers, ``unlock`` every
  block of the handle (v0 stamps a running sequence's blocks each step).
* **Dedup on promotion.** v0 gives a block that fills during decode its real
  hash and, if that hash is cached already, frees the sequence's copy and uses
  the cached block. Here the engine inserts computed prefixes with ``insert``
  (``commit_prefix``/``release_sequence``), which returns how many leading
  tokens were cached already: the caller frees its copies of those. A block
  found in the table past that leading run (a stranded child) gives way to
  the caller's copy, which the caller goes on using; its slots go to a pile
  of spare slots that ``evict`` hands back first.
* **Namespaces** are compared by equality (the table is keyed by hash and
  namespace), where v0 trusted the hash alone: ``hash(-1) == hash(-2)``.
* **Events** (:mod:`radixkv.cache.events`) name blocks by their table keys ``(hash, namespace)``: an
  insert's new blocks are one ``BlockStored``; an evicted block, and a stranded one an insert replaces
  (before the store that reuses its key), a ``BlockRemoved``. A stranded block stays stored, unreachable
  in an events-fed index as in the table; spare slots are no block and make no event. The listener hears
  of a change once the table's books hold it, so a listener that raises leaves every invariant whole.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable, Hashable
from typing import Any, NamedTuple

import numpy as np

from radixkv.cache.base import NO_HINTS, CacheHints, LockError, MatchResult, TokenSeq, all_unique, as_token_array
from radixkv.cache.block import BlockBooks
from radixkv.cache.events import AllBlocksCleared, BlockRemoved, BlockStored, CacheListener
from radixkv.cache.invariants import requirer
from radixkv.cache.render import block_tree, draw_block_tree
from radixkv.cache.tiers import Untiered

_EMPTY = np.zeros(0, dtype=np.int64)


class V0Block:
    """One cached block: its own tokens and a link to its parent block, from which ``prefix`` (what the key
    hashes) is rebuilt. Keeping the whole prefix per block would take O(L^2 / block_size) memory per request."""

    __slots__ = ("key", "parent", "namespace", "tokens", "num_hashed_tokens", "slots", "lock_count",
                 "own_lock_count", "last_access", "hit_count", "stamp", "cached")

    def __init__(self, key: int, parent: V0Block | None, namespace: Hashable, tokens: tuple, slots: np.ndarray,
                 now: int):
        self.key, self.parent, self.namespace, self.tokens, self.slots = key, parent, namespace, tokens, slots
        # v0's num_hashed_tokens: the length of the prefix the key hashes (depth x block size)
        self.num_hashed_tokens = len(tokens) + (parent.num_hashed_tokens if parent is not None else 0)
        self.lock_count = self.own_lock_count = self.hit_count = 0
        self.last_access = now
        self.stamp = -1
        self.cached = True

    @property
    def parent_key(self) -> int | None:
        return None if self.parent is None else self.parent.key

    @property
    def prefix(self) -> tuple:
        """The whole token prefix up to this block's end, rebuilt through the parents. O(num_hashed_tokens)."""
        parts, node = [], self
        while node is not None:
            parts.append(node.tokens)
            node = node.parent
        return tuple(t for part in reversed(parts) for t in part)

    def __repr__(self) -> str:
        return f"V0Block(hashed={self.num_hashed_tokens}, lock={self.lock_count}, last_access={self.last_access})"


class V0Chain(NamedTuple):
    """Handle returned by ``match_prefix``: the matched blocks, first to last, and the cache that made it."""

    blocks: tuple
    owner: Any = None


class HashV0Cache(BlockBooks, Untiered):
    """Prefix cache of full blocks keyed by hashes of whole prefixes, with v0's LRU evictor.

    Args:
        block_size: tokens per block; only full blocks are cached.
        eviction_policy: ``lru`` only (v0's evictor: least recently accessed, ties deepest first).

    Costs (L = query tokens, b = L // block_size, n = cached blocks): ``match_prefix``
    O(L x hit blocks) hashing; ``insert`` O(L^2 / block_size) hashing plus
    O(b log n); ``lock`` O(blocks in the handle); ``unlock`` O(blocks x log n);
    ``evict`` O(k log n) amortized for k blocks.

    >>> cache = HashV0Cache(block_size=4)
    >>> cache.insert(list(range(10)), list(range(100, 110)))   # 2 full blocks
    0
    >>> cache.match_prefix(list(range(8)) + [99] * 6).length, cache.total_size
    (8, 8)
    >>> cache.stats()["hashed_tokens"]            # whole prefixes: insert 4 + 8, match 4 + 8 + 12 (a miss)
    36
    """

    caches_during_decode = True  # a block filled while decoding is cached at once (v0's promotion)

    def __init__(self, block_size: int = 16, eviction_policy: str = "lru"):
        super().__init__(block_size)
        if eviction_policy != "lru":
            raise ValueError(f"HashV0Cache has only v0's evictor, eviction_policy='lru'; got {eviction_policy!r}")
        self.eviction_policy = eviction_policy
        self.hash_algo = "builtin"
        self.clock: Callable[[], float] = time.monotonic  # the protocol's; v0's evictor reads its own ticks
        self.listener: CacheListener | None = None  # called with every CacheEvent; kept across reset
        self.reset()

    def reset(self) -> None:
        """Drop every block and spare slot (old handles can no longer be locked); counters at zero. O(blocks)."""
        for block in getattr(self, "_blocks", {}).values():
            block.cached = False
            block.lock_count = block.own_lock_count = 0
        self._blocks: dict[tuple[int, Hashable], V0Block] = {}  # (key, namespace): namespaces by equality
        self._spare: list[np.ndarray] = []  # callers' copies of blocks the table already held (see insert)
        self._heap: list[tuple[int, int, int, V0Block]] = []  # (last_access, -hashed tokens, seq, block), lazy
        self._spare_tokens = self._seq = self._protected_blocks = self._clock = 0
        self._queried_tokens = self._hit_tokens = self._hashed_tokens = 0
        self.root = V0Chain((), self)
        if self.listener is not None:
            self.listener(AllBlocksCleared())

    # ------------------------------------------------------------- sizes
    @property
    def total_size(self) -> int:
        """Tokens held: cached blocks (stranded ones included) plus spare slots awaiting ``evict``."""
        return len(self._blocks) * self.block_size + self._spare_tokens

    def stats(self) -> dict[str, float]:
        """Token-weighted lookup statistics and the tokens hashed since construction or ``reset``."""
        return {**super().stats(), "hashed_tokens": self._hashed_tokens}

    def hash_of_block(self, tokens: list[int], index: int, namespace: Hashable = None) -> tuple[int, tuple]:
        """v0's ``hash_of_block``: ``(hash((prefix, namespace)), prefix)`` with prefix = the tokens up to the
        end of block ``index``. O((index + 1) x block_size), counted in ``stats()["hashed_tokens"]``."""
        prefix = tuple(tokens[: (index + 1) * self.block_size])
        self._hashed_tokens += len(prefix)
        return hash((prefix, namespace)), prefix

    # ------------------------------------------------------------- public
    def match_prefix(self, tokens: TokenSeq, namespace: Hashable = None, hints: CacheHints = NO_HINTS) -> MatchResult:
        """Hash block after block from the first; stop at the first hash not in the table.

        Hit blocks get the access stamp and a hit. O(L x (hit blocks + 1)) hashed tokens.
        """
        arr = as_token_array(tokens)
        self._queried_tokens += len(arr)
        self._clock += 1
        toks, hit = arr.tolist(), []
        for i in range(len(toks) // self.block_size):
            block = self._blocks.get((self.hash_of_block(toks, i, namespace)[0], namespace))
            if block is None:
                break
            block.hit_count += 1
            hit.append(block)
        if not hit:
            return MatchResult(0, _EMPTY.copy(), self.root)
        self._touch(hit)
        length = len(hit) * self.block_size
        self._hit_tokens += length
        return MatchResult(length, np.concatenate([b.slots for b in hit]), V0Chain(tuple(hit), self))

    def insert(self, tokens: TokenSeq, indices: TokenSeq, namespace: Hashable = None,
               hints: CacheHints = NO_HINTS) -> int:
        """Cache every full block of ``tokens``; return how many leading tokens were cached already.

        The caller frees ``indices[k:returned]`` (k = what it matched) as
        duplicates, and the cache takes the slots of the blocks after that. A
        later block already in the table (a stranded child, which no lookup
        reaches and no request holds) gives way to the caller's copy: its own
        slots join the spare slots ``evict`` returns first, so the caller never
        keeps a slot the cache also holds. Every covered block is stamped.
        O(L^2 / block_size) hashed tokens + O(blocks log n).
        """
        arr, idx = as_token_array(tokens), as_token_array(indices)
        if len(idx) != len(arr):
            raise ValueError(f"tokens and indices differ in length: {len(arr)} != {len(idx)}")
        self._clock += 1
        bs, toks = self.block_size, arr.tolist()
        covered, leading, parent, events = [], None, None, []
        for i in range(len(toks) // bs):
            key, prefix = self.hash_of_block(toks, i, namespace)
            block = self._blocks.get((key, namespace))  # the namespace compared too: hash(-1) == hash(-2)
            if block is not None and leading is not None:  # cached past a missing block: stranded
                events.append(self._strand(block))
                block = None
            if block is None:
                if leading is None:
                    leading = i
                block = V0Block(key, parent, namespace, prefix[-bs:], idx[i * bs : (i + 1) * bs].copy(), self._clock)
                self._blocks[(key, namespace)] = block
            covered.append(block)
            parent = block
        self._touch(covered)
        if leading is not None and self.listener is not None:  # told once the books hold the insert
            for event in events:  # the stranded blocks left before the store that reuses their keys
                self.listener(event)
            self._stored(covered, leading, toks, namespace)  # every block from the first new one on is new
        return (len(covered) if leading is None else leading) * bs

    def lock(self, node: V0Chain) -> None:
        """Take one lock on every block of the handle (v0's ``ref_count``). O(blocks in the handle).

        The last block also counts the handle's own locks, so ``unlock`` can
        refuse a handle that was never locked itself. Raises ``LockError`` for a
        handle from another cache or one of whose blocks is no longer cached.
        """
        blocks = self._own(node)
        if not all(block.cached for block in blocks):
            raise LockError("cannot lock a handle one of whose blocks was evicted")
        for block in blocks:
            if not block.lock_count:
                self._protected_blocks += 1
            block.lock_count += 1
        if blocks:
            blocks[-1].own_lock_count += 1

    def unlock(self, node: V0Chain) -> None:
        """Release one lock of every block of the handle and stamp them all; changes nothing on ``LockError``.

        Raises ``LockError`` for a handle from another cache, a block whose
        count is already 0 (which includes every block from before ``reset``),
        or a handle that holds no lock of its own. O(blocks x log n).
        """
        blocks = self._own(node)
        bad = next((b for b in blocks if not b.lock_count), None)
        if bad is not None:
            raise LockError(f"unlock of {bad!r} whose lock count is already 0 (or no longer cached)")
        if blocks and not blocks[-1].own_lock_count:
            raise LockError(f"unlock of a handle ending at {blocks[-1]!r}, which holds no lock of its own")
        if blocks:
            blocks[-1].own_lock_count -= 1
        for block in blocks:
            block.lock_count -= 1
            if not block.lock_count:
                self._protected_blocks -= 1
        self._clock += 1
        self._touch(blocks)

    def held_length(self, tokens: TokenSeq, namespace: Hashable = None) -> int:
        """Leading tokens (whole blocks) the table holds, touching nothing. O(L x (held blocks + 1))."""
        toks, n = as_token_array(tokens).tolist(), 0
        blocks = len(toks) // self.block_size
        while n < blocks and (self.hash_of_block(toks, n, namespace)[0], namespace) in self._blocks:
            n += 1
        return n * self.block_size

    def demote(self, tokens: TokenSeq, namespace: Hashable = None) -> int:
        """v0's evictor has no demotion: nothing moves (0 tokens)."""
        return 0

    def evict(self, num_tokens: int, victims: list | None = None, demoted_only: bool = False) -> np.ndarray:
        """Free spare slots, then unlocked blocks in v0's order, until ``num_tokens`` are freed or none is left.

        v0's order: least recently accessed first, ties to the most hashed
        tokens. A parent may leave before its child (see the module docs).
        Returns the freed slots; the caller gives them back. O(k log n) amortized. v0 demotes nothing, so
        ``demoted_only`` frees nothing; it keeps no prefix chains, so ``victims`` raises ``ValueError``.
        """
        if victims is not None:
            raise ValueError("hash-v0 records no evicted prefixes: it cannot sit in a tier")
        if demoted_only:
            return np.zeros(0, dtype=np.int64)
        freed, count = [], 0
        while self._spare and count < num_tokens:
            slots = self._spare.pop()
            self._spare_tokens -= len(slots)
            freed.append(slots)
            count += len(slots)
        while count < num_tokens and self._heap:
            _, _, seq, block = heapq.heappop(self._heap)
            if not self._live(seq, block):
                continue
            event = self._drop(block)
            freed.append(block.slots)
            count += self.block_size
            if event is not None:  # told once the books hold the removal: a listener that raises breaks nothing
                self.listener(event)
        return np.concatenate(freed) if freed else _EMPTY.copy()

    def _drop(self, block: V0Block) -> BlockRemoved | None:
        """Take an unlocked block out of the table: the event the caller tells the listener once its books are
        whole (None without a listener). O(1)."""
        del self._blocks[(block.key, block.namespace)]
        block.cached = False
        return None if self.listener is None else BlockRemoved(((block.key, block.namespace),), block.namespace)

    def _strand(self, block: V0Block) -> BlockRemoved | None:
        """Drop a stranded block (unlocked: its missing parent held no lock) for the caller's copy; its slots
        join the spare ones. Its removal's event (the listener hears it before the store that reuses its key)."""
        self._spare.append(block.slots)
        self._spare_tokens += self.block_size
        return self._drop(block)

    def _stored(self, covered: list[V0Block], leading: int, toks: list[int], namespace: Hashable) -> None:
        """Tell the listener about ``covered[leading:]``, an insert's new blocks. Block hashes are the table's
        keys, ``(hash, namespace)``: the hash alone may repeat across namespaces (``hash(-1) == hash(-2)``)."""
        bs = self.block_size
        parent = (covered[leading - 1].key, namespace) if leading else None
        self.listener(BlockStored(tuple((b.key, namespace) for b in covered[leading:]), parent,
                                         tuple(toks[leading * bs : len(covered) * bs]), bs, namespace))

    def held_slots(self) -> np.ndarray:
        """Every slot index held: the cached blocks' (stranded ones included) and the spare slots. O(blocks)."""
        return np.concatenate([block.slots for block in self._blocks.values()] + self._spare + [_EMPTY])

    def unlock_all(self) -> None:
        """Drop every lock (for a caller whose books are lost, e.g. after a failed step); blocks stay. O(b log n)."""
        self._touch(self._drop_locks())

    # ------------------------------------------------------------- internals
    def _own(self, node: Any) -> tuple:
        """The handle's blocks, or ``LockError`` for a handle of another cache."""
        if not isinstance(node, V0Chain) or node.owner is not self:
            raise LockError(f"{node!r} is not a handle of this HashV0Cache")
        return node.blocks

    def _live(self, seq: int, block: V0Block) -> bool:
        """Whether a heap entry is the block's current one and the block may leave. O(1)."""
        return block.cached and block.stamp == seq and not block.lock_count

    def _touch(self, blocks: list | tuple) -> None:
        """Stamp ``blocks`` with the clock and re-rank the unlocked ones. O(blocks x log n)."""
        now = self._clock
        for block in blocks:
            block.last_access = now
            if not block.lock_count:
                self._seq += 1
                block.stamp = self._seq
                heapq.heappush(self._heap, (now, -block.num_hashed_tokens, self._seq, block))
        if len(self._heap) > 2 * (len(self._blocks) - self._protected_blocks) + 64:  # 2 x the unlocked blocks
            self._heap = [e for e in self._heap if self._live(e[2], e[3])]
            heapq.heapify(self._heap)

    # ------------------------------------------------------------- inspection
    def check_invariants(self) -> None:
        """Verify every invariant (keys: whole-prefix hashes, lock counts, sizes, the evictor's heap and slots);
        raise ``AssertionError`` naming the broken one. O(cached prefix tokens + heap)."""
        require = requirer("HashV0Cache")
        bs, locked, through = self.block_size, 0, {}
        for key, block in self._blocks.items():
            require(key == (block.key, block.namespace) and block.cached, "table keys match their blocks", block)
            require(len(block.slots) == bs and block.slots.dtype == np.int64, "blocks are full int64 slots", block)
            prefix = block.prefix
            require(len(block.tokens) == bs and len(prefix) == block.num_hashed_tokens, "blocks hold whole blocks",
                    block)
            require(hash((prefix, block.namespace)) == block.key, "key = hash((whole prefix, namespace))", block)
            parent = None if len(prefix) == bs else hash((prefix[:-bs], block.namespace))
            require(block.parent_key == parent, "parent key = hash of the prefix one block shorter", block)
            require(block.lock_count >= 0 and block.own_lock_count >= 0, "lock counts >= 0", block)
            locked += block.lock_count > 0
            node, locks = block, block.own_lock_count
            while locks and node is not None:  # a locked chain is whole: its parents are cached
                through[id(node)] = through.get(id(node), 0) + locks
                parent_key = node.parent_key
                node = None if parent_key is None else self._blocks.get((parent_key, node.namespace))
                require(parent_key is None or node is not None, "a locked block's parent is cached", block)
        for block in self._blocks.values():
            require(block.lock_count == through.get(id(block), 0), "lock_count = own locks of the handles through it",
                    block)
        require(locked == self._protected_blocks, "sizes: protected", (locked, self._protected_blocks))
        require(self._spare_tokens == sum(len(s) for s in self._spare), "sizes: spare slots")
        require(self.total_size == self.evictable_size + self.protected_size, "sizes: total = evictable + protected")
        live = {id(e[3]) for e in self._heap if self._live(e[2], e[3])}
        for block in self._blocks.values():
            require(block.lock_count > 0 or id(block) in live, "every unlocked block is ranked", block)
        require(all_unique(self.held_slots()), "slot indices unique across the cache")

    def stranded(self) -> int:
        """Cached blocks whose parent is not cached (never matchable until a re-insert revives them). O(blocks)."""
        return sum(b.parent_key is not None and (b.parent_key, b.namespace) not in self._blocks
                   for b in self._blocks.values())

    def to_dict(self, namespace: Hashable = None) -> dict[str, Any]:
        """The reachable blocks of one namespace as a tree of nested dicts (stranded blocks left out). O(blocks)."""
        blocks = [block for block in self._blocks.values() if block.namespace == namespace]
        return block_tree(blocks, None, lambda block: list(block.tokens))

    def pretty_print(self) -> str:
        """Text drawing of the default namespace's reachable blocks plus sizes. O(blocks)."""
        return draw_block_tree(
            f"HashV0Cache(block_size={self.block_size}) blocks={self.num_blocks} stranded={self.stranded()} "
            f"spare={self._spare_tokens} total={self.total_size} evictable={self.evictable_size} "
            f"protected={self.protected_size}", self.to_dict())

    def __repr__(self) -> str:
        return f"HashV0Cache(block_size={self.block_size}, blocks={self.num_blocks})"
