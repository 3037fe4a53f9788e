"""``HashBlockCache.check_invariants``'s structural checks: the chains, the lock counts, children first."""

from __future__ import annotations

from radixkv.cache.block import Block
from radixkv.cache.block_hash import BlockKey
from radixkv.cache.free_queue import FreeQueue, PolicyFreeQueue
from radixkv.cache.invariants import Require


def check_tree(blocks: dict[BlockKey, Block], seeds: list[BlockKey], children: dict[BlockKey, list[Block]],
               require: Require) -> None:
    """Every cached block hangs from a namespace's seed through cached blocks. O(blocks)."""
    reached, stack = 0, list(seeds)
    while stack:
        for block in children.get(stack.pop(), ()):
            reached += 1
            stack.append(block.key)
    require(reached == len(blocks), "every block is reachable from its root",
            f"{len(blocks) - reached} cached blocks hang from a block that is not cached")
    for key, block in blocks.items():
        require(block.num_children == len(children.get(key, ())), "child counts", block)


def check_lock_counts(blocks: dict[BlockKey, Block], require: Require) -> None:
    """Each block's lock_count is the sum of the own locks of the chains through it. O(locked handles x depth)."""
    through: dict[BlockKey, int] = {}
    for block in blocks.values():
        require(block.own_lock_count >= 0, "own lock counts >= 0", block)
        key, locks = block.key, block.own_lock_count
        while locks and key in blocks:
            through[key] = through.get(key, 0) + locks
            key = blocks[key].parent_key
    for key, block in blocks.items():
        require(block.lock_count == through.get(key, 0), "lock_count = own locks of the handles through the block",
                block)


def check_children_first(blocks: dict[BlockKey, Block], queue: FreeQueue | PolicyFreeQueue, require: Require) -> None:
    """``evict`` takes a block only after its cached children. O(blocks).

    ``lru``: every queued block is ahead of its parent, so the head has no
    cached child. Others: ``pop`` passes over a block with children, so
    every unlocked leaf block must be ranked, or evict could get stuck.
    """
    if queue.ranks_by_stats:
        ranked = queue.ranked()
        for block in blocks.values():
            if not block.lock_count and not block.num_children:
                require(block in ranked, "every unlocked leaf block is ranked", block)
        return
    position = {block: i for i, block in enumerate(queue)}
    for block, i in position.items():
        parent = blocks.get(block.parent_key)
        if parent in position:
            require(position[parent] > i, "children before parents in the free queue", block)
