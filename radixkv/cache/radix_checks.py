"""``RadixCache.check_invariants``: the tree's structure, lock counts, sizes, eviction candidates and slots."""

from __future__ import annotations

from typing import Any

from radixkv.cache.base import all_unique
from radixkv.cache.invariants import requirer


def check_tree(cache: Any, nodes: list) -> None:
    """Every invariant of ``cache`` (a ``RadixCache``) whose non-root nodes are ``nodes``; ``AssertionError``
    naming the broken one. O(N + tokens)."""
    require = requirer("RadixCache")
    live = cache.policy.candidates()
    total = protected = 0
    for ns, root in cache._roots.items():
        require(root.parent is None and not root.key and root.lock_count == 0, "root",
                f"root of namespace {ns!r} must be empty, parentless and unlocked")
    for node in nodes:
        n = len(node.value)
        node.check_invariants(require, cache.page_size, cache._clock)
        if not node.children and node.lock_count == 0:
            require(id(node) in live, "every evictable leaf is in the eviction heap", node)
        total += n
        protected += n if node.lock_count > 0 else 0
    require(len(nodes) == cache._num_nodes, "node count", f"counted {len(nodes)}, recorded {cache._num_nodes}")
    require(total == cache._total, "sizes: total", f"counted {total}, recorded {cache._total}")
    require(protected == cache._protected, "sizes: protected", f"counted {protected}, recorded {cache._protected}")
    require(cache.total_size == cache.evictable_size + cache.protected_size, "sizes: total = evictable + protected")
    require(all_unique(cache.held_slots()), "slot indices unique across the tree")
    cache.policy.check_invariants(nodes, require)
