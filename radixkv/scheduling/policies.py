"""Cache-aware admission policies: in what order waiting requests are admitted.

Shared by the simulator and the engine. A policy sees the waiting requests,
each with the match the cache currently gives it, and returns them in the
order they should be admitted; the caller admits from the front while memory
and batch limits allow.

* ``fcfs``: arrival order.
* ``lpm``: longest cached prefix first (SGLang), ties by arrival.
* ``dfs-weight``: SGLang's depth-first order: group waiting requests by the
  tree node their match ended at, weigh every node by the waiting requests in
  its subtree, and visit the tree depth-first, heavier children first, each
  node's own requests after its subtree's.
* ``random``: a seeded shuffle.
* ``session`` and ``session-oracle`` (``radixkv.scheduling.session``), ``continuum``
  (``radixkv.scheduling.continuum``: Continuum's program-level FCFS and tool-call TTL) and ``infercept``
  (``radixkv.scheduling.infercept``: InferCept's preserve, discard or swap per tool call): agent sessions.

``InBatchPrefixSharing`` wraps any policy: of several waiting requests that
share an uncached prefix of at least ``threshold`` tokens, only the first is
offered this round; the others wait for a later round, when they hit the
cache that the first one filled (SGLang's in-batch prefix caching). Under
chunked prefill a prompt takes several rounds, so it also holds back waiting
requests that share at least ``threshold`` tokens past their cached prefix
with a prompt still being prefilled (``in_flight``), until its chunks have
cached all but fewer than ``threshold`` of them.

A policy's ``order`` may therefore leave requests out: those wait.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from radixkv.cache.base import MatchResult
from radixkv.cache.radix import RadixCache
from radixkv.scheduling.continuum import Continuum
from radixkv.scheduling.infercept import InferCept
from radixkv.scheduling.session import SessionAware, SessionOracle


@dataclass
class Candidate:
    """A waiting request as a policy sees it.

    ``tokens`` are the tokens it will match (its prompt), ``match`` the
    cache's current answer for them, ``order`` its arrival rank (ties).
    """

    request: Any
    tokens: np.ndarray
    match: MatchResult
    order: int
    namespace: Hashable = None


class SchedulePolicy(Protocol):
    """``needs_match``: the caller fills each candidate's ``match``. ``sees_in_flight``: ``order`` also takes
    ``in_flight``, the running requests whose prompts are not all computed yet. ``follows_sessions``: the
    scheduler also calls ``attach(scheduler)`` once, ``added(state)`` as each request is queued and
    ``finished(state, tokens)`` as each finishes (``radixkv.scheduling.session``)."""

    name: str
    needs_match: bool
    sees_in_flight: bool
    follows_sessions: bool

    def order(self, waiting: Sequence[Candidate]) -> list[Candidate]: ...


class FCFS:
    """Arrival order. O(n log n)."""

    name, needs_match, sees_in_flight, follows_sessions = "fcfs", False, False, False

    def order(self, waiting: Sequence[Candidate]) -> list[Candidate]:
        return sorted(waiting, key=lambda c: c.order)


class LongestPrefixMatch:
    """Longest cached prefix first, ties by arrival. O(n log n)."""

    name, needs_match, sees_in_flight, follows_sessions = "lpm", True, False, False

    def order(self, waiting: Sequence[Candidate]) -> list[Candidate]:
        return sorted(waiting, key=lambda c: (-c.match.length, c.order))


class DFSWeight:
    """SGLang's depth-first-weight order over the radix tree. O(n + visited nodes).

    Needs match handles with ``parent`` links (a ``RadixCache``); for other
    caches it falls back to longest-prefix order, which it equals on a chain.
    """

    name, needs_match, sees_in_flight, follows_sessions = "dfs-weight", True, False, False

    def order(self, waiting: Sequence[Candidate]) -> list[Candidate]:
        if not waiting or not all(hasattr(c.match.node, "parent") for c in waiting):
            return LongestPrefixMatch().order(waiting)
        at_node: dict[int, list[Candidate]] = {}
        children: dict[int, list[Any]] = {}
        weight: dict[int, int] = {}
        roots: list[Any] = []
        for c in sorted(waiting, key=lambda c: c.order):
            node = c.match.node
            at_node.setdefault(id(node), []).append(c)
            while node is not None:  # add 1 to the weight of every node up to the root, linking new ones
                if id(node) not in weight:
                    (roots if node.parent is None else children.setdefault(id(node.parent), [])).append(node)
                weight[id(node)] = weight.get(id(node), 0) + 1
                node = node.parent
        # Post-order, heavier subtrees first: a node's own requests come after its subtree's,
        # so the requests that share the most cached tokens run first (SGLang's order).
        out: list[Candidate] = []
        stack = [(n, False) for n in sorted(roots, key=lambda n: weight[id(n)])]
        while stack:
            node, expanded = stack.pop()
            if expanded:
                out.extend(at_node.get(id(node), ()))
                continue
            # the node again after its children, which are popped heaviest first
            stack.append((node, True))
            stack.extend((k, False) for k in sorted(children.get(id(node), []), key=lambda n: weight[id(n)]))
        return out


class RandomOrder:
    """A seeded random permutation. O(n)."""

    name, needs_match, sees_in_flight, follows_sessions = "random", False, False, False

    def __init__(self, seed: int = 0):
        self.rng = np.random.default_rng(seed)

    def order(self, waiting: Sequence[Candidate]) -> list[Candidate]:
        ranked = sorted(waiting, key=lambda c: c.order)
        return [ranked[i] for i in self.rng.permutation(len(ranked))]


class InBatchPrefixSharing:
    """Hold back waiting requests whose uncached prefix another request will compute.

    Walks the inner policy's order. A request is left out of this round if
    it shares at least ``threshold`` tokens past its cached prefix with a
    prompt of ``in_flight`` (running, not all computed: its chunks will cache
    them). Otherwise, one whose cached prefix is shorter than ``threshold`` is
    looked up in a scratch radix tree of the prompts offered so far in this
    round; if it shares at least ``threshold`` tokens with one of them it is
    left out, otherwise its prompt joins the scratch tree. The scratch trees
    have the cache's page size, so a prefix shared below one page (which the
    cache could not hold) holds nothing back. The first waiting request of
    every group is always offered unless a running prefill holds it, so the
    queue never stalls. O(total prompt tokens) memcmp work per round.
    """

    needs_match, sees_in_flight = True, True

    def __init__(self, inner: SchedulePolicy, threshold: int = 32, page_size: int = 1):
        if threshold < 1 or page_size < 1:
            raise ValueError(f"in-batch sharing needs threshold, page_size >= 1, got {threshold}, {page_size}")
        self.inner, self.threshold = inner, threshold
        self.follows_sessions = getattr(inner, "follows_sessions", False)
        if self.follows_sessions:  # what the scheduler tells the inner policy goes straight to it
            self.attach, self.added, self.finished = inner.attach, inner.added, inner.finished
        self.page_size = page_size  # the cache's page / block: sharing below it can never be a hit
        self.name = f"{inner.name}+in-batch-sharing"

    def order(self, waiting: Sequence[Candidate], in_flight: Sequence[Candidate] = ()) -> list[Candidate]:
        scratch, flight = RadixCache(self.page_size), RadixCache(self.page_size)
        slot = 0

        def add(tree: RadixCache, c: Candidate) -> None:  # a prompt with slots no other holds
            nonlocal slot
            tree.insert(c.tokens, np.arange(slot, slot + len(c.tokens)), c.namespace)
            slot += len(c.tokens)

        for c in in_flight:
            add(flight, c)
        offered, inner = [], self.inner.order(waiting)
        self.inner_offered = {id(c.request) for c in inner}  # what it holds back may borrow slots; the rest waits
        for c in inner:
            # [:-1] as match_for_prefill: the last prompt token is always computed, so it is never a hit to wait for
            if in_flight and flight.match_prefix(c.tokens[:-1], c.namespace).length - c.match.length >= self.threshold:
                continue  # a running prefill is computing what this one would recompute
            if c.match.length >= self.threshold:
                offered.append(c)
            elif scratch.match_prefix(c.tokens, c.namespace).length < self.threshold:
                offered.append(c)
                add(scratch, c)
        return offered


def admission_order(policy: SchedulePolicy, waiting: Sequence[Candidate],
                    in_flight: Sequence[Candidate] = ()) -> list[Candidate]:
    """``policy.order(waiting)``, passing ``in_flight`` (the running prefills) to a policy that ``sees_in_flight``:
    the one call the engine and the simulator make, so they rank alike."""
    return policy.order(waiting, in_flight) if policy.sees_in_flight else policy.order(waiting)


# the last knows the future
POLICIES = ("fcfs", "lpm", "dfs-weight", "random", "session", "continuum", "infercept", "session-oracle")


def make_policy(name: str, seed: int = 0, in_batch_sharing: int | None = None, page_size: int = 1) -> SchedulePolicy:
    """A policy by name; ``in_batch_sharing`` (a token threshold) wraps it in ``InBatchPrefixSharing``
    at the cache's ``page_size`` (shared tokens are counted in whole pages, as the cache will hold them).

    Unknown names raise ``ValueError``.
    """
    makers = {"fcfs": FCFS, "lpm": LongestPrefixMatch, "dfs-weight": DFSWeight, "random": lambda: RandomOrder(seed),
              "session": SessionAware, "continuum": Continuum, "infercept": InferCept,
              "session-oracle": SessionOracle}
    if name not in makers:
        raise ValueError(f"unknown schedule policy {name!r}; choose one of {list(POLICIES)}")
    policy = makers[name]()
    return InBatchPrefixSharing(policy, in_batch_sharing, page_size) if in_batch_sharing else policy
