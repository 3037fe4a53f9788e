"""The structural invariants of every cache, checked after each operation by the randomized tests.

``check_invariants()`` of each cache calls one of these. They read the caches' internals (they are the caches'
own checks, kept here so the cache modules hold only what their operations need) and change nothing; each
raises ``AssertionError`` naming the broken invariant.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from radixkv.cache.base import all_unique

if TYPE_CHECKING:
    from radixkv.cache.block_hash import BlockKey
    from radixkv.cache.hash_block import Block, HashBlockCache
    from radixkv.cache.hash_v0 import HashV0Cache
    from radixkv.cache.radix import RadixCache

Require = Callable[..., None]

_ITEM = 8  # bytes per token id (int64)


def requirer(kind: str) -> Require:
    """``require(ok, name, detail="")``: raise ``AssertionError`` naming ``kind``'s invariant ``name`` unless ok."""

    def require(ok: bool, name: str, detail: object = "") -> None:
        if not ok:  # the detail (often a node or block) is formatted only on failure: this runs per entry
            raise AssertionError(f"{kind} invariant '{name}' broken: {detail!r}")

    return require


def check_radix(cache: RadixCache) -> None:
    """The tree's structure, lock counts, sizes, heap and slots. O(N + tokens)."""
    require = requirer("RadixCache")
    pb = cache._page_bytes
    live = {id(e[2]) for e in cache._heap if cache._entry_is_live(e)}
    total = protected = nodes = 0
    for ns, root in cache._roots.items():
        require(root.parent is None and not root.key and root.lock_count == 0, "root",
                f"root of namespace {ns!r} must be empty, parentless and unlocked")
    for node in cache._all_nodes():
        nodes += 1
        n = len(node.value)
        require(n > 0 and len(node.key) > 0, "no empty non-root node", node)
        require(len(node.key) == _ITEM * n, "key and value lengths", node)
        require(n % cache.page_size == 0, "edge lengths page-aligned", (node, f"page_size={cache.page_size}"))
        require(node.parent.children.get(node.key[:pb]) is node, "child keys match their edges", node)
        require(node.lock_count >= 0, "lock counts >= 0", node)
        child_locks = sum(c.lock_count for c in node.children.values())
        require(node.own_lock_count >= 0 and node.lock_count == node.own_lock_count + child_locks,
                "lock counts consistent with the children",
                (node, f"own_lock_count {node.own_lock_count}, children's lock_count sum to {child_locks}"))
        require(node.value.dtype == np.int64, "indices are int64", node)
        require(node.last_access <= cache._clock and node.created <= cache._clock, "logical clock", node)
        if not node.children and node.lock_count == 0:
            require(id(node) in live, "every evictable leaf is in the eviction heap", node)
        total += n
        protected += n if node.lock_count > 0 else 0
    require(nodes == cache._num_nodes, "node count", f"counted {nodes}, recorded {cache._num_nodes}")
    require(total == cache._total, "sizes: total", f"counted {total}, recorded {cache._total}")
    require(protected == cache._protected, "sizes: protected", f"counted {protected}, recorded {cache._protected}")
    require(cache.total_size == cache.evictable_size + cache.protected_size, "sizes: total = evictable + protected")
    require(all_unique(cache.held_slots()), "slot indices unique across the tree")


def check_hash_block(cache: HashBlockCache) -> None:
    """Keys, reachability, lock counts, the free queue's order, sizes and slots. O(blocks + locked x depth)."""
    require = requirer("HashBlockCache")
    locked = 0
    children: dict[BlockKey, list[Block]] = {}
    for key, block in cache._blocks.items():
        require(block.key == key and block.cached, "map keys match their blocks", block)
        require(len(block.slots) == cache.block_size == len(block.tokens) // 8 and block.slots.dtype == np.int64,
                "blocks are full, their indices int64", block)
        require(block.lock_count >= 0, "lock counts >= 0", block)
        require(cache._hash(block.parent_key, block.tokens) == key, "key = H(parent key, tokens)", block)
        require((block in cache._queue) == (block.lock_count == 0), "free queue holds exactly the unlocked blocks",
                block)
        locked += block.lock_count > 0
        children.setdefault(block.parent_key, []).append(block)
    _check_tree(cache, require, children)
    _check_lock_counts(cache, require)
    _check_children_first(cache, require)
    require(len(cache._queue) == len(cache._blocks) - locked, "free queue size")
    require(locked == cache._protected_blocks, "sizes: protected",
            f"counted {locked} blocks, recorded {cache._protected_blocks}")
    require(cache.total_size == cache.evictable_size + cache.protected_size, "sizes: total = evictable + protected")
    require(all_unique(cache.held_slots()), "slot indices unique across the cache")


def _check_tree(cache: HashBlockCache, require: Require, children: dict[BlockKey, list[Block]]) -> None:
    """Every cached block hangs from a namespace's seed through cached blocks. O(blocks)."""
    reached, stack = 0, cache._keys.seeds()
    while stack:
        for block in children.get(stack.pop(), ()):
            reached += 1
            stack.append(block.key)
    require(reached == len(cache._blocks), "every block is reachable from its root",
            f"{len(cache._blocks) - reached} cached blocks hang from a block that is not cached")
    for key, block in cache._blocks.items():
        require(block.num_children == len(children.get(key, ())), "child counts", block)


def _check_lock_counts(cache: HashBlockCache, require: Require) -> None:
    """Each block's lock_count is the sum of the own locks of the chains through it. O(locked handles * depth)."""
    through: dict[BlockKey, int] = {}
    for block in cache._blocks.values():
        require(block.own_lock_count >= 0, "own lock counts >= 0", block)
        key, locks = block.key, block.own_lock_count
        while locks and key in cache._blocks:
            through[key] = through.get(key, 0) + locks
            key = cache._blocks[key].parent_key
    for key, block in cache._blocks.items():
        require(block.lock_count == through.get(key, 0), "lock_count = own locks of the handles through the block",
                block)


def _check_children_first(cache: HashBlockCache, require: Require) -> None:
    """``evict`` takes a block only after its cached children. O(blocks).

    ``lru``: every queued block is ahead of its parent, so the head has no
    cached child. Others: ``pop`` passes over a block with children, so
    every unlocked leaf block must be ranked, or evict could get stuck.
    """
    if cache._queue.ranks_by_stats:
        ranked = cache._queue.ranked()
        for block in cache._blocks.values():
            if not block.lock_count and not block.num_children:
                require(block in ranked, "every unlocked leaf block is ranked", block)
        return
    position = {block: i for i, block in enumerate(cache._queue)}
    for block, i in position.items():
        parent = cache._blocks.get(block.parent_key)
        if parent in position:
            require(position[parent] > i, "children before parents in the free queue", block)


def check_hash_v0(cache: HashV0Cache) -> None:
    """Keys (whole-prefix hashes), lock counts, sizes, the evictor's heap and slots. O(cached prefix tokens + heap)."""
    require = requirer("HashV0Cache")
    bs, locked, through = cache.block_size, 0, {}
    for key, block in cache._blocks.items():
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
            node = None if parent_key is None else cache._blocks.get((parent_key, node.namespace))
            require(parent_key is None or node is not None, "a locked block's parent is cached", block)
    for block in cache._blocks.values():
        require(block.lock_count == through.get(id(block), 0), "lock_count = own locks of the handles through it",
                block)
    require(locked == cache._protected_blocks, "sizes: protected", (locked, cache._protected_blocks))
    require(len(cache._blocks) - locked == cache._unlocked, "sizes: unlocked", (locked, cache._unlocked))
    require(cache._spare_tokens == sum(len(s) for s in cache._spare), "sizes: spare slots")
    require(cache.total_size == cache.evictable_size + cache.protected_size, "sizes: total = evictable + protected")
    live = {id(e[3]) for e in cache._heap if cache._live(e[2], e[3])}
    for block in cache._blocks.values():
        require(block.lock_count > 0 or id(block) in live, "every unlocked block is ranked", block)
    parts = [b.slots for b in cache._blocks.values()] + cache._spare
    if parts:
        require(all_unique(np.concatenate(parts)), "slot indices unique across the cache")
