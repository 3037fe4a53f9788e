"""The layout of the caches' ``to_dict`` snapshots (nested dicts, what :mod:`radixkv.viz` draws) and the
drawing of a block tree as ``pretty_print`` text.

Each cache renders its own state in its ``to_dict`` and ``pretty_print`` methods; this module knows no cache
(it reads only the public statistics every entry carries), so the cache modules import it one way.
"""

from __future__ import annotations

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
