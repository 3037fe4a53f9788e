"""``RadixNode``: one edge of :class:`~radixkv.cache.radix.RadixCache`'s tree and the node it leads to."""

from __future__ import annotations

from typing import Any

import numpy as np

from radixkv.cache.invariants import Require
from radixkv.cache.render import entry_dict, shown

_ITEM = 8  # bytes per token id (int64)


class RadixNode:
    """One edge of the tree and the node it leads to.

    ``key`` holds the edge's token ids as int64 bytes and ``value`` their slot
    indices (``len(key) == 8 * len(value)``). ``lock_count`` counts the locks
    that protect the node: those held on it or anywhere in its subtree (one
    per running request whose handle passes through it); ``own_lock_count``
    those held on this very node, so ``lock_count == own_lock_count + sum of
    the children's lock_count`` and only a node that was locked itself can be
    unlocked. ``depth``, ``user`` and ``state`` are the eviction policy's
    (:mod:`radixkv.cache.eviction.base`).
    """

    __slots__ = (
        "key", "value", "children", "parent", "lock_count", "own_lock_count",
        "last_access", "hit_count", "created", "stamp", "prefix_state", "depth", "user", "state",
    )

    def __init__(self, key: bytes, value: np.ndarray, parent: RadixNode | None, now: int, depth: int = 0):
        self.key = key
        self.value = value
        self.children: dict[bytes, RadixNode] = {}
        self.parent = parent
        self.lock_count = self.own_lock_count = self.hit_count = 0
        self.last_access = self.created = now
        self.stamp = -1  # sequence number of this node's newest heap entry
        self.prefix_state: int | None = None  # page-hash state at the edge's end, once a listener or key_of needed it
        self.depth = depth  # tokens before the edge (its prefix), for eviction policies
        self.user: object = None  # the eviction policy's: the last request that used it
        self.state: object = None  # the eviction policy's own record

    @property
    def tokens(self) -> np.ndarray:
        """The edge's token ids (a read-only int64 view)."""
        return np.frombuffer(self.key, dtype=np.int64)

    def __len__(self) -> int:
        return len(self.value)

    def __repr__(self) -> str:
        toks = self.tokens
        more = "..." if len(toks) > 8 else ""
        return f"RadixNode(tokens={toks[:8].tolist()}{more}, len={len(toks)}, lock={self.lock_count})"

    def path(self) -> tuple[list[RadixNode], RadixNode]:
        """The nodes from the root's child down to this one, and the root. O(depth)."""
        path, node = [], self
        while node.parent is not None:
            path.append(node)
            node = node.parent
        return path[::-1], node

    def to_dict(self) -> dict[str, Any]:
        """This node's subtree as nested dicts, one per node (the layout of :func:`radixkv.cache.render.entry_dict`).
        O(subtree nodes + tokens)."""
        return entry_dict(self.tokens.tolist(), self.value.tolist(), self,
                          [child.to_dict() for child in self.children.values()])

    def draw(self, lines: list[str], depth: int) -> None:
        """Append an indented text line per node of this node's subtree below it (children at ``depth``) to
        ``lines``, as ``RadixCache.pretty_print`` draws them. O(subtree nodes)."""
        for child in self.children.values():
            toks = child.tokens
            lines.append(f"{'  ' * depth}[{shown(toks)}] len={len(toks)} lock={child.lock_count} "
                         f"hits={child.hit_count} t={child.last_access}")
            child.draw(lines, depth + 1)

    def check_invariants(self, require: Require, page_size: int, clock: int) -> None:
        """This non-root node's own invariants within a tree of ``page_size`` pages whose logical clock reads
        ``clock``: a non-empty page-aligned edge, its parent's child key, lock counts, dtype, time stamps;
        ``require`` (:func:`radixkv.cache.invariants.requirer`) fails. O(children)."""
        n = len(self.value)
        require(n > 0 and len(self.key) > 0, "no empty non-root node", self)
        require(len(self.key) == _ITEM * n, "key and value lengths", self)
        require(n % page_size == 0, "edge lengths page-aligned", (self, f"page_size={page_size}"))
        require(self.parent.children.get(self.key[: _ITEM * page_size]) is self, "child keys match their edges", self)
        require(self.lock_count >= 0, "lock counts >= 0", self)
        child_locks = sum(c.lock_count for c in self.children.values())
        require(self.own_lock_count >= 0 and self.lock_count == self.own_lock_count + child_locks,
                "lock counts consistent with the children",
                (self, f"own_lock_count {self.own_lock_count}, children's lock_count sum to {child_locks}"))
        require(self.value.dtype == np.int64, "indices are int64", self)
        require(self.last_access <= clock and self.created <= clock, "logical clock", self)
