"""The caches drawn for people: ``to_dict`` snapshots (nested dicts, what :mod:`radixkv.viz` draws) and the
``pretty_print`` text. Kept apart from the caches because it reads every entry and never changes one: the
cache modules hold only what their operations need.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import TYPE_CHECKING, Any

import numpy as np

from radixkv.cache.block_hash import LE_INT64

if TYPE_CHECKING:
    from radixkv.cache.hash_block import HashBlockCache
    from radixkv.cache.hash_v0 import HashV0Cache
    from radixkv.cache.radix import RadixCache, RadixNode


def _entry(tokens: list[int], indices: list[int], entry: Any, children: list[dict[str, Any]]) -> dict[str, Any]:
    return {"tokens": tokens, "indices": indices, "lock_count": entry.lock_count, "last_access": entry.last_access,
            "hit_count": entry.hit_count, "children": children}


def _empty() -> dict[str, Any]:
    return {"tokens": [], "indices": [], "lock_count": 0, "last_access": 0, "hit_count": 0, "children": []}


def _shown(tokens: Any) -> str:
    """The first 12 tokens (a list or an int64 array), and "..." when there are more."""
    return " ".join(map(str, list(tokens[:12]))) + (" ..." if len(tokens) > 12 else "")


def radix_to_dict(cache: RadixCache, namespace: Hashable = None) -> dict[str, Any]:
    """The tree of one namespace as nested dicts, one per node (an empty root if it holds nothing). O(N + tokens)."""

    def walk(node: RadixNode) -> dict[str, Any]:
        return _entry(node.tokens.tolist(), node.value.tolist(), node, [walk(c) for c in node.children.values()])

    root = cache._root_for(namespace, create=False)
    return walk(root) if root is not None else _empty()


def radix_pretty_print(cache: RadixCache) -> str:
    """An indented text drawing of every namespace's tree. O(N + tokens)."""
    lines = [
        f"RadixCache(page_size={cache.page_size}, policy={cache.eviction_policy}) "
        f"total={cache.total_size} evictable={cache.evictable_size} protected={cache.protected_size}"
    ]

    def walk(node: RadixNode, depth: int) -> None:
        for child in node.children.values():
            toks = child.tokens
            lines.append(f"{'  ' * depth}[{_shown(toks)}] len={len(toks)} lock={child.lock_count} "
                         f"hits={child.hit_count} t={child.last_access}")
            walk(child, depth + 1)

    for ns, root in cache._roots.items():
        if ns is not None or len(cache._roots) > 1:
            lines.append(f"namespace {ns!r}:")
        walk(root, 1)
    return "\n".join(lines)


def hash_block_to_dict(cache: HashBlockCache, namespace: Hashable = None) -> dict[str, Any]:
    """The cached blocks of one namespace as a tree of nested dicts (one node per block). O(blocks)."""
    children: dict[Hashable, list[Any]] = {}
    for block in cache._blocks.values():
        children.setdefault(block.parent_key, []).append(block)

    def walk(block: Any) -> dict[str, Any]:
        return _entry(np.frombuffer(block.tokens, dtype=LE_INT64).tolist(), block.slots.tolist(), block,
                      [walk(c) for c in children.get(block.key, [])])

    tree = _empty()
    tree["children"] = [walk(b) for b in children.get(cache._keys.seed(namespace), [])]
    return tree


def hash_v0_to_dict(cache: HashV0Cache, namespace: Hashable = None) -> dict[str, Any]:
    """The reachable blocks of one namespace as a tree of nested dicts (stranded blocks left out). O(blocks)."""
    children: dict[int | None, list[Any]] = {}
    for block in cache._blocks.values():
        if block.namespace == namespace:
            children.setdefault(block.parent_key, []).append(block)

    def walk(block: Any) -> dict[str, Any]:
        return _entry(list(block.tokens), block.slots.tolist(), block, [walk(c) for c in children.get(block.key, [])])

    tree = _empty()
    tree["children"] = [walk(b) for b in children.get(None, [])]
    return tree


def draw_block_tree(header: str, tree: dict[str, Any]) -> str:
    """``header`` over an indented drawing of a block cache's ``to_dict`` tree. O(blocks)."""
    lines = [header]

    def walk(node: dict[str, Any], depth: int) -> None:
        for child in node["children"]:
            lines.append(f"{'  ' * depth}[{_shown(child['tokens'])}] lock={child['lock_count']} "
                         f"hits={child['hit_count']}")
            walk(child, depth + 1)

    walk(tree, 1)
    return "\n".join(lines)
