"""The prefix-cache interface shared by every cache implementation.

A prefix cache maps token prefixes to KV slot indices. It never owns memory:
``insert`` takes slot indices the caller allocated, ``evict`` hands slot indices
back, and the caller returns them to its :class:`~radixkv.memory.SlotAllocator`.
The engine and the simulator depend only on :class:`PrefixCache`, so an
experiment swaps caches by changing one constructor argument.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any, NamedTuple, Protocol, runtime_checkable

import numpy as np

from radixkv.cache.events import CacheListener
from radixkv.tokens import TokenSeq, as_token_array  # noqa: F401 - part of the cache interface

# Anything that holds integer token ids: list, tuple, numpy array, torch tensor.


class MatchResult(NamedTuple):
    """What ``match_prefix`` found.

    Attributes:
        length: number of leading tokens that are cached (a multiple of the
            cache's ``page_size``: the tree's page, the hash cache's block).
        indices: 1-D int64 array of the KV slot indices of those tokens,
            ``len(indices) == length``; a fresh array the caller may keep.
        node: opaque handle for ``lock``/``unlock``; the root (an empty
            handle) when nothing matched, never None.
    """

    length: int
    indices: np.ndarray
    node: Any


class CacheHints(NamedTuple):
    """What a request tells the cache about the entries it matches and inserts, for the eviction policy.

    ``priority``: larger is kept longer (the ``priority`` policy evicts lower-priority prefixes first; an entry
    keeps the highest priority of the requests that used it). ``ttl``: seconds to hold the prefix this request
    leaves once it finishes (the ``ttl`` policy; None: the policy's own). ``request``: who asks (any hashable,
    None: anonymous), so that a policy counting reuse counts one per request, not one per lookup (a scheduler
    looks a waiting request up more than once, and re-matches what a running one just inserted).
    ``session`` and ``stream``: the conversation or agent session and its stream (0 the main agent, 1, 2, ...
    its sub-agents) the request belongs to (None: unknown); ``parent``: a sub-agent's parent stream. ``stop``:
    how its answer ended (a ``radixkv.sessions.Finish``: ``tool_use``, ``end_turn``, ...), where known: a trace
    replay knows it when the request is sent, the engine at its finish; ``tool``: the tool it called, where
    known. ``radixkv.sessions.session_hints`` builds them, in the engine and the simulator alike.
    """

    priority: int = 0
    ttl: float | None = None
    request: Hashable = None
    session: Hashable = None
    stream: Hashable = None
    stop: str | None = None
    parent: Hashable = None
    tool: str | None = None


NO_HINTS = CacheHints()


class Evicted(NamedTuple):
    """One entry ``evict`` removed, for a caller that keeps it elsewhere (a tiered cache's write-back): the
    whole prefix through it (``tokens``) and that prefix's slots, the entry's own last (still unreused)."""

    namespace: Hashable
    tokens: np.ndarray
    slots: np.ndarray


@runtime_checkable
class PrefixCache(Protocol):
    """The surface shared by ``RadixCache``, ``HashBlockCache``, ``HashV0Cache`` and ``NoPrefixCache``.

    ``caches_during_decode`` says when a running request's generated tokens join the cache: False, at
    finish (the tree, v1's blocks as radixkv inserts them); True, each time they fill a block while it
    decodes (vLLM v0 promotes a filled block's fake hash to its real one), so a concurrent request can
    already hit them. The engine asks; the simulator inserts at finish, with the same cache afterwards.

    ``held_slots`` (every slot index the cache holds) and ``unlock_all`` (drop every lock, keep every
    entry) let a caller rebuild its books after a failure in the middle of a step (``Scheduler.recover``).

    ``clock`` (seconds; ``time.monotonic`` unless the caller sets another, as the simulator sets its own) is
    what time-aware eviction policies read; ``hints`` (``CacheHints``) carry a request's priority and hold time.

    ``listener`` (None by default, kept across ``reset``) is called with a :mod:`radixkv.cache.events` event
    each time blocks join the cache, leave it, or all go at once; with None the cache builds no event.

    ``page_size``: the slots of one KV page, the granularity of matches and of the caller's allocator.
    ``evict(n, victims, demoted_only)`` also records each removed entry (``Evicted``) and can stop at the
    first entry that was not ``demote``d (ranked first: a lower tier's copy of what a nearer tier holds).
    ``held_length`` says how much of a prefix the cache holds and touches nothing (no recency, hit or statistic).

    Every cache is one with zero or more lower tiers (:mod:`radixkv.cache.tiers`): ``tiers``, ``plan_load`` /
    ``load`` / ``cancel`` (extend a device match from them), ``admitted`` (a request reused a match, for
    write policies that count reuses), ``take_copies`` (the copies made since the last call),
    ``loaded_tokens`` / ``written_tokens`` / ``reset_transfer_counts`` (tokens moved per tier) and ``flush``
    (drop everything no request holds). With no lower tier they load, copy and count nothing. The contract of
    each member: ``docs/cache_semantics.md``.
    """

    caches_during_decode: bool
    listener: CacheListener | None
    page_size: int
    tiers: Sequence[Any]
    loaded_tokens: dict[str, int]
    written_tokens: dict[str, int]

    clock: Callable[[], float]

    def match_prefix(self, tokens: TokenSeq, namespace: Hashable = None, hints: CacheHints = NO_HINTS
                     ) -> MatchResult: ...

    def insert(self, tokens: TokenSeq, indices: TokenSeq, namespace: Hashable = None,
               hints: CacheHints = NO_HINTS) -> int: ...

    def lock(self, node: Any) -> None: ...

    def unlock(self, node: Any) -> None: ...

    def evict(self, num_tokens: int, victims: list[Evicted] | None = None, demoted_only: bool = False
              ) -> np.ndarray: ...

    def demote(self, tokens: TokenSeq, namespace: Hashable = None) -> int: ...

    def held_length(self, tokens: TokenSeq, namespace: Hashable = None) -> int: ...

    def plan_load(self, tokens: TokenSeq, match: MatchResult, namespace: Hashable = None,
                  hints: CacheHints = NO_HINTS) -> Any: ...

    def load(self, plan: Any, slots: np.ndarray) -> MatchResult: ...

    def cancel(self, plan: Any) -> None: ...

    def admitted(self, tokens: TokenSeq, match: MatchResult, namespace: Hashable = None,
                 hints: CacheHints = NO_HINTS) -> None: ...

    def take_copies(self) -> list[Any]: ...

    def reset_transfer_counts(self) -> None: ...

    def flush(self, allocator: Any) -> int: ...

    def cacheable_length(self, num_tokens: int) -> int: ...

    def stats(self) -> dict[str, float]: ...

    @property
    def total_size(self) -> int: ...

    @property
    def evictable_size(self) -> int: ...

    @property
    def protected_size(self) -> int: ...

    def held_slots(self) -> np.ndarray: ...

    def unlock_all(self) -> None: ...

    def check_invariants(self) -> None: ...

    def reset(self) -> None: ...

    def to_dict(self, namespace: Hashable = None) -> dict: ...

    def pretty_print(self) -> str: ...


class CacheBooks:
    """What the caches compute alike from their own books (``total_size``, ``protected_size``, ``page_size``,
    ``_queried_tokens`` and ``_hit_tokens``). O(1) each."""

    @property
    def evictable_size(self) -> int:
        """Tokens ``evict`` could free now: every one no lock protects."""
        return self.total_size - self.protected_size

    def stats(self) -> dict[str, float]:
        """Token-weighted lookup statistics since construction or ``reset``."""
        q, h = self._queried_tokens, self._hit_tokens
        return {"queried_tokens": q, "hit_tokens": h, "hit_rate": h / q if q else 0.0}

    def cacheable_length(self, num_tokens: int) -> int:
        """How many leading tokens of a ``num_tokens`` sequence ``insert`` keeps (whole pages or blocks)."""
        return num_tokens - num_tokens % self.page_size


def positive_size(name: str, value: object) -> int:
    """``value``, a page or block size, as an int; ``ValueError`` unless it is an integer >= 1."""
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    return int(value)


class LockError(RuntimeError, ValueError):
    """Unlocking a handle whose lock count is already zero (or that holds no
    lock of its own), or locking a handle whose node is no longer in the cache. It is a ``RuntimeError`` (a
    misuse of the protocol at run time) and a ``ValueError`` (a bad argument),
    so callers catching either see it."""


def match_for_prefill(cache: PrefixCache, tokens: TokenSeq, namespace: Hashable = None,
                      hints: CacheHints = NO_HINTS) -> MatchResult:
    """Match ``tokens`` as a prompt that is about to be prefilled.

    A request must compute at least one prompt token to get the logits it
    samples from, so the last token is never taken from the cache: the match
    covers at most ``len(tokens) - 1`` tokens, rounded down to the cache's
    page or block. A prompt cached to an exact page multiple therefore
    recomputes its whole last page (vLLM recomputes the whole last block).
    This rule belongs to the caller (scheduler, simulator), not to the cache.
    """
    return cache.match_prefix(tokens[: max(len(tokens) - 1, 0)], namespace, hints)


def all_unique(values: np.ndarray) -> bool:
    """Whether a 1-D array of non-negative int64 slot indices has no repeats. O(n + max) or O(n log n)."""
    if len(values) < 2:
        return True
    lo, hi = int(values.min()), int(values.max())
    if lo >= 0 and hi < 4 * len(values) + 1024:
        return int(np.bincount(values).max()) <= 1  # linear, and the range is small enough
    ordered = np.sort(values)
    return not bool((ordered[1:] == ordered[:-1]).any())
