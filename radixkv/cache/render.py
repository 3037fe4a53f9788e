"""The layout of the caches' ``to_dict`` snapshots (nested dicts, what :mod:`radixkv.viz` draws) and the
drawing of a block tree as ``pretty_print`` text.

Each cache renders its own state in its ``to_dict`` and ``pretty_print`` methods; this module knows no cache
(it reads only the public statistics every entry carries), so the cache modules import it one way.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable
from typing import Any


def entry_dict(tokens: list[int], indices: list[int], entry: Any, children: list[dict[str, Any]]) -> dict[str, Any]:
    """One node of a snapshot: an entry's tokens and slot indices, its ``lock_count``, ``last_access`` and
    ``hit_count``, and the snapshots of its children. O(1) beyond its arguments."""
    return {"tokens": tokens, "indices": indices, "lock_count": entry.lock_count, "last_access": entry.last_access,
            "hit_count": entry.hit_count, "children": children}


def empty_tree(children: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """The snapshot of a root: an empty one, or one over ``children`` (their snapshots)."""
    return {"tokens": [], "indices": [], "lock_count": 0, "last_access": 0, "hit_count": 0,
            "children": [] if children is None else children}


def block_tree(blocks: Iterable[Any], root_key: Hashable, tokens: Callable[[Any], list[int]]) -> dict[str, Any]:
    """The snapshot of the ``blocks`` of a block cache (each chaining from its ``parent_key``, named by its ``key``)
    that hang from ``root_key``; ``tokens(block)`` lists a block's tokens. O(blocks)."""
    children: dict[Hashable, list[Any]] = {}
    for block in blocks:
        children.setdefault(block.parent_key, []).append(block)

    def walk(block: Any) -> dict[str, Any]:
        return entry_dict(tokens(block), block.slots.tolist(), block, [walk(c) for c in children.get(block.key, [])])

    return empty_tree([walk(b) for b in children.get(root_key, [])])


def shown(tokens: Any) -> str:
    """The first 12 tokens (a list or an int64 array), and "..." when there are more."""
    return " ".join(map(str, list(tokens[:12]))) + (" ..." if len(tokens) > 12 else "")


def draw_block_tree(header: str, tree: dict[str, Any]) -> str:
    """``header`` over an indented drawing of a block cache's ``to_dict`` tree. O(blocks)."""
    lines = [header]

    def walk(node: dict[str, Any], depth: int) -> None:
        for child in node["children"]:
            lines.append(f"{'  ' * depth}[{shown(child['tokens'])}] lock={child['lock_count']} "
                         f"hits={child['hit_count']}")
            walk(child, depth + 1)

    walk(tree, 1)
    return "\n".join(lines)
