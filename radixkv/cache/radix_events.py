"""The radix tree's cache events (:mod:`radixkv.cache.events`): a new leaf's pages are one ``BlockStored``, an
evicted leaf's one ``BlockRemoved``. A page's hash is a prefix hash chained from the namespace's seed; each
node keeps the state at its end once a listener needed it."""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

from radixkv.cache.events import BlockRemoved, BlockStored, block_hash, block_hashes, namespace_seed, page_states
from radixkv.cache.radix_node import RadixNode


def state_at(cache: Any, node: RadixNode) -> int:
    """The page-hash state at the end of ``node``'s edge in ``cache`` (a root: its namespace's seed). Computed
    once per node and kept (a split leaves the lower node's end, so its state, as it was). O(tokens of the
    path's nodes without one)."""
    path = []
    while node.prefix_state is None and node.parent is not None:
        path.append(node)
        node = node.parent
    if node.prefix_state is None:  # a root
        node.prefix_state = namespace_seed(cache.namespace_of(node))
    state = node.prefix_state
    for below in reversed(path):
        state = below.prefix_state = int(page_states(state, below.tokens, cache.page_size)[-1])
    return state


def stored(cache: Any, parent: RadixNode, leaf: RadixNode, namespace: Hashable) -> None:
    """Tell ``cache.listener`` about a new leaf's pages. O(depth + leaf tokens)."""
    start = state_at(cache, parent)
    states = page_states(start, leaf.tokens, cache.page_size)
    leaf.prefix_state = int(states[-1])
    first_parent = None if parent.parent is None else block_hash(start)
    cache.listener(BlockStored(block_hashes(states), first_parent, tuple(leaf.tokens.tolist()),
                               cache.page_size, namespace))


def removed(cache: Any, leaf: RadixNode) -> BlockRemoved:
    """The event of an evicted leaf's pages (the whole leaf goes), built while the leaf still hangs from its
    path; the cache tells its listener once the leaf is gone. O(depth + leaf tokens)."""
    states = page_states(state_at(cache, leaf.parent), leaf.tokens, cache.page_size)
    return BlockRemoved(block_hashes(states), cache.namespace_of(leaf))
