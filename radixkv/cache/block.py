"""``Block`` and ``BlockChain``: the cached blocks of :class:`~radixkv.cache.hash_block.HashBlockCache` and
the handles its ``match_prefix`` returns."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

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

    def __init__(self, key: BlockKey, parent_key: BlockKey, tokens: bytes, slots: np.ndarray, now: int):
        self.key = key
        self.parent_key = parent_key
        self.tokens = tokens  # int64 little-endian bytes
        self.slots = slots
        self.lock_count = self.own_lock_count = self.num_children = 0
        self.last_access = now
        self.hit_count = 0
        self.created = now
        self.stamp = -1
        self.cached = True
        self.depth = 0  # tokens before the block, for eviction policies (as ``user`` and ``state``)
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
