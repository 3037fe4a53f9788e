"""``Block`` and ``BlockChain``: the cached blocks of :class:`~radixkv.cache.hash_block.HashBlockCache` and
the handles its ``match_prefix`` returns; ``BlockBooks``, the sizes both hash caches count alike (and how both
drop every lock)."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from radixkv.cache.base import CacheBooks, positive_size
from radixkv.cache.block_hash import LE_INT64, BlockKey


class Block:
    """One cached KV block: ``block_size`` tokens and their slot indices.

    ``lock_count`` counts the locked handles whose chain passes through the
    block (vLLM's ``ref_cnt``); ``own_lock_count`` those that end at it, so a
    block's ``lock_count`` is the sum of ``own_lock_count`` over itself and
    the cached blocks below it. ``num_children`` counts the cached blocks
    that chain from it.
    """

    __slots__ = (
        "key", "parent_key", "tokens", "slots", "lock_count", "own_lock_count", "num_children",
        "last_access", "hit_count", "created", "stamp", "cached", "depth", "user", "state",
    )

    def __init__(self, key: BlockKey, parent_key: BlockKey, tokens: bytes, slots: np.ndarray, now: int, depth: int = 0):
        self.key = key
        self.parent_key = parent_key
        self.tokens = tokens  # int64 little-endian bytes
        self.slots = slots
        self.lock_count = self.own_lock_count = self.num_children = self.hit_count = 0
        self.last_access = self.created = now
        self.stamp = -1
        self.cached = True
        self.depth = depth  # tokens before the block, for eviction policies (as ``user`` and ``state``)
        self.user: object = None
        self.state: object = None

    def __len__(self) -> int:
        return len(self.slots)

    def __repr__(self) -> str:
        toks = np.frombuffer(self.tokens, dtype=LE_INT64)[:8].tolist()
        return f"Block(tokens={toks}, lock={self.lock_count})"


class BlockChain(NamedTuple):
    """Handle returned by ``match_prefix``: the matched blocks, first to last."""

    blocks: tuple

    @property
    def length_blocks(self) -> int:
        return len(self.blocks)


class BlockBooks(CacheBooks):
    """The sizes of a cache of whole blocks of ``block_size`` tokens (``HashBlockCache``, ``HashV0Cache``), from
    its ``_blocks`` and ``_protected_blocks``. O(1) each but ``_drop_locks``."""

    def __init__(self, block_size: int):
        self.block_size = positive_size("block_size", block_size)

    @property
    def page_size(self) -> int:
        """Slots per KV page (what callers generic over caches read): one block fills a page, so ``block_size``."""
        return self.block_size

    @property
    def protected_size(self) -> int:
        """Tokens in blocks with a positive lock count."""
        return self._protected_blocks * self.block_size

    @property
    def num_blocks(self) -> int:
        return len(self._blocks)

    def _drop_locks(self) -> list:
        """Zero every block's lock counts (``unlock_all``; the blocks stay cached): the blocks that were locked,
        for the cache to rank again. O(blocks)."""
        locked = [block for block in self._blocks.values() if block.lock_count]
        for block in locked:
            block.lock_count = block.own_lock_count = 0
        self._protected_blocks = 0
        return locked
