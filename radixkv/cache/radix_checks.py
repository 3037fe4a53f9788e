"""``RadixCache.check_invariants``: the tree's structure, lock counts, sizes, eviction candidates and slots."""

from __future__ import annotations

from typing import Any

from radixkv.cache.base import all_unique
from radixkv.cache.invariants import requirer


def check_tree(cache: Any, roots: dict, nodes: list, books: dict[str, int]) -> None:
    """Every invariant of ``cache`` (a ``RadixCache``, read through its public surface) whose namespace roots
    are ``roots``, non-root nodes ``nodes`` and recorded counts ``books`` (``clock``, ``nodes``, ``total``,
    ``protected``: what the tree keeps of itself, handed in by its ``check_invariants``); ``AssertionError``
    naming the broken one. O(N + tokens)."""
    require = requirer("RadixCache")
    live = cache.policy.candidates()
    total = protected = 0
    for ns, root in roots.items():
        require(root.parent is None and not root.key and root.lock_count == 0, "root",
                f"root of namespace {ns!r} must be empty, parentless and unlocked")
    for node in nodes:
        n = len(node.value)
        node.check_invariants(require, cache.page_size, books["clock"])
        if not node.children and node.lock_count == 0:
            require(id(node) in live, "every evictable leaf is in the eviction heap", node)
        total += n
        protected += n if node.lock_count > 0 else 0
    for name, counted in (("nodes", len(nodes)), ("total", total), ("protected", protected)):
        require(counted == books[name], f"sizes: {name}", f"counted {counted}, recorded {books[name]}")
    require(cache.total_size == cache.evictable_size + cache.protected_size, "sizes: total = evictable + protected")
    require(all_unique(cache.held_slots()), "slot indices unique across the tree")
    cache.policy.check_invariants(nodes, require)
