"""A cache that caches nothing: the ``prefix_cache="none"`` arm of every experiment."""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable
from typing import Any

import numpy as np

from radixkv.cache.base import NO_HINTS, CacheBooks, CacheHints, MatchResult, TokenSeq, as_token_array
from radixkv.cache.events import CacheListener
from radixkv.cache.render import empty_tree
from radixkv.cache.tiers import Untiered

_EMPTY = np.zeros(0, dtype=np.int64)


class NoPrefixCache(CacheBooks, Untiered):
    """Never matches and stores nothing, behind the same surface as the real caches.

    ``insert`` returns 0 and keeps no slot (``cacheable_length`` is 0), so the
    caller frees every slot of a finished request. All operations O(1) except
    the input validation of ``insert``.
    """

    page_size = 1  # the granularity every cache exposes (its matches are always 0 tokens)
    eviction_policy = "none"
    caches_during_decode = False

    def __init__(self) -> None:
        self.root = ()
        self.clock: Callable[[], float] = time.monotonic  # the protocol's; nothing here reads it
        self.listener: CacheListener | None = None  # the protocol's attribute; nothing is ever cached, so never called
        self.reset()

    def reset(self) -> None:
        self._queried_tokens = self._hit_tokens = 0  # nothing ever hits

    def match_prefix(self, tokens: TokenSeq, namespace: Hashable = None, hints: CacheHints = NO_HINTS) -> MatchResult:
        self._queried_tokens += len(as_token_array(tokens))  # checked like the other caches' inputs
        return MatchResult(0, _EMPTY.copy(), self.root)

    def insert(self, tokens: TokenSeq, indices: TokenSeq, namespace: Hashable = None,
               hints: CacheHints = NO_HINTS) -> int:
        if len(as_token_array(tokens)) != len(as_token_array(indices)):
            raise ValueError(f"tokens and indices differ in length: {len(tokens)} != {len(indices)}")
        return 0

    def cacheable_length(self, num_tokens: int) -> int:
        return 0

    def lock(self, node: Any) -> None:
        """Nothing to lock: no match ever names an entry."""

    def unlock(self, node: Any) -> None:
        """Nothing to unlock."""

    def evict(self, num_tokens: int, victims: list | None = None, demoted_only: bool = False) -> np.ndarray:
        return _EMPTY.copy()

    def demote(self, tokens: TokenSeq, namespace: Hashable = None) -> int:
        return 0

    def held_length(self, tokens: TokenSeq, namespace: Hashable = None) -> int:
        return 0

    def held_slots(self) -> np.ndarray:
        return _EMPTY.copy()

    def unlock_all(self) -> None:
        """Nothing to unlock."""

    total_size = protected_size = property(lambda self: 0)

    def check_invariants(self) -> None:
        """Nothing to check: the cache holds no state but a counter."""

    def to_dict(self, namespace: Hashable = None) -> dict[str, Any]:
        return empty_tree()

    def __repr__(self) -> str:
        return "NoPrefixCache()"

    pretty_print = __repr__
