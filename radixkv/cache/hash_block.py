"""vLLM-style Automatic Prefix Caching: chained hashes of full KV blocks.

The baseline radixkv compares the radix tree against, following vLLM v1's
``BlockPool``/``KVCacheManager`` design:

* Block i's key is ``H(key of block i-1, tokens of block i)``; block 0 chains
  from a seed that encodes the namespace (adapter id, cache salt) by its
  ``repr``, so two namespaces with different reprs never share a block. A key therefore names a whole prefix, and a
  flat dict ``key -> block`` acts as a prefix tree without an explicit tree.
* Only full blocks are cached; a partial last block stays with the request.
* Blocks carry reference counts. A block whose count is 0 stays cached in a
  free queue and is evicted from the queue's head; a request's blocks are
  released to the tail in reverse order, so a chain's tail leaves before its
  head. A hit takes a block out of the queue (``lock``).
* Unlike vLLM, identical blocks computed concurrently are deduplicated at
  ``insert`` (the second copy's slots go back to the caller as duplicates),
  exactly as the radix tree does, so both caches hold the same memory for the
  same content.

Hash functions (``hash_algo``):

* ``sha256`` (default): a deterministic byte encoding (parent digest, the
  block's int64 little-endian tokens, the namespace's repr for block 0), no
  pickle; stable across processes; collisions are cryptographically unlikely.
* ``xxhash``: xxh3-128 over the same bytes; several times cheaper per block and
  stable across processes, but not collision-resistant against an adversary
  who can choose prompts (a crafted collision would serve another prefix's KV).
* ``builtin``: Python's ``hash`` of (parent, block bytes); cheapest, but
  64-bit, salted per process (keys are not comparable across processes), and
  its collisions are easy to construct: for experiments only.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable
from operator import attrgetter
from typing import Any, NamedTuple

import numpy as np

from radixkv.cache.base import LockError, MatchResult, TokenSeq, all_unique, as_token_array
from radixkv.cache.eviction import get_policy
from radixkv.cache.free_queue import FreeQueue, PriorityFreeQueue

_EMPTY = np.zeros(0, dtype=np.int64)
_CACHED = attrgetter("cached")
_REF_CNT = attrgetter("ref_cnt")
_LE_INT64 = np.dtype("<i8")

BlockKey = Hashable
ChainHash = Callable[[Any, bytes], Any]


def _sha256(parent: bytes, data: bytes) -> bytes:
    return hashlib.sha256(parent + data).digest()


def _builtin(parent: int, data: bytes) -> int:
    return hash((parent, data))


def _xxhash() -> ChainHash:
    try:
        import xxhash
    except ImportError:
        raise ValueError(
            "hash_algo='xxhash' needs the xxhash package: pip install xxhash (or use 'sha256' or 'builtin')"
        ) from None
    digest = xxhash.xxh3_128_digest
    return lambda parent, data: digest(parent + data)


HASH_ALGOS = ("sha256", "xxhash", "builtin")


class Block:
    """One cached KV block: ``block_size`` tokens and their slot indices."""

    __slots__ = (
        "key", "parent_key", "tokens", "slots", "ref_cnt", "tail_locks",
        "last_access", "hit_count", "created", "stamp", "cached",
    )

    def __init__(self, key: BlockKey, parent_key: BlockKey, tokens: bytes, slots: np.ndarray, now: int):
        self.key = key
        self.parent_key = parent_key
        self.tokens = tokens  # int64 little-endian bytes
        self.slots = slots
        self.ref_cnt = 0
        self.tail_locks = 0  # locks of handles that end at this block (the radix tree's direct_locks)
        self.last_access = now
        self.hit_count = 0
        self.created = now
        self.stamp = -1
        self.cached = True

    def __repr__(self) -> str:
        toks = np.frombuffer(self.tokens, dtype=_LE_INT64)[:8].tolist()
        return f"Block(tokens={toks}, ref={self.ref_cnt})"


class BlockChain(NamedTuple):
    """Handle returned by ``match_prefix``: the matched blocks, first to last."""

    blocks: tuple

    @property
    def length_blocks(self) -> int:
        return len(self.blocks)


class HashBlockCache:
    """Prefix cache of full KV blocks keyed by chained block hashes (vLLM's APC).

    Args:
        block_size: tokens per block; only full blocks are cached.
        hash_algo: ``sha256`` (default), ``xxhash`` or ``builtin`` (see module docs).
        eviction_policy: ``lru`` (vLLM's free queue: least recently released
            first, O(1) per operation) or ``lfu``, ``fifo``, ``mru``, ``filo``
            (a priority queue over the same statistics the radix tree keeps).

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

    MEMO_ENTRIES = 1024  # first blocks whose key chains are remembered (see _recall)
    MEMO_CHAINS = 32  # chains remembered per first block

    def __init__(self, block_size: int = 16, hash_algo: str = "sha256", eviction_policy: str = "lru"):
        if not isinstance(block_size, (int, np.integer)) or isinstance(block_size, bool) or block_size < 1:
            raise ValueError(f"block_size must be an integer >= 1, got {block_size!r}")
        if hash_algo not in HASH_ALGOS:
            raise ValueError(f"unknown hash_algo {hash_algo!r}; choose one of {list(HASH_ALGOS)}")
        self._priority = get_policy(eviction_policy)
        self.block_size = int(block_size)
        self.page_size = self.block_size  # the granularity every cache exposes
        self.hash_algo = hash_algo
        self.eviction_policy = eviction_policy
        self._hash: ChainHash = {"sha256": _sha256, "builtin": _builtin}.get(hash_algo) or _xxhash()
        self._seeds: dict[Hashable, BlockKey] = {}
        # (namespace, first block bytes) -> recent (token bytes, their chained keys, last block); see _recall.
        self._memo: OrderedDict[tuple, deque[tuple[bytes, list[BlockKey], bytes]]] = OrderedDict()
        self.reset()

    def reset(self) -> None:
        """Drop every block (old handles can no longer be locked); clock and statistics at zero. O(blocks)."""
        for block in getattr(self, "_blocks", {}).values():
            block.cached = False  # old handles can neither lock nor unlock these again
            block.ref_cnt = block.tail_locks = 0
        self._clock = 0
        self._blocks: dict[BlockKey, Block] = {}
        if self.eviction_policy == "lru":
            self._queue = FreeQueue()
        else:
            self._queue = PriorityFreeQueue(self._priority)
        self._protected_blocks = 0
        self._displaced: list[np.ndarray] = []  # slots of replaced stranded blocks, returned by evict
        self._displaced_tokens = 0
        self._queried_tokens = 0
        self._hit_tokens = 0
        self.root = BlockChain(())

    # ------------------------------------------------------------- sizes
    @property
    def total_size(self) -> int:
        """Tokens held: cached blocks plus displaced slots awaiting ``evict``."""
        return len(self._blocks) * self.block_size + self._displaced_tokens

    @property
    def protected_size(self) -> int:
        """Tokens in blocks with a positive reference count."""
        return self._protected_blocks * self.block_size

    @property
    def evictable_size(self) -> int:
        """Tokens ``evict`` could free now."""
        return self.total_size - self.protected_size

    @property
    def num_blocks(self) -> int:
        return len(self._blocks)

    def stats(self) -> dict[str, float]:
        """Token-weighted lookup statistics since construction or ``reset`` (as vLLM reports them)."""
        q, h = self._queried_tokens, self._hit_tokens
        return {"queried_tokens": q, "hit_tokens": h, "hit_rate": h / q if q else 0.0}

    # ------------------------------------------------------------- hashing
    def _seed(self, namespace: Hashable) -> BlockKey:
        seed = self._seeds.get(namespace)
        if seed is None:
            # The namespace is the first block's extra key: repr is a deterministic encoding
            # for the ids used in practice (None, str, int, tuples of them).
            digest = hashlib.sha256(b"radixkv-block-seed:" + repr(namespace).encode()).digest()
            seed = int.from_bytes(digest[:8], "little") if self.hash_algo == "builtin" else digest
            self._seeds[namespace] = seed
        return seed

    def _full_blocks(self, tokens: TokenSeq) -> tuple[np.ndarray, bytes, int]:
        arr = as_token_array(tokens)
        nblocks = len(arr) // self.block_size
        data = arr[: nblocks * self.block_size].astype(_LE_INT64, copy=False).tobytes()
        return arr, data, nblocks

    def block_keys(self, tokens: TokenSeq, namespace: Hashable = None) -> list[BlockKey]:
        """The chained key of every full block of ``tokens``. O(blocks)."""
        _, data, nblocks = self._full_blocks(tokens)
        step, h, keys = 8 * self.block_size, self._seed(namespace), []
        for i in range(nblocks):
            h = self._hash(h, data[i * step : (i + 1) * step])
            keys.append(h)
        return keys

    def _recall(self, data: bytes, namespace: Hashable) -> list[BlockKey]:
        """Keys of the leading blocks of ``data`` that an earlier call already hashed.

        vLLM hashes a request's blocks once and keeps them on the request; the
        cache has no request object, so it remembers the key chains of the
        latest sequences starting with the same first block, and reuses the
        one sharing the longest prefix with ``data`` (a later turn of a chat
        extends an earlier turn's whole sequence). O(MEMO_CHAINS * len(data)) memcmp.
        """
        step = 8 * self.block_size
        chains = self._memo.get((namespace, data[:step]))
        if not chains:
            return []
        size, best_n, best = len(data), 0, None
        for old, keys, tail in reversed(chains):
            n = len(old)
            if n <= size:
                # A prefix of data? Its last block first: chains of other conversations differ
                # there, so most are rejected by a short compare before the long memcmp.
                if n > best_n and data[n - step : n] == tail and data.startswith(old):
                    best_n, best = n, keys
                    if n == size:
                        break
            elif size > best_n and old.startswith(data):
                best_n, best = size, keys
                break
        if best is not None:
            return best[: best_n // step]
        old, keys, _ = chains[-1]  # no chain is a prefix: reuse what the most recent one shares
        n = min(len(old), len(data))
        a = np.frombuffer(old, dtype=np.int64, count=n // 8)
        b = np.frombuffer(data, dtype=np.int64, count=n // 8)
        differ = np.flatnonzero(a != b)
        shared = int(differ[0]) * 8 if len(differ) else n
        return keys[: shared // step]

    def _remember(self, data: bytes, namespace: Hashable, keys: list[BlockKey]) -> None:
        if not keys:
            return
        step = 8 * self.block_size
        slot = (namespace, data[:step])
        chains = self._memo.get(slot)
        if chains is None:
            chains = self._memo[slot] = deque(maxlen=self.MEMO_CHAINS)
            if len(self._memo) > self.MEMO_ENTRIES:
                self._memo.popitem(last=False)
        else:
            self._memo.move_to_end(slot)
        covered = data if len(keys) * step == len(data) else data[: len(keys) * step]
        if chains and covered.startswith(chains[-1][0]):
            chains.pop()  # the newest chain extends the previous one: keep only the longer
        chains.append((covered, keys, covered[-step:]))

    # ------------------------------------------------------------- public
    def match_prefix(self, tokens: TokenSeq, namespace: Hashable = None) -> MatchResult:
        """Walk the block keys from the start; stop at the first miss.

        Hit blocks get their recency and hit count refreshed. With ``lru``, as
        in vLLM, a lookup alone leaves the free queue as it is (``lock`` takes
        the blocks out of it and ``unlock`` puts them back at the tail); the
        other policies re-rank the hit blocks by their new statistics.
        O(hit blocks + 1) hashes, fewer when an earlier call hashed the same prefix.
        """
        arr, data, nblocks = self._full_blocks(tokens)
        self._queried_tokens += len(arr)
        self._clock += 1
        now, step, lookup = self._clock, 8 * self.block_size, self._blocks.get
        keys = self._recall(data, namespace)
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
            h = keys[-1] if keys else self._seed(namespace)
            for i in range(len(keys), nblocks):
                h = self._hash(h, data[i * step : (i + 1) * step])
                keys.append(h)
                block = lookup(h)
                if block is None:
                    break
                block.last_access = now
                block.hit_count += 1
                hit.append(block)
        self._remember(data, namespace, keys)
        if not hit:
            return MatchResult(0, _EMPTY.copy(), self.root)
        self._queue.refresh(hit)
        length = len(hit) * self.block_size
        self._hit_tokens += length
        return MatchResult(length, np.concatenate([b.slots for b in hit]), BlockChain(tuple(hit)))

    def insert(self, tokens: TokenSeq, indices: TokenSeq, namespace: Hashable = None) -> int:
        """Cache every full block of ``tokens``; return how many leading tokens were cached already.

        The caller frees ``indices[k:returned]`` (k = what it matched) as
        duplicates; the cache takes the slots of the blocks after that. A
        cached block found after a missing one (a stranded suffix) is replaced
        by the caller's copy and its old slots come back from the next
        ``evict``. New blocks enter the free queue tail-first. O(blocks).
        """
        arr, data, nblocks = self._full_blocks(tokens)
        idx = as_token_array(indices)
        if len(idx) != len(arr):
            raise ValueError(f"tokens and indices differ in length: {len(arr)} != {len(idx)}")
        self._clock += 1
        now, bs, step = self._clock, self.block_size, 8 * self.block_size
        keys = self._recall(data, namespace)
        h = keys[-1] if keys else self._seed(namespace)
        for i in range(len(keys), nblocks):
            h = self._hash(h, data[i * step : (i + 1) * step])
            keys.append(h)
        blocks = self._blocks
        leading = nblocks
        for i, h in enumerate(keys):  # the cached leading blocks: refresh them
            block = blocks.get(h)
            if block is None:
                leading = i
                break
            block.last_access = now
        if self._queue.ranks_by_stats:  # their recency changed; lru's release-order queue ignores that
            self._queue.refresh([blocks[h] for h in keys[:leading]])
        new: list[Block] = []
        # One copy of the new blocks' slots, a row (a view) each: a copy per block cost 7% of a hash replay.
        rows = idx[leading * bs : nblocks * bs].astype(np.int64, copy=True).reshape(-1, bs)
        parent = keys[leading - 1] if leading else self._seed(namespace)
        for i, h, slots in zip(range(leading, nblocks), keys[leading:nblocks], rows, strict=True):
            stranded = blocks.get(h)
            if stranded is not None:
                self._displace(stranded)
            block = Block(h, parent, data[i * step : (i + 1) * step], slots, now)
            blocks[h] = block
            new.append(block)
            parent = h
        self._queue.push_reversed(new)
        self._remember(data, namespace, keys)
        return leading * bs

    def _displace(self, block: Block) -> None:
        # A stranded block has ref_cnt 0: a referenced chain always holds its whole prefix.
        self._queue.remove(block)
        block.cached = False
        del self._blocks[block.key]
        self._displaced.append(block.slots)
        self._displaced_tokens += len(block.slots)

    def lock(self, node: BlockChain) -> None:
        """Reference every block of the handle (taking unreferenced ones out of the free queue).

        A handle is named by its last block (its key chains the whole prefix),
        which counts the locks taken through it, so ``unlock`` can tell a
        handle that was locked from a shorter one that only shares its blocks.
        """
        blocks = node.blocks
        first_refs = [block for block in blocks if not block.ref_cnt]
        # A referenced block is never evicted (and reset() zeroes the counts of what it drops),
        # so only unreferenced blocks can be stale.
        if not all(map(_CACHED, first_refs)):
            raise LockError("cannot lock a handle one of whose blocks was evicted")
        if first_refs:
            self._queue.remove_many(first_refs)
            self._protected_blocks += len(first_refs)
        for block in blocks:
            block.ref_cnt += 1
        if blocks:
            blocks[-1].tail_locks += 1

    def unlock(self, node: BlockChain) -> None:
        """Release one reference of every block; freed blocks join the queue tail, chain tail first.

        Raises ``LockError`` (changing nothing) when a block's count is already
        0 (which includes every block of a handle from before ``reset``), or
        when the handle was never locked itself: only longer handles sharing
        its blocks were. Per-block counts alone would let that unlock through
        and free blocks a longer locked handle still uses.
        """
        blocks = node.blocks
        if not all(map(_REF_CNT, blocks)):
            bad = next(b for b in blocks if not b.ref_cnt)
            raise LockError(f"unlock of {bad!r} whose reference count is already 0 (or no longer cached)")
        if blocks:
            if not blocks[-1].tail_locks:
                raise LockError(f"unlock of a handle ending at {blocks[-1]!r}, which holds no lock of its own "
                                "(its blocks are referenced by longer handles only)")
            blocks[-1].tail_locks -= 1
        released = []
        for block in blocks:
            block.ref_cnt -= 1
            if not block.ref_cnt:
                released.append(block)
        if released:
            self._protected_blocks -= len(released)
            self._clock += 1
            now = self._clock
            for block in released:
                block.last_access = now
            self._queue.push_reversed(released)

    def evict(self, num_tokens: int) -> np.ndarray:
        """Free blocks from the free queue's head until ``num_tokens`` are freed or none is left.

        Returns the freed slots (int64); the caller gives them back to its
        allocator. O(k) for k blocks with lru, O(k log n) otherwise.
        """
        freed, count = [], 0
        if self._displaced and num_tokens > 0:
            freed, count = self._displaced, self._displaced_tokens
            self._displaced, self._displaced_tokens = [], 0
        if count < num_tokens:
            victims = self._queue.pop_many(-(-(num_tokens - count) // self.block_size))
            blocks = self._blocks
            for block in victims:
                block.cached = False
                del blocks[block.key]
                freed.append(block.slots)
        return np.concatenate(freed) if freed else _EMPTY.copy()

    def cacheable_length(self, num_tokens: int) -> int:
        """How many leading tokens of a ``num_tokens`` sequence ``insert`` keeps (full blocks)."""
        return num_tokens - num_tokens % self.block_size

    # ------------------------------------------------------------- inspection
    def check_invariants(self) -> None:
        """Verify every invariant; raise ``AssertionError`` naming the broken one.

        O(blocks * block_size + locked handles * their depth).
        """

        def require(ok: bool, name: str, detail: object = "") -> None:
            if not ok:  # the detail (often a block) is formatted only on failure: this runs per block
                raise AssertionError(f"HashBlockCache invariant '{name}' broken: {detail!r}")

        protected = 0
        for key, block in self._blocks.items():
            require(block.key == key and block.cached, "map keys match their blocks", block)
            require(len(block.slots) == self.block_size, "blocks are full", block)
            require(len(block.tokens) == 8 * self.block_size, "block tokens are full", block)
            require(block.slots.dtype == np.int64, "indices are int64", block)
            require(block.ref_cnt >= 0, "reference counts >= 0", block)
            require(self._hash(block.parent_key, block.tokens) == key, "key = H(parent key, tokens)", block)
            require((block in self._queue) == (block.ref_cnt == 0), "free queue holds exactly the unreferenced blocks",
                    block)
            protected += block.ref_cnt > 0
        self._check_lock_counts(require)
        require(len(self._queue) == len(self._blocks) - protected, "free queue size")
        require(protected == self._protected_blocks, "sizes: protected",
                f"counted {protected} blocks, recorded {self._protected_blocks}")
        require(self._displaced_tokens == sum(len(s) for s in self._displaced), "sizes: displaced")
        require(self.total_size == self.evictable_size + self.protected_size, "sizes: total = evictable + protected")
        slots = [b.slots for b in self._blocks.values()] + self._displaced
        if slots:
            flat = np.concatenate(slots)
            require(all_unique(flat), "slot indices unique across the cache")

    def _check_lock_counts(self, require) -> None:
        """Each block's ref_cnt is the sum of the tail locks of the chains through it. O(locked handles * depth)."""
        through: dict[BlockKey, int] = {}
        for block in self._blocks.values():
            require(block.tail_locks >= 0, "tail lock counts >= 0", block)
            key, locks = block.key, block.tail_locks
            while locks and key in self._blocks:
                through[key] = through.get(key, 0) + locks
                key = self._blocks[key].parent_key
        for key, block in self._blocks.items():
            require(block.ref_cnt == through.get(key, 0), "ref_cnt = locks of the handles through the block", block)

    def to_dict(self, namespace: Hashable = None) -> dict[str, Any]:
        """The cached blocks of one namespace as a tree of nested dicts (one node per block).

        Blocks whose parent block was evicted (unreachable by ``match_prefix``
        until they are evicted too) are not shown. O(blocks).
        """
        children: dict[BlockKey, list[Block]] = {}
        for block in self._blocks.values():
            children.setdefault(block.parent_key, []).append(block)

        def walk(block: Block) -> dict[str, Any]:
            return {
                "tokens": np.frombuffer(block.tokens, dtype=_LE_INT64).tolist(),
                "indices": block.slots.tolist(),
                "lock_count": block.ref_cnt,
                "last_access": block.last_access,
                "hit_count": block.hit_count,
                "children": [walk(c) for c in children.get(block.key, [])],
            }

        return {
            "tokens": [], "indices": [], "lock_count": 0, "last_access": 0, "hit_count": 0,
            "children": [walk(b) for b in children.get(self._seed(namespace), [])],
        }

    def pretty_print(self) -> str:
        """Text drawing of the default namespace's block tree plus queue statistics. O(blocks)."""
        lines = [
            f"HashBlockCache(block_size={self.block_size}, hash={self.hash_algo}, policy={self.eviction_policy}) "
            f"blocks={self.num_blocks} free_queue={len(self._queue)} total={self.total_size} "
            f"evictable={self.evictable_size} protected={self.protected_size}"
        ]

        def walk(node: dict[str, Any], depth: int) -> None:
            for child in node["children"]:
                toks = " ".join(map(str, child["tokens"][:12])) + (" ..." if len(child["tokens"]) > 12 else "")
                lines.append(f"{'  ' * depth}[{toks}] ref={child['lock_count']} hits={child['hit_count']}")
                walk(child, depth + 1)

        walk(self.to_dict(), 1)
        return "\n".join(lines)

    def __repr__(self) -> str:
        return (
            f"HashBlockCache(block_size={self.block_size}, hash_algo={self.hash_algo!r}, "
            f"eviction_policy={self.eviction_policy!r}, blocks={self.num_blocks})"
        )
