"""vLLM-style Automatic Prefix Caching: chained hashes of full KV blocks.

The baseline radixkv compares the radix tree against, following vLLM v1's ``BlockPool``/``KVCacheManager`` design:

* Block i's key is ``H(key of block i-1, tokens of block i)`` (block 0 chains from a seed for the namespace;
  :mod:`radixkv.cache.block_hash`), so a key names a whole prefix and a flat dict ``key -> block`` acts as a
  prefix tree.
* Only full blocks are cached; a partial last block stays with the request.
* Blocks carry lock counts (vLLM's reference counts). A block whose count is 0 stays cached in a free queue,
  from which eviction takes its victims.
* **Children first.** A block is never evicted while a cached block chains from it, so every cached block
  stays reachable. With ``lru`` the free queue's release order guarantees it: chains are queued tail first
  (by ``unlock``, and by an ``insert`` below unlocked cached blocks, which queues those again behind the new
  ones); the other policies' queues pass over a block with cached children until its last child leaves.
* Unlike vLLM, identical blocks computed concurrently are deduplicated at ``insert`` (the second copy's slots
  go back to the caller as duplicates), as the radix tree does, so both caches hold the same memory for the
  same content.
* Events (:mod:`radixkv.cache.events`) name blocks by their keys: an insert's new blocks are one
  ``BlockStored``, each evicted block a ``BlockRemoved`` (its namespace found from its chain's seed). The
  listener hears of a change once the cache's books hold it, so a listener that raises leaves every
  invariant whole.
"""

from __future__ import annotations

from collections.abc import Hashable
from operator import attrgetter
from typing import Any

import numpy as np

from radixkv.cache.base import (
    NO_HINTS,
    CacheHints,
    Evicted,
    LockError,
    MatchResult,
    TokenSeq,
    all_unique,
    as_token_array,
)
from radixkv.cache.block import Block, BlockBooks, BlockChain
from radixkv.cache.block_hash import LE_INT64, BlockHasher, BlockKey
from radixkv.cache.events import AllBlocksCleared, BlockRemoved, BlockStored, CacheListener
from radixkv.cache.eviction import EvictionPolicy, make_policy, policy_clock
from radixkv.cache.free_queue import FreeQueue, PolicyFreeQueue
from radixkv.cache.hash_block_checks import check_children_first, check_lock_counts, check_tree
from radixkv.cache.invariants import requirer
from radixkv.cache.render import block_tree, draw_block_tree
from radixkv.cache.tiers import Untiered

_EMPTY = np.zeros(0, dtype=np.int64)
_LOCK_COUNT = attrgetter("lock_count")


class HashBlockCache(BlockBooks, Untiered):
    """Prefix cache of full KV blocks keyed by chained block hashes (vLLM's APC).

    Args:
        block_size: tokens per hashed block; only full blocks are cached.
        hash_algo: ``sha256`` (default), ``xxhash`` or ``builtin`` (see :mod:`radixkv.cache.block_hash`).
        eviction_policy: ``lru`` (vLLM's free queue: least recently released
            first, O(1) per operation) or any other name of :mod:`radixkv.cache.eviction` (or a fresh
            ``EvictionPolicy``), which ranks blocks by the same statistics the radix tree keeps.
            Under every policy a block leaves only after its cached children.

    Costs (b = full blocks in the query): ``match_prefix`` hashes blocks until
    the first miss, O(b); ``insert`` O(b); both also try the memo of recent
    chains first (O(``MEMO_CHAINS`` x n) memcmp). ``lock``/``unlock`` O(blocks
    in the handle), ``unlock`` O(blocks x log n) under a policy other than
    ``lru`` (a heap push each); ``evict`` O(k) for k blocks with ``lru``,
    O(k log n) otherwise.

    >>> cache = HashBlockCache(block_size=4)
    >>> cache.insert(list(range(10)), list(range(100, 110)))   # 2 full blocks
    0
    >>> m = cache.match_prefix(list(range(8)) + [99] * 6)
    >>> m.length, cache.total_size
    (8, 8)
    """

    MEMO_ENTRIES = 1024  # first blocks whose key chains are remembered (see BlockHasher.recall)
    MEMO_CHAINS = 32  # chains remembered per first block

    caches_during_decode = False  # generated tokens join the cache at finish (see PrefixCache)

    def __init__(self, block_size: int = 16, hash_algo: str = "sha256", eviction_policy: str | EvictionPolicy = "lru"):
        super().__init__(block_size)
        self._keys = BlockHasher(self.block_size, hash_algo, self.MEMO_ENTRIES, self.MEMO_CHAINS)
        self._hash = self._keys.hash  # the chain step, read on the lookup's hot path
        self.policy = make_policy(eviction_policy).bind(self)
        self.hash_algo = hash_algo
        self.eviction_policy = self.policy.name
        self.listener: CacheListener | None = None  # called with every CacheEvent; kept across reset
        self.reset()

    def reset(self) -> None:
        """Drop every block (old handles can no longer be locked); clock and statistics at zero. O(blocks)."""
        for block in getattr(self, "_blocks", {}).values():
            block.cached = False  # old handles can neither lock nor unlock these again
            block.lock_count = block.own_lock_count = 0
        self._blocks: dict[BlockKey, Block] = {}
        self.policy.reset()
        # lru: vLLM's release-order queue; the others rank by the blocks' own statistics, so the queue must pass
        # over a block whose children are cached
        self._queue: FreeQueue | PolicyFreeQueue = FreeQueue() if self.policy.release_order else PolicyFreeQueue(
            self.policy, waits=attrgetter("num_children"))
        self._clock = self._protected_blocks = self._queried_tokens = self._hit_tokens = 0
        self._first_blocks: dict[BlockKey, int] = {}  # seed -> cached blocks chaining from it
        for seed in self._keys.seeds():
            self._keys.release(seed)
        self.root = BlockChain(())
        if self.listener is not None:
            self.listener(AllBlocksCleared())

    # ------------------------------------------------------------- sizes
    clock = policy_clock

    def parent_of(self, block: Block) -> Block | None:
        """The cached block ``block`` chains from; None for a first block. O(1)."""
        return self._blocks.get(block.parent_key)

    def is_last_child(self, block: Block) -> bool:
        """Whether ``block`` is the only cached block chaining from its parent. O(1)."""
        parent = self._blocks.get(block.parent_key)
        return parent is not None and parent.num_children == 1

    def key_of(self, block: Block) -> BlockKey:
        """The block's chained key, which names its whole prefix (for policies' ghost lists). O(1)."""
        return block.key

    @property
    def total_size(self) -> int:
        """Tokens held in cached blocks."""
        return len(self._blocks) * self.block_size

    def block_keys(self, tokens: TokenSeq, namespace: Hashable = None) -> list[BlockKey]:
        """The chained key of every full block of ``tokens`` (memoized as ``match_prefix``'s). O(blocks)."""
        return self._keys.keys(tokens, namespace)

    def held_length(self, tokens: TokenSeq, namespace: Hashable = None) -> int:
        """How many leading tokens of ``tokens`` (whole blocks) the cache holds, touching nothing (no recency,
        hit count or statistic). O(blocks) hashes, fewer when an earlier call hashed the same prefix."""
        n = 0
        for key in self.block_keys(tokens, namespace):
            if key not in self._blocks:
                break
            n += 1
        return n * self.block_size

    # ------------------------------------------------------------- public
    def match_prefix(self, tokens: TokenSeq, namespace: Hashable = None, hints: CacheHints = NO_HINTS) -> MatchResult:
        """Walk the block keys from the start; stop at the first miss. Hit blocks get their recency and hit
        count refreshed; with ``lru``, as in vLLM, a lookup alone leaves the free queue as it is (``lock`` and
        ``unlock`` move blocks), the other policies re-rank the hit blocks. O(hit blocks + 1) hashes, fewer
        when an earlier call hashed the same prefix."""
        hasher = self._keys
        arr, data, nblocks = hasher.full_blocks(tokens)
        self._queried_tokens += len(arr)
        self._clock += 1
        now, step, lookup = self._clock, 8 * self.block_size, self._blocks.get
        keys = hasher.recall(data, namespace)
        hit: list[Block] = []
        # Two loops with the same body (known keys, then keys hashed on demand): this is the
        # hot path, and a shared generator costs about 0.1 us per block.
        for h in keys:
            block = lookup(h)
            if block is None:
                break
            block.last_access = now
            block.hit_count += 1
            hit.append(block)
        else:
            h = keys[-1] if keys else hasher.seed(namespace)
            for i in range(len(keys), nblocks):
                h = self._hash(h, data[i * step : (i + 1) * step])
                keys.append(h)
                block = lookup(h)
                if block is None:
                    break
                block.last_access = now
                block.hit_count += 1
                hit.append(block)
        hasher.remember(data, namespace, keys)
        if not hit:
            return MatchResult(0, _EMPTY.copy(), self.root)
        if self.policy.observes:
            self.policy.touched(hit, hints, True)
        self._queue.refresh(hit)
        length = len(hit) * self.block_size
        self._hit_tokens += length
        return MatchResult(length, np.concatenate([b.slots for b in hit]), BlockChain(tuple(hit)))

    def insert(self, tokens: TokenSeq, indices: TokenSeq, namespace: Hashable = None,
               hints: CacheHints = NO_HINTS) -> int:
        """Cache every full block of ``tokens``; return how many leading tokens were cached already.

        The caller frees ``indices[k:returned]`` (k = what it matched) as duplicates; the cache takes the
        slots of the blocks after that. New blocks enter the free queue tail first, the unlocked cached
        blocks above them again behind them: children leave before their parents. O(blocks)."""
        hasher = self._keys
        arr, data, nblocks = hasher.full_blocks(tokens)
        idx = as_token_array(indices)
        if len(idx) != len(arr):
            raise ValueError(f"tokens and indices differ in length: {len(arr)} != {len(idx)}")
        self._clock += 1
        now = self._clock
        keys = hasher.extend(hasher.recall(data, namespace), data, nblocks, namespace)
        blocks = self._blocks
        leading = nblocks
        for i, h in enumerate(keys):  # the cached leading blocks: refresh them
            block = blocks.get(h)
            if block is None:
                leading = i
                break
            block.last_access = now
        if leading < nblocks:
            self._add_chain(keys, leading, data, idx, namespace, hints)
        elif self._queue.ranks_by_stats:  # their recency changed; lru's release-order queue ignores that
            if self.policy.observes and leading:
                self.policy.touched([blocks[h] for h in keys[:leading]], hints, False)
            self._queue.refresh([blocks[h] for h in keys[:leading]])
        hasher.remember(data, namespace, keys)
        return leading * self.block_size

    def _add_chain(self, keys: list[BlockKey], leading: int, data: bytes, idx: np.ndarray,
                   namespace: Hashable, hints: CacheHints) -> None:
        """Cache the blocks of ``keys[leading:]`` (none is cached: the first missing block ends every cached
        chain) below the cached ``keys[:leading]`` and queue them. O(new + requeued blocks)."""
        blocks, bs, now = self._blocks, self.block_size, self._clock
        step = 8 * bs
        # The unlocked leading blocks, a suffix of them (a locked block's parent is locked too): they
        # go back into the queue behind the new blocks, so that parents stay behind their children.
        requeue, i = [], leading - 1
        while i >= 0 and not blocks[keys[i]].lock_count:
            requeue.append(blocks[keys[i]])
            i -= 1
        requeue.reverse()
        # One copy of the new blocks' slots, a row (a view) each: a copy per block cost 7% of a hash replay.
        rows = idx[leading * bs : len(keys) * bs].astype(np.int64, copy=True).reshape(-1, bs)
        parent_key = keys[leading - 1] if leading else self._keys.hold(namespace)
        if leading:
            blocks[parent_key].num_children += 1
        else:
            self._first_blocks[parent_key] = self._first_blocks.get(parent_key, 0) + 1
        new: list[Block] = []
        for i, h, slots in zip(range(leading, len(keys)), keys[leading:], rows, strict=True):
            block = blocks[h] = Block(h, parent_key, data[i * step : (i + 1) * step], slots, now, i * bs)
            new.append(block)
            parent_key = h
        for block in new[:-1]:
            block.num_children = 1
        if self.policy.observes:
            for block in new:
                self.policy.inserted(block, hints)
            self.policy.touched([blocks[h] for h in keys], hints, False)
        if requeue:
            self._queue.remove_many(requeue)
        self._queue.push_reversed(requeue + new)
        if self.listener is not None:  # the new blocks are one chain below keys[leading - 1]
            tokens = np.frombuffer(data[leading * step : len(keys) * step], dtype=LE_INT64).tolist()
            self.listener(BlockStored(tuple(keys[leading:]), keys[leading - 1] if leading else None,
                                             tuple(tokens), bs, namespace))

    def lock(self, node: BlockChain) -> None:
        """Lock every block of the handle (taking unlocked ones out of the free queue). O(blocks in the handle).

        The handle's last block counts the locks taken through it (``own_lock_count``), so ``unlock`` can
        tell a handle that was locked from a shorter one that only shares its blocks. ``LockError`` for a
        handle of another cache or with an evicted block."""
        blocks = self._own(node, "lock")
        first_locks = [block for block in blocks if not block.lock_count]
        self._queue.remove_many(first_locks)
        self._protected_blocks += len(first_locks)
        for block in blocks:
            block.lock_count += 1
        if blocks:
            blocks[-1].own_lock_count += 1

    def unlock(self, node: BlockChain) -> None:
        """Release one lock of every block; freed blocks join the queue tail, chain tail first.

        Raises ``LockError`` (changing nothing) for a foreign or stale handle, a block whose lock count is
        already 0, or a handle never locked itself (only longer handles sharing its blocks were: per-block
        counts alone would free blocks a longer locked handle still uses). O(blocks), x log n if not ``lru``.
        """
        blocks = self._own(node, "unlock")
        if not all(map(_LOCK_COUNT, blocks)):
            bad = next(b for b in blocks if not b.lock_count)
            raise LockError(f"unlock of {bad!r} whose lock count is already 0 (or no longer cached)")
        if blocks:
            if not blocks[-1].own_lock_count:
                raise LockError(f"unlock of a handle ending at {blocks[-1]!r}, which holds no lock of its own "
                                "(its blocks are locked by longer handles only)")
            blocks[-1].own_lock_count -= 1
        released = []
        for block in blocks:
            block.lock_count -= 1
            if not block.lock_count:
                released.append(block)  # a suffix of the chain: a parent's count is at least its child's
        if released:
            self._protected_blocks -= len(released)
            self._clock += 1
            now = self._clock
            for block in released:
                block.last_access = now
            self._queue.push_reversed(released)

    def demote(self, tokens: TokenSeq, namespace: Hashable = None) -> int:
        """Rank the cached blocks of ``tokens`` as the least recently used of all (``last_access`` below zero):
        a lower tier's copies of what a nearer tier holds, as ``RadixCache.demote``. ``lru``'s queue takes
        the chain's tail to its head, as far up as the blocks chain to nothing else (children still leave
        first); other policies re-rank them. A lock's release restores them (under ``lru`` a lookup alone
        moves no block, as in vLLM). Returns the tokens demoted. O(blocks) (x log n if not ``lru``)."""
        chain, self._clock = [], self._clock + 1
        for key in self.block_keys(tokens, namespace):
            block = self._blocks.get(key)
            if block is None:
                break
            block.last_access = -self._clock
            chain.append(block)
        self._queue.demote(chain)
        return len(chain) * self.block_size

    def evict(self, num_tokens: int, victims: list[Evicted] | None = None, demoted_only: bool = False) -> np.ndarray:
        """Free unlocked blocks in policy order, children first, until ``num_tokens`` are freed or none is left
        (with ``demoted_only``, until the next victim is not demoted: see ``demote``).

        Returns the freed slots (int64); the caller gives them back to its allocator. A parent becomes a
        candidate in the same call once its last cached child is gone. ``victims``, when given, gets an
        ``Evicted`` per block, in order (its whole chain). O(k) for k blocks with lru, O(k log n) otherwise
        (+ O(depth) each with ``victims``, O(1) for a block right after its child).
        """
        freed, count, last = [], 0, None
        blocks, queue = self._blocks, self._queue
        namespaces: dict[BlockKey, Hashable] = {}  # for events: key -> namespace, of this call's walks
        while count < num_tokens:
            block = queue.pop()
            if block is None:
                break
            if demoted_only and block.last_access >= 0:
                queue.put_back(block)  # not this call's to take
                break
            if self.policy.observes:
                self.policy.evicted(block)
            event = None if self.listener is None else BlockRemoved((block.key,), self._namespace_of(block, namespaces))
            if victims is not None:
                victims.append(self._evicted(block, namespaces, last))
                last = block, victims[-1]
            block.cached = False
            del blocks[block.key]
            freed.append(block.slots)
            count += self.block_size
            parent = blocks.get(block.parent_key)
            if parent is not None:
                parent.num_children -= 1
                if not parent.num_children:
                    queue.ready(parent)  # lru: already queued behind its children; others: rank it again
            else:  # a first block: its namespace's seed goes with the last one
                self._release_seed(block.parent_key)
            if event is not None:  # told once the books hold the removal: a listener that raises breaks nothing
                self.listener(event)
        return np.concatenate(freed) if freed else _EMPTY.copy()

    def _namespace_of(self, block: Block, known: dict[BlockKey, Hashable]) -> Hashable:
        """The namespace of a cached block (for events), from its chain's seed. O(depth), O(1) once ``known``
        holds its parent: evict walks a chain once, children first, recording every key it passes."""
        path, key = [], block.parent_key
        while key not in known and key in self._blocks:
            path.append(key)
            key = self._blocks[key].parent_key
        namespace = known[key] if key in known else self._keys.owner(key)
        known.update(dict.fromkeys(path, namespace))
        return namespace

    def _evicted(self, block: Block, known: dict[BlockKey, Hashable], after: tuple | None = None) -> Evicted:
        """Block's whole chain (still cached) as an ``Evicted``. O(depth); O(1) when ``after`` is its child
        and that child's record (the child's chain less one block)."""
        if after is not None and after[0].parent_key == block.key:
            bs, prev = self.block_size, after[1]
            return prev._replace(tokens=prev.tokens[:-bs], slots=prev.slots[:-bs])
        chain = [block]
        while chain[-1].parent_key in self._blocks:
            chain.append(self._blocks[chain[-1].parent_key])
        chain.reverse()
        tokens = np.frombuffer(b"".join(b.tokens for b in chain), dtype=LE_INT64).astype(np.int64)
        return Evicted(self._namespace_of(block, known), tokens, np.concatenate([b.slots for b in chain]))

    def _own(self, node: object, verb: str) -> tuple[Block, ...]:
        """The handle's blocks, or ``LockError`` for a handle of another cache or with an evicted block."""
        blocks = node.blocks if isinstance(node, BlockChain) else None
        if blocks is None or any(self._blocks.get(b.key) is not b for b in blocks):
            raise LockError(f"cannot {verb} {node!r}: not a handle of this cache's cached blocks (another "
                            "cache's, or one of its blocks was evicted or dropped by reset)")
        return blocks

    def _release_seed(self, seed: BlockKey) -> None:
        self._first_blocks[seed] -= 1
        if not self._first_blocks[seed]:
            del self._first_blocks[seed]
            self._keys.release(seed)

    def held_slots(self) -> np.ndarray:
        """Every slot index of the cached blocks (locked or not), int64. O(blocks)."""
        return np.concatenate([block.slots for block in self._blocks.values()] + [_EMPTY])

    def unlock_all(self) -> None:
        """Drop every lock (a caller's books lost after a failed step); blocks stay, joining the queue
        deepest first (children before parents: a cached block's whole chain is cached). O(b log b)."""
        self._queue.push_reversed(sorted(self._drop_locks(), key=attrgetter("depth")))

    # ------------------------------------------------------------- inspection
    def check_invariants(self) -> None:
        """Verify every invariant (keys, reachability, lock counts, the free queue's order, sizes and slots);
        raise ``AssertionError`` naming the broken one. O(blocks + locked x depth)."""
        require = requirer("HashBlockCache")
        locked = 0
        children: dict[BlockKey, list[Block]] = {}
        for key, block in self._blocks.items():
            require(block.key == key and block.cached, "map keys match their blocks", block)
            require(len(block.slots) == self.block_size == len(block.tokens) // 8 and block.slots.dtype == np.int64,
                    "blocks are full, their indices int64", block)
            require(block.lock_count >= 0, "lock counts >= 0", block)
            require(self._hash(block.parent_key, block.tokens) == key, "key = H(parent key, tokens)", block)
            require((block in self._queue) == (block.lock_count == 0), "free queue holds exactly the unlocked blocks",
                    block)
            locked += block.lock_count > 0
            children.setdefault(block.parent_key, []).append(block)
        check_tree(self._blocks, self._keys.seeds(), children, require)
        check_lock_counts(self._blocks, require)
        check_children_first(self._blocks, self._queue, require)
        require(len(self._queue) == len(self._blocks) - locked, "free queue size")
        require(locked == self._protected_blocks, "sizes: protected",
                f"counted {locked} blocks, recorded {self._protected_blocks}")
        require(self.total_size == self.evictable_size + self.protected_size, "sizes: total = evictable + protected")
        require(all_unique(self.held_slots()), "slot indices unique across the cache")
        self.policy.check_invariants(list(self._blocks.values()), require)

    def to_dict(self, namespace: Hashable = None) -> dict[str, Any]:
        """The cached blocks of one namespace as a tree of nested dicts (one node per block). O(blocks)."""
        return block_tree(self._blocks.values(), self._keys.seed(namespace),
                          lambda block: np.frombuffer(block.tokens, dtype=LE_INT64).tolist())

    def pretty_print(self) -> str:
        """Text drawing of the default namespace's block tree plus queue statistics. O(blocks)."""
        return draw_block_tree(
            f"HashBlockCache(block_size={self.block_size}, hash={self.hash_algo}, policy={self.eviction_policy}) "
            f"blocks={self.num_blocks} free_queue={len(self._queue)} total={self.total_size} "
            f"evictable={self.evictable_size} protected={self.protected_size}", self.to_dict())

    def __repr__(self) -> str:
        return (f"HashBlockCache(block_size={self.block_size}, hash_algo={self.hash_algo!r}, "
                f"eviction_policy={self.eviction_policy!r}, blocks={self.num_blocks})")
