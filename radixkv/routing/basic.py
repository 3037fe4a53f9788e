"""Routers that know nothing of caches: ``round_robin``, ``least_load``, and ``prefix_hash``."""

from __future__ import annotations

import bisect
import hashlib
from collections.abc import Hashable, Sequence

import numpy as np

from radixkv.routing.base import ReplicaView, alive


class RoundRobin:
    """Replicas in turn (skipping dead ones): the baseline every production router compares against."""

    name = "round_robin"

    def __init__(self) -> None:
        self._next = 0

    def route(self, tokens: np.ndarray, replicas: Sequence[ReplicaView], namespace: Hashable = None,
              now: float = 0.0) -> int:
        up = {r.index for r in alive(replicas)}
        n = len(replicas)
        # the first live replica from where the last turn stopped
        i = next(k % n for k in range(self._next, self._next + n) if replicas[k % n].index in up)
        self._next = i + 1
        return replicas[i].index

    def finished(self, replica: int, tokens: np.ndarray, namespace: Hashable = None) -> None:
        """Nothing to track: the turn does not depend on which requests finished."""


class LeastLoad:
    """The replica with the fewest outstanding tokens (ties: fewer requests, then the lowest index)."""

    name = "least_load"

    def route(self, tokens: np.ndarray, replicas: Sequence[ReplicaView], namespace: Hashable = None,
              now: float = 0.0) -> int:
        return min(alive(replicas), key=lambda r: (r.outstanding_tokens, r.running + r.waiting, r.index)).index

    def finished(self, replica: int, tokens: np.ndarray, namespace: Hashable = None) -> None:
        """Nothing to track: the load comes with the replicas' views."""


class PrefixHash:
    """Consistent hashing of the first ``prefix_tokens`` tokens, with bounded load.

    Each replica owns ``virtual_nodes`` points on a 64-bit ring; a request goes to the first point after
    the hash of its namespace and first tokens, so one prefix stays on one replica, and adding a replica
    moves only about 1/N of the prefixes. Bounded load (Mirrokni et al., "Consistent Hashing with Bounded
    Loads", as in llm-d and Envoy): a replica whose outstanding tokens exceed ``load_factor`` x the mean
    is passed over for the next point on the ring. O(log(N x virtual_nodes) + N) per request.
    """

    name = "prefix_hash"

    def __init__(self, prefix_tokens: int = 256, virtual_nodes: int = 64, load_factor: float = 1.25):
        if not (isinstance(prefix_tokens, int) and prefix_tokens >= 1 and isinstance(virtual_nodes, int)
                and virtual_nodes >= 1 and load_factor >= 1):
            raise ValueError("prefix_hash needs prefix_tokens >= 1, virtual_nodes >= 1 and load_factor >= 1, got "
                             f"{prefix_tokens!r}, {virtual_nodes!r}, {load_factor!r}")
        self.prefix_tokens, self.virtual_nodes, self.load_factor = prefix_tokens, virtual_nodes, float(load_factor)
        self._ring: list[tuple[int, int]] = []
        self._members: tuple[int, ...] = ()

    def route(self, tokens: np.ndarray, replicas: Sequence[ReplicaView], namespace: Hashable = None,
              now: float = 0.0) -> int:
        up = alive(replicas)
        members = tuple(sorted(r.index for r in replicas))
        if members != self._members:  # the ring depends on the members only
            self._members = members
            self._ring = sorted((_h(f"replica-{m}-{v}".encode()), m) for m in members
                                for v in range(self.virtual_nodes))
        load = {r.index: r.outstanding_tokens for r in up}
        cap = self.load_factor * max(1.0, (sum(load.values()) + 1) / len(up))
        head = np.asarray(tokens, dtype=np.int64)[: self.prefix_tokens].tobytes()
        start = bisect.bisect(self._ring, (_h(repr(namespace).encode() + b"|" + head), -1))
        for _, replica in self._ring[start:] + self._ring[:start]:
            if replica in load and load[replica] + 1 <= cap:
                return replica
        return min(load, key=lambda i: (load[i], i))  # everyone over the bound: the least loaded

    def finished(self, replica: int, tokens: np.ndarray, namespace: Hashable = None) -> None:
        """Nothing to track: the ring depends on the members only, the load comes with the views."""


def _h(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")
