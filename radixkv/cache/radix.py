"""A token-level radix tree of KV slot indices (SGLang's RadixAttention).

Each edge holds a run of token ids and their KV slot indices. Requests that share a prefix share a path;
a request that diverges in the middle of an edge splits it there. Running requests ``lock`` the node where
their cached prefix ends, which protects the whole path to the root; unlocked
leaves are evicted in policy order (LRU by default) and a parent becomes a
leaf, and a candidate, when its last child goes.

Design notes, because they decide the speed:

* Token ids are kept as ``bytes`` (int64, native order), so comparing a query
  with an edge is one ``memcmp`` however long the edge is, and the child of a
  node is found with one dict lookup keyed by the bytes of the first page.
* Evictable leaves sit in the policy's lazy binary heaps: a node is pushed whenever it becomes an evictable
  leaf or its priority changes while it is one; stale entries are dropped when they surface, and a heap
  rebuilds itself from the live ones once it doubled past them: O(log n) amortized per push or pop.
* The tree never frees memory; ``evict`` returns slot indices to the caller.
* Events (:mod:`radixkv.cache.events`) are per page: an insert's new leaf is one ``BlockStored``, an evicted
  leaf one ``BlockRemoved``; a split changes no page, so it says nothing. The listener hears of a change
  once the tree's books hold it, so a listener that raises leaves every invariant whole (an ``evict`` it
  interrupts has removed its victims so far; the caller's recovery, ``allocator.retain``, takes their
  slots). A page's hash is a prefix hash chained from the namespace's seed; each node keeps the state at
  its end once a listener needed it.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator
from typing import Any

import numpy as np

from radixkv.cache.base import (
    NO_HINTS,
    CacheBooks,
    CacheHints,
    Evicted,
    LockError,
    MatchResult,
    TokenSeq,
    as_token_array,
    positive_size,
)
from radixkv.cache.events import AllBlocksCleared, CacheListener, page_states
from radixkv.cache.eviction import EvictionPolicy, make_policy, policy_clock
from radixkv.cache.radix_checks import check_tree
from radixkv.cache.radix_events import removed, state_at, stored
from radixkv.cache.radix_node import RadixNode
from radixkv.cache.render import empty_tree
from radixkv.cache.tiers import Untiered

_ITEM = 8  # bytes per token id (int64)
_EMPTY = np.zeros(0, dtype=np.int64)


class RadixCache(CacheBooks, Untiered):
    """Token-level radix tree mapping token prefixes to KV slot indices.

    Args:
        page_size: slots (tokens) per KV page, the unit the tree matches in: matches and inserts are
            rounded down to whole pages, and edges always hold whole pages.
        eviction_policy: a policy name of :mod:`radixkv.cache.eviction` (``lru`` by default) or a fresh
            ``EvictionPolicy`` (``make_policy(name, **params)``), which orders the unlocked leaves. A leaf is
            pushed whenever it becomes a candidate and whenever a match, insert or split touches it while it
            is one, so a priority may read the leaf's place in the tree (the clairvoyant one does).

    Costs (n = tokens in the query, d = depth of the matched path, N = nodes in the tree):
    ``match_prefix`` and ``insert`` are O(n) memcmp work plus O(d) Python steps, never a Python loop over
    tokens, plus O(L) copying where they split an edge of L tokens; ``lock``/``unlock`` are O(d); ``evict``
    is O(k log N) for k removed leaves (the policy's own costs add to these). A namespace's root goes when its
    last entry is evicted. ``clock`` (seconds, ``time.monotonic`` by default) is the policy's.

    >>> cache = RadixCache()
    >>> cache.insert([1, 2, 3, 4, 5], [10, 11, 12, 13, 14])
    0
    >>> cache.insert([1, 2, 3, 9], [20, 21, 22, 23])   # slots 20..22 are duplicates
    3
    >>> m = cache.match_prefix([1, 2, 3, 4, 7])
    >>> m.length, m.indices.tolist()
    (4, [10, 11, 12, 13])
    >>> cache.total_size
    6
    """

    caches_during_decode = False  # generated tokens join the cache at finish (see PrefixCache)

    def __init__(self, page_size: int = 1, eviction_policy: str | EvictionPolicy = "lru"):
        self.page_size = positive_size("page_size", page_size)
        self.policy = make_policy(eviction_policy).bind(self, self._live)  # its heaps compact themselves
        self.eviction_policy = self.policy.name
        self._observes = self.policy.observes  # read on every match, insert and eviction
        self._page_bytes = _ITEM * self.page_size
        self.listener: CacheListener | None = None  # called with every CacheEvent; kept across reset
        self.reset()

    # ------------------------------------------------------------------ state
    def reset(self) -> None:
        """Drop everything: an empty tree, clock and statistics at zero. O(N): CPython frees the old nodes now."""
        self.root = RadixNode(b"", _EMPTY, None, 0)
        self._roots: dict[Hashable, RadixNode] = {None: self.root}
        # id(root) -> its namespace, for the current roots: a namespace's goes once it holds nothing
        self._namespace_of: dict[int, Hashable] = {id(self.root): None}
        self._old_root_ids: set[int] = set()  # dropped roots, whose handles stay valid (locking a root does nothing)
        self.policy.reset()
        self._clock = self._num_nodes = self._total = self._protected = self._queried_tokens = self._hit_tokens = 0
        if self.listener is not None:
            self.listener(AllBlocksCleared())

    clock = policy_clock

    @property
    def total_size(self) -> int:
        """Tokens held in the tree."""
        return self._total

    @property
    def protected_size(self) -> int:
        """Tokens in nodes with a positive lock count."""
        return self._protected

    @property
    def num_nodes(self) -> int:
        """Nodes in the tree, roots excluded."""
        return self._num_nodes

    # ---------------------------------------------------------------- helpers
    def _key_of(self, tokens: TokenSeq) -> tuple[np.ndarray, bytes]:
        arr = as_token_array(tokens)
        usable = len(arr) - len(arr) % self.page_size
        return arr, arr[:usable].tobytes()

    @staticmethod
    def _live(node: RadixNode) -> bool:  # an evictable leaf
        return node.parent is not None and not node.children and node.lock_count == 0

    @staticmethod
    def parent_of(node: RadixNode) -> RadixNode | None:
        """The node above ``node``; None below a root. O(1)."""
        return node.parent if node.parent.parent is not None else None

    @staticmethod
    def is_last_child(node: RadixNode) -> bool:
        """Whether ``node`` is its parent's only child. O(1)."""
        return len(node.parent.children) == 1

    def key_of(self, node: RadixNode) -> Hashable:
        """A key naming ``node``'s prefix through its first page (for policies' ghost lists): the page-hash state
        there (``radixkv.cache.events``), chained from the state each node keeps at its end, so the key is the
        same whatever edges the prefix is split into. O(first page), plus the tokens of the path's nodes that
        have no state yet (each node's is computed once)."""
        start = state_at(self, node.parent)
        return int(page_states(start, node.tokens[: self.page_size], self.page_size)[-1])

    def _common_bytes(self, key: bytes, query: bytes, off: int) -> int:
        """Bytes (whole pages) that ``key`` shares with ``query[off:]``; key's first page is known to match."""
        rest = query[off : off + len(key)]
        if key.startswith(rest):
            n = len(rest)
        else:
            a = np.frombuffer(key, dtype=np.int64, count=len(rest) // _ITEM)
            b = np.frombuffer(rest, dtype=np.int64)
            n = int(np.argmax(a != b)) * _ITEM
        return n - n % self._page_bytes

    def _split(self, child: RadixNode, nbytes: int) -> RadixNode:
        """Cut ``child``'s edge after ``nbytes``; the new upper node is returned.

        ``child`` keeps its identity (and so any request's handle to it still
        ends at the same token); the new node copies its lock count, access
        time, hit count and creation time, so sizes and eviction order hold.
        """
        ntok = nbytes // _ITEM
        parent = child.parent
        upper = RadixNode(child.key[:nbytes], child.value[:ntok].copy(), parent, child.created, child.depth)
        upper.lock_count, upper.last_access, upper.hit_count = child.lock_count, child.last_access, child.hit_count
        child.depth += ntok
        parent.children[child.key[: self._page_bytes]] = upper
        child.key = child.key[nbytes:]
        child.value = child.value[ntok:].copy()
        child.parent = upper
        upper.children[child.key[: self._page_bytes]] = child
        self._num_nodes += 1
        if self._observes:
            self.policy.split(upper, child)
        if not child.children and child.lock_count == 0:
            self.policy.push(child)  # its edge now starts elsewhere: a position-aware priority (Belady) changes
        return upper

    def _root_for(self, namespace: Hashable, create: bool) -> RadixNode | None:
        if namespace is None:
            return self.root
        root = self._roots.get(namespace)
        if root is None and create:
            root = self._roots[namespace] = RadixNode(b"", _EMPTY, None, 0)
            self._namespace_of[id(root)] = namespace
        return root

    def root_of(self, namespace: Hashable = None) -> RadixNode | None:
        """The root of ``namespace``'s tree (the default one always exists); None when it holds nothing. O(1)."""
        return self._root_for(namespace, create=False)

    def namespace_of(self, node: RadixNode) -> Hashable:
        """The namespace whose tree ``node`` (one in the tree now) hangs from; a root's own. O(depth)."""
        return self._namespace_of[id(node.path()[1])]

    # ----------------------------------------------------------------- public
    def match_prefix(self, tokens: TokenSeq, namespace: Hashable = None, hints: CacheHints = NO_HINTS) -> MatchResult:
        """Longest cached prefix of ``tokens`` (whole pages).

        When the match ends inside an edge, that edge is split so that the
        returned node ends exactly at ``length``. Refreshes recency and hit
        counts along the matched path (and tells the policy, with ``hints``). O(n) memcmp work + O(d) Python
        steps (+ O(L) for a split edge of L tokens).
        """
        arr, query = self._key_of(tokens)
        self._queried_tokens += len(arr)
        self._clock += 1
        now = self._clock
        node = self._root_for(namespace, create=False)
        if node is None:
            return MatchResult(0, _EMPTY.copy(), self.root)
        pb, end, off = self._page_bytes, len(query), 0
        values = []
        while off < end:
            child = node.children.get(query[off : off + pb])
            if child is None:
                break
            key = child.key
            ends_inside = not query.startswith(key, off)  # compares in place, no slice copy
            if ends_inside:
                child = self._split(child, self._common_bytes(key, query, off))
            off += len(child.key)
            node = child
            node.last_access = now
            node.hit_count += 1
            values.append(node.value)
            if ends_inside:
                break
        if self._observes and values:  # only a policy that watches every access pays for the path
            self.policy.touched(node.path()[0], hints, True)
        if node.parent is not None and not node.children and node.lock_count == 0:
            self.policy.push(node)  # its priority changed
        length = off // _ITEM
        self._hit_tokens += length
        return MatchResult(length, np.concatenate(values) if values else _EMPTY.copy(), node)

    def insert(self, tokens: TokenSeq, indices: TokenSeq, namespace: Hashable = None,
               hints: CacheHints = NO_HINTS) -> int:
        """Store ``tokens[:L]`` with their slot indices, L = len rounded down to whole pages.

        Returns how many leading tokens were already cached. Existing values
        are never overwritten: the caller owns ``indices[k:returned]`` (k = what
        it had matched itself) as duplicates and must free them. The tree
        copies what it keeps. O(n) memcmp work + O(d) Python steps (+ O(L) for
        a split edge of L tokens).
        """
        arr, query = self._key_of(tokens)
        idx = as_token_array(indices)
        if len(idx) != len(arr):
            raise ValueError(f"tokens and indices differ in length: {len(arr)} != {len(idx)}")
        self._clock += 1
        now = self._clock
        node = self._root_for(namespace, create=bool(query))  # no root for a namespace that gets nothing
        if node is None:
            return 0
        pb, end, off = self._page_bytes, len(query), 0
        while off < end:
            child = node.children.get(query[off : off + pb])
            if child is None:
                break
            key = child.key
            if not query.startswith(key, off):
                # Diverges (or ends) inside this edge: after the split the
                # next lookup misses, so the loop ends with the new leaf.
                child = self._split(child, self._common_bytes(key, query, off))
            off += len(child.key)
            node = child
            node.last_access = now
        if off < end:
            start, stop = off // _ITEM, end // _ITEM
            leaf = RadixNode(query[off:], idx[start:stop].copy(), node, now, start)
            node.children[query[off : off + pb]] = leaf
            self._num_nodes += 1
            self._total += stop - start
            if self._observes:
                self.policy.inserted(leaf, hints)
                self.policy.touched(leaf.path()[0], hints, False)
            self.policy.push(leaf)
            if self.listener is not None:
                stored(self, node, leaf, namespace)
        else:
            if self._observes and node.parent is not None:
                self.policy.touched(node.path()[0], hints, False)
            if node.parent is not None and not node.children and node.lock_count == 0:
                self.policy.push(node)  # fully cached: its recency changed
        return off // _ITEM

    def _check_attached(self, node: RadixNode, verb: str) -> None:
        """Raise ``LockError`` unless ``node`` hangs from one of this cache's current roots. O(depth)."""
        top = node
        while top.parent is not None:
            top = top.parent
        if top is node and not node.key and id(node) in self._old_root_ids:
            return
        if top.key or id(top) not in self._namespace_of:
            raise LockError(f"cannot {verb} {node!r}: it is no longer in the cache (evicted, or from before reset())")

    def lock(self, node: RadixNode) -> None:
        """Protect ``node`` and its path to the root from eviction. O(depth).

        Locking a root does nothing; locking a node that was evicted (or
        belongs to the tree from before ``reset``) raises ``LockError``.
        """
        self._check_attached(node, "lock")
        if node.parent is not None:
            node.own_lock_count += 1
        while node.parent is not None:
            if node.lock_count == 0:
                self._protected += len(node.value)
            node.lock_count += 1
            node = node.parent

    def unlock(self, node: RadixNode) -> None:
        """Release one ``lock`` of ``node``. O(depth).

        Raises ``LockError`` (changing nothing) when the node's count is
        already zero, when it was never locked itself (only nodes below it
        were), or when the node is no longer in the cache. Unlocking a root
        does nothing.
        """
        self._check_attached(node, "unlock")
        if node.parent is None:
            return
        if node.own_lock_count <= 0:
            raise LockError(f"unlock of {node!r}, which holds no lock of its own (lock count {node.lock_count}; "
                            "locks on nodes below it are released through those nodes)")
        node.own_lock_count -= 1
        leaf = node
        while node.parent is not None:
            node.lock_count -= 1
            if node.lock_count == 0:
                self._protected -= len(node.value)
            node = node.parent
        if leaf.lock_count == 0 and not leaf.children:
            self.policy.push(leaf)

    def held_length(self, tokens: TokenSeq, namespace: Hashable = None) -> int:
        """How many leading tokens of ``tokens`` (whole pages) the tree holds, touching nothing: no recency,
        hit count, statistic or split (a tiered cache asks where a prefix it writes down starts). O(n) memcmp
        work + O(d)."""
        _, query = self._key_of(tokens)
        node = self._root_for(namespace, create=False)
        off, pb = 0, self._page_bytes
        while node is not None and (child := node.children.get(query[off : off + pb])) is not None:
            if not query.startswith(child.key, off):
                return (off + self._common_bytes(child.key, query, off)) // _ITEM
            off += len(child.key)
            node = child
        return off // _ITEM

    def demote(self, tokens: TokenSeq, namespace: Hashable = None) -> int:
        """Rank the nodes wholly within the cached prefix of ``tokens`` as the least recently used of all
        (``last_access`` below zero, the latest demotion lowest): a lower tier's copies of what a nearer tier
        holds. Under ``lru`` they are evicted before any other node, and ``evict(..., demoted_only=True)``
        takes only them; other policies weigh the age with their own statistics. A match or insert through
        them restores them. Splits nothing. Returns the tokens demoted. O(n) memcmp work + O(d)."""
        _, query = self._key_of(tokens)
        node = self._root_for(namespace, create=False)
        if node is None:
            return 0
        self._clock += 1
        mark, pb, off = -self._clock, self._page_bytes, 0
        while (child := node.children.get(query[off : off + pb])) is not None and query.startswith(child.key, off):
            off += len(child.key)
            node = child
            node.last_access = mark
        if self._live(node):
            self.policy.push(node)
        return off // _ITEM

    def evict(self, num_tokens: int, victims: list[Evicted] | None = None, demoted_only: bool = False) -> np.ndarray:
        """Remove unlocked leaves in policy order until ``num_tokens`` are freed.

        Stops early without error when nothing is evictable (with ``demoted_only``, when the next victim was
        not demoted). Returns the freed slot indices (int64); the caller gives them back to its allocator.
        ``victims``, when given, gets an ``Evicted`` per removed leaf, in order (a tiered cache writes them
        back). O(k log N) for k removed leaves (plus stale heap entries skipped,
        amortized against the pushes that made them; + O(depth + path tokens) each with ``victims``).
        """
        policy, pb = self.policy, self._page_bytes
        freed: list[np.ndarray] = []
        count = 0
        while count < num_tokens:
            node = policy.pop(self._live)
            if node is None:
                break
            if demoted_only and node.last_access >= 0:
                self.policy.push(node)  # back where it was: not this call's to take
                break
            if self._observes:
                policy.evicted(node)
            parent = node.parent
            event = None if self.listener is None else removed(self, node)  # while it still hangs from its path
            if victims is not None:
                victims.append(self._evicted(node))
            del parent.children[node.key[:pb]]
            node.parent = None
            freed.append(node.value)
            count += len(node.value)
            self._total -= len(node.value)  # per victim: a policy may read total_size while evict runs
            self._num_nodes -= 1
            if not parent.children and parent.parent is not None and parent.lock_count == 0:
                self.policy.push(parent)
            elif not parent.children and parent is not self.root and parent.parent is None:
                self._drop_root(parent)
            if event is not None:  # told once the books hold the removal: a listener that raises breaks nothing
                self.listener(event)
        return np.concatenate(freed) if freed else _EMPTY.copy()

    def _evicted(self, leaf: RadixNode) -> Evicted:  # its whole prefix, still in the tree: O(depth + tokens)
        path, root = leaf.path()
        tokens = np.frombuffer(b"".join(n.key for n in path), dtype=np.int64)
        return Evicted(self._namespace_of[id(root)], tokens, np.concatenate([n.value for n in path]))

    def _drop_root(self, root: RadixNode) -> None:  # a namespace that holds nothing: O(1)
        del self._roots[self._namespace_of.pop(id(root))]
        self._old_root_ids.add(id(root))

    def held_slots(self) -> np.ndarray:  # every slot index the tree holds, locked or not: O(total_size)
        return np.concatenate([node.value for node in self._all_nodes()] + [_EMPTY])

    def unlock_all(self) -> None:
        """Drop every lock (for a caller whose books are lost, e.g. after a failed step); entries stay. O(N log N)."""
        for node in self._all_nodes():
            node.lock_count = node.own_lock_count = 0
            if not node.children:
                self.policy.push(node)
        self._protected = 0

    # ------------------------------------------------------------- inspection
    def _all_nodes(self) -> Iterator[RadixNode]:
        stack = list(self._roots.values())
        while stack:
            node = stack.pop()
            if node.parent is not None:
                yield node
            stack.extend(node.children.values())

    def check_invariants(self) -> None:
        """Verify every structural invariant (the tree's structure, lock counts, sizes, heap and slots); raise
        ``AssertionError`` naming the broken one. O(N + tokens)."""
        books = {"clock": self._clock, "nodes": self._num_nodes, "total": self._total, "protected": self._protected}
        check_tree(self, self._roots, list(self._all_nodes()), books)

    def to_dict(self, namespace: Hashable = None) -> dict[str, Any]:
        """The tree of one namespace as nested dicts, one per node (an empty root if it holds nothing), for
        notebooks and tests. O(N + tokens)."""
        root = self.root_of(namespace)
        return root.to_dict() if root is not None else empty_tree()

    def pretty_print(self) -> str:
        """An indented text drawing of every namespace's tree. O(N + tokens)."""
        lines = [f"RadixCache(page_size={self.page_size}, policy={self.eviction_policy}) "
                 f"total={self.total_size} evictable={self.evictable_size} protected={self.protected_size}"]
        for ns, root in self._roots.items():
            if ns is not None or len(self._roots) > 1:
                lines.append(f"namespace {ns!r}:")
            root.draw(lines, 1)
        return "\n".join(lines)

    def __repr__(self) -> str:
        return (f"RadixCache(page_size={self.page_size}, eviction_policy={self.eviction_policy!r}, "
                f"total_size={self.total_size}, nodes={self.num_nodes})")
