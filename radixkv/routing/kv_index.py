"""Where each prefix is cached, across replicas, built only from the caches' events (Dynamo's KV router index).

A router that sends a request to the replica caching most of its prompt needs to know every replica's
cache. Dynamo's KV router does not ask the replicas: each replica's cache publishes vLLM-style KV events
(:mod:`radixkv.cache.events`) and the router folds them into one index. :class:`KVEventIndex` is that
index: feed it ``apply(replica, event)`` from each cache's ``listener`` and ``match`` answers, for a
token sequence, how many leading tokens each replica holds, exactly what each cache's ``match_prefix``
would answer (given every event since the cache was empty or reset).
"""

from __future__ import annotations

from collections.abc import Hashable

import numpy as np

from radixkv.cache.base import TokenSeq, as_token_array, positive_size
from radixkv.cache.events import AllBlocksCleared, BlockRemoved, BlockStored, CacheEvent

OwnKey = Hashable


class KVEventIndex:
    """The blocks every replica caches, keyed by content, built from ``BlockStored`` / ``BlockRemoved`` /
    ``AllBlocksCleared`` events alone.

    Args:
        block_size: tokens per block; every stored event must carry the same (a mismatch is a ``ValueError``).

    The index does not trust the caches' hash functions to agree (the radix tree, the hash caches and the
    v0 cache each name blocks their own way): it gives each block its own key, ``hash((own key of the
    parent block, the block's token bytes))`` with ``("root", namespace)`` as the first block's parent,
    and keeps, per replica, the map from the cache's block hash to that own key (what a removal names),
    and per namespace the map from own key to the replicas holding it (a count each). ``match`` walks the
    request's own keys block by block while any replica still holds them (Dynamo's approach), so a block
    whose parent was removed is unreachable, as it is in the caches. Own keys are 64-bit: a collision
    would only mislead the router, never the caches.

    Events the index cannot place are tolerated, as Dynamo's indexer logs and skips them: a removal of a
    block it never saw is ignored, a store below a parent it does not know is kept (it counts, and its
    removal works) but unreachable. Both happen only to a listener attached to a cache that already held
    blocks; attach it to an empty cache (or just before ``reset``) for an exact index.

    Costs (b = blocks in an event, r = replicas): ``apply`` O(b) hashes of a block's bytes (an
    ``AllBlocksCleared``: O(blocks of the replica)); ``match`` O(n) to read the tokens plus O(matched
    blocks x r) (one hash of a block and one set intersection per block); ``num_blocks`` O(1).

    >>> from radixkv.cache import RadixCache
    >>> index, cache = KVEventIndex(block_size=2), RadixCache(page_size=2)
    >>> cache.listener = lambda event: index.apply(0, event)
    >>> cache.insert([1, 2, 3, 4, 5], [10, 11, 12, 13, 14])
    0
    >>> index.match([1, 2, 3, 4, 5, 6]), index.match([1, 2, 9, 9]), index.match([7, 7])
    ({0: 4}, {0: 2}, {})
    """

    def __init__(self, block_size: int):
        self.block_size = positive_size("block_size", block_size)
        # replica -> the cache's block hash -> (namespace, own key)
        self._stored: dict[int, dict[Hashable, tuple[Hashable, OwnKey]]] = {}
        # namespace -> own key -> replica -> how many of its blocks have that own key (1 but for collisions)
        self._holders: dict[Hashable, dict[OwnKey, dict[int, int]]] = {}

    @property
    def replicas(self) -> tuple[int, ...]:
        """Every replica an event has come from (including those now empty), sorted."""
        return tuple(sorted(self._stored))

    def num_blocks(self, replica: int) -> int:
        """Blocks ``replica`` caches (reachable or not). O(1)."""
        return len(self._stored.get(replica, ()))

    def apply(self, replica: int, event: CacheEvent) -> None:
        """Fold one of ``replica``'s cache events into the index (in the order the cache emitted them)."""
        stored = self._stored.setdefault(replica, {})
        if isinstance(event, BlockStored):
            self._store(replica, stored, event)
        elif isinstance(event, BlockRemoved):
            for block_hash in event.block_hashes:
                self._drop(replica, stored, block_hash)
        elif isinstance(event, AllBlocksCleared):
            for block_hash in list(stored):
                self._drop(replica, stored, block_hash)
        else:
            raise TypeError(f"not a cache event: {event!r}")

    def _store(self, replica: int, stored: dict[Hashable, tuple[Hashable, OwnKey]], event: BlockStored) -> None:
        bs, namespace = self.block_size, event.namespace
        if event.block_size != bs:
            raise ValueError(f"event block_size {event.block_size} != the index's {bs}")
        if len(event.token_ids) != len(event.block_hashes) * bs:
            raise ValueError(f"{len(event.token_ids)} token ids for {len(event.block_hashes)} blocks of {bs}")
        if event.parent_block_hash is None:
            own: OwnKey = ("root", namespace)
        else:
            parent = stored.get(event.parent_block_hash)
            # A parent the index never saw: chain from a key no request's walk can produce.
            own = parent[1] if parent is not None else ("unknown parent", replica, event.parent_block_hash)
        data = np.asarray(event.token_ids, dtype=np.int64).tobytes()
        step = 8 * bs
        holders = self._holders.setdefault(namespace, {})
        for i, block_hash in enumerate(event.block_hashes):
            if block_hash in stored:  # stored again without a removal: replace the old entry
                self._drop(replica, stored, block_hash)
            own = hash((own, data[i * step : (i + 1) * step]))
            stored[block_hash] = (namespace, own)
            counts = holders.setdefault(own, {})
            counts[replica] = counts.get(replica, 0) + 1

    def _drop(self, replica: int, stored: dict[Hashable, tuple[Hashable, OwnKey]], block_hash: Hashable) -> None:
        entry = stored.pop(block_hash, None)
        if entry is None:
            return  # a block the index never saw
        namespace, own = entry
        holders = self._holders[namespace]
        counts = holders[own]
        counts[replica] -= 1
        if not counts[replica]:
            del counts[replica]
            if not counts:
                del holders[own]
                if not holders:
                    del self._holders[namespace]

    def match(self, tokens: TokenSeq, namespace: Hashable = None) -> dict[int, int]:
        """For each replica that caches a nonzero prefix of ``tokens``, how many leading tokens it caches (a
        multiple of ``block_size``, following stored parent links from the namespace's root).
        O(n) + O(matched blocks x replicas)."""
        holders = self._holders.get(namespace)
        if not holders:
            return {}
        bs = self.block_size
        arr = as_token_array(tokens)
        data = arr[: len(arr) - len(arr) % bs].tobytes()
        step, own, alive, matched = 8 * bs, ("root", namespace), set(), 0
        result: dict[int, int] = {}
        for i in range(len(data) // step):
            own = hash((own, data[i * step : (i + 1) * step]))
            counts = holders.get(own)
            if counts is None:
                break
            if i == 0:
                alive = set(counts)
            else:
                for replica in alive.difference(counts):  # replicas whose prefix ends at block i
                    result[replica] = i * bs
                alive.intersection_update(counts)
                if not alive:
                    break
            matched = i + 1
        for replica in alive:
            result[replica] = matched * bs
        return result
