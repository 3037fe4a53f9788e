"""What a prefix cache tells a listener when its set of cached blocks changes (vLLM's KV events).

Modelled on vLLM's ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared``, the stream Dynamo's KV router
builds its index from (:class:`~radixkv.routing.kv_index.KVEventIndex`). Every cache has a ``listener``
attribute (None by default: then no event is built and nothing is hashed); set it to a callable and the
cache calls it with one event each time pages or blocks join the cache, leave it, or all go at once. It is
called once the cache's own books hold the change, so a listener that raises leaves the cache whole (an
``evict`` it interrupts has removed its victims so far: the caller's recovery takes their slots back).

A block hash names the whole prefix through its block, but only within one cache object: the hash a
removal names is the one its store named, and a store's parent is a block the same cache stored and has
not removed. The hash caches use their own block keys; the radix tree, which keys nothing by hash,
derives one per page with :func:`page_states` and :func:`block_hashes`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Hashable
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class BlockStored:
    """Blocks that joined a cache, a chain in prefix order (one event per contiguous new run).

    Attributes:
        block_hashes: one per page/block, prefix order; each names the whole prefix through that block.
        parent_block_hash: the block just before the first one; None at the start of a namespace.
        token_ids: the blocks' tokens as plain ints, ``len == len(block_hashes) * block_size``.
        block_size: tokens per block (the radix tree's page size).
        namespace: the namespace (adapter, cache salt) the chain lives in.
        medium: the tier that holds them (vLLM's names: ``GPU`` the device, ``CPU`` host memory, ``STORAGE``).
    """

    block_hashes: tuple[Hashable, ...]
    parent_block_hash: Hashable | None
    token_ids: tuple[int, ...]
    block_size: int
    namespace: Hashable = None
    medium: str = "GPU"


@dataclass(frozen=True)
class BlockRemoved:
    """Blocks that left a cache (evicted, or dropped for another copy). The hashes alone name them within
    their cache; ``namespace`` is the one they were stored under, ``medium`` the tier they left."""

    block_hashes: tuple[Hashable, ...]
    namespace: Hashable = None
    medium: str = "GPU"


@dataclass(frozen=True)
class AllBlocksCleared:
    """Every block of the cache left at once (``reset``)."""


CacheEvent = BlockStored | BlockRemoved | AllBlocksCleared
CacheListener = Callable[[CacheEvent], None]

# ---------------------------------------------------------------- page hashes for the radix tree
# A polynomial prefix hash mod 2^64: the state after tokens t_0..t_{k-1} from a start state s is
# P_k = s * B^k + sum_i t_i * B^(k-1-i), so P_k = B^k * (s + sum_{i<k} t_i * B^-(i+1)) with B odd (invertible
# mod 2^64): a cumprod and a cumsum in uint64, whose wrap-around is the modulus. A state chains: the state
# at the end of a node is the start of its children, so each page is hashed once per node. The emitted
# hash is the state through a 64-bit mixer (splitmix64's finalizer). A polynomial hash mod 2^64 has
# constructible collisions (Thue-Morse strings of a few thousand tokens), and any 64-bit hash can collide
# by chance: a collision only misleads a router's index about where a prefix is cached; the cache itself
# matches by comparing tokens, so it never serves wrong KV.
_BASE = np.uint64(0x9E3779B97F4A7C15)
_BASE_INV = np.uint64(pow(0x9E3779B97F4A7C15, -1, 1 << 64))
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)
# B^1..B^n and B^-1..B^-n, grown by doubling: constants (every cache computes the same), and computing them
# per call was most of the cost of hashing a short leaf.
_POWERS: list[np.ndarray] = [np.empty(0, dtype=np.uint64), np.empty(0, dtype=np.uint64)]


def _powers(n: int) -> tuple[np.ndarray, np.ndarray]:
    if len(_POWERS[0]) < n:
        size = max(n, 2 * len(_POWERS[0]), 64)
        _POWERS[:] = [np.cumprod(np.full(size, _BASE)), np.cumprod(np.full(size, _BASE_INV))]
    return _POWERS[0][:n], _POWERS[1][:n]


def namespace_seed(namespace: Hashable) -> int:
    """The start state of a namespace's pages: a 64-bit digest of its ``repr`` (namespaces with equal
    reprs share pages' hashes, which again only misleads a router). O(len(repr))."""
    digest = hashlib.blake2b(b"radixkv-page-seed:" + repr(namespace).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def page_states(start: int, tokens: np.ndarray, page_size: int) -> np.ndarray:
    """The raw prefix-hash state (uint64) at the end of every whole page of ``tokens``, from ``start``. O(n).

    Chaining is exact: hashing ``a + b`` equals hashing ``b`` from the state at the end of ``a``.

    >>> a, b = np.arange(4), np.arange(10, 14)
    >>> whole = page_states(7, np.concatenate([a, b]), 2)
    >>> chained = page_states(int(page_states(7, a, 2)[-1]), b, 2)
    >>> bool((whole[2:] == chained).all()), len(whole)
    (True, 4)
    """
    n = len(tokens) - len(tokens) % page_size
    pows, invs = _powers(n)  # uint64 array arithmetic wraps around mod 2^64 silently: that is the modulus
    terms = np.asarray(tokens[:n], dtype=np.int64).view(np.uint64) * invs
    states = pows * (np.uint64(start) + np.cumsum(terms, dtype=np.uint64))
    return states[page_size - 1 :: page_size]


def mix_states(states: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer over uint64 states: spreads every input bit over the hash. O(n)."""
    z = np.asarray(states, dtype=np.uint64)
    z = (z ^ (z >> np.uint64(30))) * _MIX1
    z = (z ^ (z >> np.uint64(27))) * _MIX2
    return z ^ (z >> np.uint64(31))


def block_hashes(states: np.ndarray) -> tuple[int, ...]:
    """The page hashes (plain ints) of raw states from :func:`page_states`. O(n)."""
    return tuple(mix_states(states).tolist())


def block_hash(state: int) -> int:
    """The page hash of one raw state (a parent page's, say). O(1)."""
    return int(mix_states(np.array([state], dtype=np.uint64))[0])
