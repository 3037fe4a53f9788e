"""Chained block keys for ``HashBlockCache``: the hash functions and a memo of recent key chains.

Block i's key is ``H(key of block i-1, tokens of block i)``; block 0 chains
from a seed that encodes the namespace (adapter id, cache salt) by its
``repr``, so a key names a whole prefix and two namespaces with different
reprs never share a block.

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
from typing import Any

import numpy as np

from radixkv.cache.base import TokenSeq, as_token_array

LE_INT64 = np.dtype("<i8")

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
        raise ValueError("hash_algo='xxhash' needs the xxhash package: pip install xxhash "
                         "(or use 'sha256' or 'builtin')") from None
    digest = xxhash.xxh3_128_digest
    return lambda parent, data: digest(parent + data)


HASH_ALGOS = ("sha256", "xxhash", "builtin")


class BlockHasher:
    """The chained keys of a token sequence's full blocks, remembering recent chains.

    Args:
        block_size: tokens per hashed block.
        hash_algo: ``sha256``, ``xxhash`` or ``builtin`` (see the module docs).
        memo_entries: first blocks whose key chains are remembered.
        memo_chains: chains remembered per first block.
        memo_bytes: the most the remembered chains may hold (their tokens' bytes and their keys'); the least
            recently used first blocks' chains go first beyond it. Agent sessions' 100k-900k-token prompts
            made a count bound alone hold gigabytes.

    ``hash(parent_key, block_bytes)`` is the chain step; ``seed(namespace)``
    block 0's parent. Seeds are cached per instance by dict equality and
    never dropped, so the keys of a namespace stay the same for the
    hasher's lifetime.
    """

    def __init__(self, block_size: int, hash_algo: str, memo_entries: int, memo_chains: int,
                 memo_bytes: int = 256 << 20):
        if hash_algo not in HASH_ALGOS:
            raise ValueError(f"unknown hash_algo {hash_algo!r}; choose one of {list(HASH_ALGOS)}")
        self.block_size, self.hash_algo = block_size, hash_algo
        self.hash: ChainHash = {"sha256": _sha256, "builtin": _builtin}.get(hash_algo) or _xxhash()
        self.memo_entries, self.memo_chains, self.memo_bytes = memo_entries, memo_chains, memo_bytes
        self.memo_size = 0  # bytes the remembered chains hold, as _chain_bytes counts them
        self._seeds: dict[Hashable, BlockKey] = {}  # the held seeds (see hold) and their owners
        self._owners: dict[BlockKey, Hashable] = {}
        # (seed, first block bytes) -> recent (token bytes, their chained keys, last block); see recall.
        self._memo: OrderedDict[tuple, deque[tuple[bytes, list[BlockKey], bytes]]] = OrderedDict()

    def seed(self, namespace: Hashable) -> BlockKey:
        """Block 0's parent key for ``namespace``. Namespaces are told apart by equality: one whose encoding
        collides with another's held seed gets a different one. O(1) for a held namespace."""
        seed = self._seeds.get(namespace)
        if seed is None:
            # The namespace is the first block's extra key: repr is a deterministic encoding
            # for the ids used in practice (None, str, int, tuples of them).
            text, n = repr(namespace).encode(), 0
            while seed is None or seed in self._owners:  # another (unequal) namespace with this repr holds it
                digest = hashlib.sha256(b"radixkv-block-seed:" + text + b"#" * n).digest()
                seed = int.from_bytes(digest[:8], "little") if self.hash_algo == "builtin" else digest
                n += 1
        return seed

    def hold(self, namespace: Hashable) -> BlockKey:
        """``seed(namespace)``, kept until ``release``: a cache holds it while blocks chain from it. O(1)."""
        seed = self.seed(namespace)
        self._seeds[namespace], self._owners[seed] = seed, namespace
        return seed

    def release(self, seed: BlockKey) -> None:
        """Forget a seed no block chains from any more, and the namespace's remembered chains. O(memo)."""
        del self._seeds[self._owners.pop(seed)]
        for slot in [slot for slot in self._memo if slot[0] == seed]:
            self._forget(slot)

    def owner(self, seed: BlockKey) -> Hashable:
        """The namespace a held seed belongs to. O(1)."""
        return self._owners[seed]

    def seeds(self) -> list[BlockKey]:
        """The held seeds: the roots the cached chains hang from. O(namespaces)."""
        return list(self._seeds.values())

    def full_blocks(self, tokens: TokenSeq) -> tuple[np.ndarray, bytes, int]:
        """``(tokens as int64, the bytes of their full blocks, the number of full blocks)``. O(n)."""
        arr = as_token_array(tokens)
        nblocks = len(arr) // self.block_size
        data = arr[: nblocks * self.block_size].astype(LE_INT64, copy=False).tobytes()
        return arr, data, nblocks

    def extend(self, keys: list[BlockKey], data: bytes, nblocks: int, namespace: Hashable) -> list[BlockKey]:
        """``keys`` (the leading blocks' of ``data``, as ``recall`` gives them) completed to all ``nblocks``
        full blocks, in place. O(new blocks) hashes."""
        step = 8 * self.block_size
        h = keys[-1] if keys else self.seed(namespace)
        for i in range(len(keys), nblocks):
            h = self.hash(h, data[i * step : (i + 1) * step])
            keys.append(h)
        return keys

    def keys(self, tokens: TokenSeq, namespace: Hashable = None) -> list[BlockKey]:
        """The chained key of every full block of ``tokens``, hashing only the blocks the memo lacks (and
        remembering them). O(blocks) memcmp + the new blocks' hashes."""
        _, data, nblocks = self.full_blocks(tokens)
        keys = self.extend(self.recall(data, namespace), data, nblocks, namespace)
        self.remember(data, namespace, keys)
        return keys

    def recall(self, data: bytes, namespace: Hashable) -> list[BlockKey]:
        """Keys of the leading blocks of ``data`` that an earlier call already hashed.

        vLLM hashes a request's blocks once and keeps them on the request; the
        cache has no request object, so it remembers the key chains of the
        latest sequences starting with the same first block, and reuses the
        one sharing the longest prefix with ``data`` (a later turn of a chat
        extends an earlier turn's whole sequence). O(memo_chains * len(data)) memcmp.
        """
        step = 8 * self.block_size
        chains = self._memo.get((self.seed(namespace), data[:step]))  # by seed: equal namespaces alike
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

    def remember(self, data: bytes, namespace: Hashable, keys: list[BlockKey]) -> None:
        """Record the keys of ``data``'s leading blocks for later ``recall``. O(1) amortized plus one memcmp."""
        if not keys:
            return
        step = 8 * self.block_size
        slot = (self.seed(namespace), data[:step])
        chains = self._memo.setdefault(slot, deque())
        self._memo.move_to_end(slot)  # the most recently used first block
        covered = data if len(keys) * step == len(data) else data[: len(keys) * step]
        if chains and covered.startswith(chains[-1][0]):
            self.memo_size -= _chain_bytes(chains.pop())  # the newest chain extends the previous one: keep the longer
        if len(chains) == self.memo_chains:
            self.memo_size -= _chain_bytes(chains.popleft())
        chains.append((covered, keys, covered[-step:]))
        self.memo_size += _chain_bytes(chains[-1])
        while len(self._memo) > 1 and (len(self._memo) > self.memo_entries or self.memo_size > self.memo_bytes):
            self._forget(next(iter(self._memo)))  # the least recently used first block

    def _forget(self, slot: tuple) -> None:
        self.memo_size -= sum(map(_chain_bytes, self._memo.pop(slot)))


def _chain_bytes(chain: tuple[bytes, list[BlockKey], bytes]) -> int:
    """What one remembered chain holds: its tokens' bytes and about 80 bytes a key (the object and its slot)."""
    return len(chain[0]) + 80 * len(chain[1])
