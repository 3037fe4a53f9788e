"""Routers that model what each replica caches: ``cache_aware`` (SGLang), ``kv_events`` (Dynamo), ``preble``.

Each follows the published design of the system it is named after, with its defaults; where a system
measures load with something a router here cannot see, the docstring says what stands in for it.
"""

from __future__ import annotations

import heapq
from collections import Counter, deque
from collections.abc import Hashable, Sequence
from typing import Any

import numpy as np

from radixkv.checks import checked_number
from radixkv.routing.base import ReplicaView, alive
from radixkv.routing.kv_index import KVEventIndex
from radixkv.routing.trees import ReplicaTrees


class CacheAware:
    """SGLang's router (``sgl-router``, policy ``cache_aware``), its defaults as of sglang-router 0.2.

    Per request: if the load is imbalanced, ``max - min > balance_abs_threshold`` and
    ``max > min * balance_rel_threshold`` (load: the requests the router sent to a replica and that have not
    finished), it goes to the least loaded replica. Otherwise it goes to the replica whose approximate tree
    (the prompts the router sent there) shares the longest prefix with it, if that covers more than
    ``cache_threshold`` of the prompt, else to the replica with the smallest tree. The prompt then joins
    the chosen replica's tree. Every ``eviction_interval_secs`` each tree is trimmed to ``max_tree_size``
    (least recently used leaves first). SGLang's tree holds characters; this one holds tokens.
    """

    name = "cache_aware"

    def __init__(self, cache_threshold: float = 0.3, balance_abs_threshold: int = 64,
                 balance_rel_threshold: float = 1.5, eviction_interval_secs: float = 120.0,
                 max_tree_size: int = 2 ** 26):
        self.cache_threshold = checked_number(cache_threshold, "cache_threshold")
        self.balance_abs_threshold = checked_number(balance_abs_threshold, "balance_abs_threshold", integer=True)
        self.balance_rel_threshold = checked_number(balance_rel_threshold, "balance_rel_threshold", 1.0)
        self.eviction_interval_secs = checked_number(eviction_interval_secs, "eviction_interval_secs")
        self.max_tree_size = checked_number(max_tree_size, "max_tree_size", 1, integer=True)
        self.counts: Counter = Counter()
        self._trees = ReplicaTrees(0)
        self._last_trim = 0.0

    def route(self, tokens: np.ndarray, replicas: Sequence[ReplicaView], namespace: Hashable = None,
              now: float = 0.0) -> int:
        up = alive(replicas)
        self._trees.grow(len(replicas))
        if now - self._last_trim >= self.eviction_interval_secs:
            self._last_trim = now
            for i in range(len(self._trees)):
                self._trees.trim(i, self.max_tree_size)
        load = {r.index: r.running + r.waiting for r in up}
        hi, lo = max(load.values()), min(load.values())
        if hi - lo > self.balance_abs_threshold and hi > lo * self.balance_rel_threshold:
            choice, why = min(load, key=lambda i: (load[i], i)), "balance"
        else:
            matched = self._trees.match(tokens, namespace)
            best = max(load, key=lambda i: (matched[i], -i))
            if len(tokens) and matched[best] / len(tokens) > self.cache_threshold:
                choice, why = best, "cache_hit"
            else:
                sizes = self._trees.sizes()
                choice, why = min(load, key=lambda i: (sizes[i], i)), "smallest_tree"
        self._trees.insert(choice, tokens, namespace)
        self.counts[why] += 1
        return choice

    def finished(self, replica: int, tokens: np.ndarray, namespace: Hashable = None) -> None:
        """Nothing to track: a tree holds the prompts routed (answers are not added), the load comes with the views."""


class KVEvents:
    """NVIDIA Dynamo's KV router: an exact index of every replica's cache, built only from its KV events.

    The index sees an event ``event_delay`` seconds after the replica emitted it (0: at once). Cost of a
    replica, in blocks of ``block_size`` tokens (Dynamo's, from its router guide):
    ``overlap_score_weight x prefill_blocks + decode_blocks``, where prefill_blocks = (the replica's active
    tokens + the prompt's tokens not in its cache) / block_size and decode_blocks = (active tokens + the
    prompt) / block_size. Active tokens: what the router sent there and is not finished (prompt + tokens to
    generate). ``temperature`` 0 picks the cheapest replica (ties: lowest index); above 0 it samples from a
    softmax of the negated costs, normalized by the largest, with a generator seeded by ``seed``.

    Replicas with a host tier publish its blocks too (events with ``medium="CPU"``, in a second index): a
    prompt's host overlap beyond its device overlap counts ``host_overlap_weight`` times a device block
    (loading it is cheaper than computing it, dearer than finding it on the device).
    """

    name = "kv_events"

    def __init__(self, block_size: int = 16, overlap_score_weight: float = 1.0, temperature: float = 0.0,
                 event_delay: float = 0.0, seed: int = 0, host_overlap_weight: float = 0.5):
        self.block_size = checked_number(block_size, "block_size", 1, integer=True)
        self.host_overlap_weight = checked_number(host_overlap_weight, "host_overlap_weight")
        self.overlap_score_weight = checked_number(overlap_score_weight, "overlap_score_weight")
        self.temperature = checked_number(temperature, "temperature")
        self.event_delay = checked_number(event_delay, "event_delay")
        self.seed = checked_number(seed, "seed", integer=True)
        self.index = KVEventIndex(block_size)
        self.host_index = KVEventIndex(block_size)  # the host tiers' blocks
        self.counts: Counter = Counter()
        self._rng = np.random.default_rng(seed)
        self._pending: list[tuple[float, int, int, Any]] = []  # (due, order, replica, event)
        self._order = 0

    def observe(self, replica: int, event: Any, time: float) -> None:
        self._order += 1
        heapq.heappush(self._pending, (time + self.event_delay, self._order, replica, event))

    def route(self, tokens: np.ndarray, replicas: Sequence[ReplicaView], namespace: Hashable = None,
              now: float = 0.0) -> int:
        while self._pending and self._pending[0][0] <= now:
            _, _, replica, event = heapq.heappop(self._pending)
            medium = getattr(event, "medium", None)  # AllBlocksCleared names none: a reset empties both
            for index in ((self.index,) if medium == "GPU" else (self.host_index,) if medium else
                          (self.index, self.host_index)):
                index.apply(replica, event)
        up = alive(replicas)
        overlap = self.index.match(tokens, namespace)
        for r, m in self.host_index.match(tokens, namespace).items():
            overlap[r] = overlap.get(r, 0) + self.host_overlap_weight * max(0, m - overlap.get(r, 0))
        n, b = len(tokens), self.block_size
        cost = np.array([self.overlap_score_weight * (r.outstanding_tokens + n - overlap.get(r.index, 0)) / b
                         + (r.outstanding_tokens + n) / b for r in up])
        if self.temperature > 0 and len(up) > 1:
            z = -cost / max(float(cost.max()), 1e-9) / self.temperature
            p = np.exp(z - z.max())
            pick = int(self._rng.choice(len(up), p=p / p.sum()))
        else:
            pick = int(np.argmin(cost))
        self.counts["cache_hit" if overlap.get(up[pick].index, 0) else "no_hit"] += 1
        return up[pick].index

    def finished(self, replica: int, tokens: np.ndarray, namespace: Hashable = None) -> None:
        """Nothing to track: what a replica caches comes with its events, its active tokens with the views."""


class Preble:
    """Preble's E2 scheduler (Srivatsa et al., ICLR'25): exploit or explore, per request.

    Exploit: when the longest prefix some replica is believed to cache is longer than the rest of the
    prompt, go there (ties: the lower load). Explore: otherwise, the replica with the lowest load cost:
    the tokens it computed for requests routed in the last ``window_secs`` (Preble's history window), plus
    this request's uncached prompt there. What a replica caches is the router's tree of the prompts it sent
    (Preble's global radix tree, unbounded). Preble's post-assignment rebalancing and prefix autoscaling
    are not modelled.
    """

    name = "preble"

    def __init__(self, window_secs: float = 180.0):
        self.window_secs = checked_number(window_secs, "window_secs")
        self.counts: Counter = Counter()
        self._trees = ReplicaTrees(0)
        self._recent: deque[tuple[float, int, float]] = deque()  # (time, replica, tokens of work)
        self._load: dict[int, float] = {}

    def route(self, tokens: np.ndarray, replicas: Sequence[ReplicaView], namespace: Hashable = None,
              now: float = 0.0) -> int:
        up = alive(replicas)
        self._trees.grow(len(replicas))
        while self._recent and self._recent[0][0] < now - self.window_secs:
            _, r, work = self._recent.popleft()
            self._load[r] -= work
        matched = self._trees.match(tokens, namespace)
        n = len(tokens)
        best = max(up, key=lambda r: (matched[r.index], -self._load.get(r.index, 0.0), -r.index)).index
        if matched[best] > n - matched[best]:
            choice, why = best, "exploit"
        else:
            choice = min(up, key=lambda r: (self._load.get(r.index, 0.0) + n - matched[r.index], r.index)).index
            why = "explore"
        work = n - matched[choice]
        self._recent.append((now, choice, work))
        self._load[choice] = self._load.get(choice, 0.0) + work
        self._trees.insert(choice, tokens, namespace)
        self.counts[why] += 1
        return choice

    def finished(self, replica: int, tokens: np.ndarray, namespace: Hashable = None) -> None:
        """Nothing to track: the load window and the trees are updated when a request is routed."""
