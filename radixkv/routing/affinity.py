"""``affinity``: radixkv's router. Keep a conversation where its prefix is cached, within a work budget.

How it decides, per request of n tokens:

1. What each replica caches is believed from what the router sent it: a tree per replica holding the
   prompts it was sent and, when they finish, their whole sequences (a multi-turn conversation's next
   prompt extends its previous prompt *and answer*), trimmed least-recently-used to ``capacity_tokens``
   (the replicas' KV budget) so it forgets what a replica has evicted. m_r: the prefix replica r holds.
2. Each replica's work W_r: the prompt tokens it was predicted to compute (n - m_r of every request sent
   there). The request stays with the replica of the longest prefix (``affinity``) unless that replica's
   work, with this request's, would exceed ``1 + slack`` times the mean work after it; then it goes where
   the sum of work and this request's uncached tokens is least (``balance``), and a request that hits
   nowhere does the same (``new``).

With ``host_capacity_tokens`` (the replicas' host tier) the router also believes a second tree per replica
trimmed to device + host capacity: a prompt's prefix beyond m_r found there counts ``host_weight`` times
(it is loaded, not computed), so m_r = device prefix + host_weight x (host prefix - device prefix).

Sessions (``route(..., session=)``, the request's ``CacheHints.session``: an agent session, a conversation):
a session's request goes to the replica its previous request went to (``session``) unless that replica is
**past its cliff**: the contexts of the sessions active there (each session's latest request, those seen in
the last ``session_window`` seconds) exceed its memory, ``capacity_tokens`` plus ``host_capacity_tokens``.
Then, and for a session's first request, the rules above decide. Without ``capacity_tokens`` no replica is
ever past its cliff. Where each session went is the router's sessions book (``radixkv.sessions.Sessions``,
its ``Homes``). The session rule reads the cluster's clock (``now``), the same in the simulator and on
Ray, where the clock is wall seconds.

Keeping cumulative work within the slack of the mean bounds the computed-token imbalance the cluster
reports; sending a miss to the replica with least work spreads conversations so that each replica's cache
sees about 1/N of them, which is how N separate caches approach one pooled cache. The decisions depend
only on the requests in order (no clock, no replica state beyond liveness), so they are the same in the
simulator and on Ray.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Sequence

import numpy as np

from radixkv.checks import checked_number
from radixkv.routing.base import ReplicaView, alive
from radixkv.routing.trees import ReplicaTrees
from radixkv.sessions import Sessions


class Affinity:
    """See the module docstring. O(N x (n memcmp + depth)) per request."""

    name = "affinity"
    follows_sessions = True  # ``route`` takes the request's ``session``

    def __init__(self, capacity_tokens: int | None = None, slack: float = 0.05, host_capacity_tokens: int = 0,
                 host_weight: float = 0.5, session_window: float = 600.0):
        self.capacity_tokens = None if capacity_tokens is None else checked_number(
            capacity_tokens, "capacity_tokens", 1, integer=True)
        self.slack = checked_number(slack, "slack")
        self.host_capacity_tokens = checked_number(host_capacity_tokens, "host_capacity_tokens", integer=True)
        self.host_weight = checked_number(host_weight, "host_weight")
        self.counts: Counter = Counter()
        self._trees = ReplicaTrees(0, self.capacity_tokens)
        # device + host: meaningful only where the device trees forget (a capacity)
        self._host_trees = ReplicaTrees(0, self.capacity_tokens + self.host_capacity_tokens) \
            if self.host_capacity_tokens and self.capacity_tokens else None
        self._work: list[float] = []
        self.session_window = checked_number(session_window, "session_window")
        self.sessions = Sessions(homes_window=self.session_window)  # where each session went, and its context

    def route(self, tokens: np.ndarray, replicas: Sequence[ReplicaView], namespace: Hashable = None,
              now: float = 0.0, session: Hashable = None) -> int:
        up = [r.index for r in alive(replicas)]
        self._work += [0.0] * (len(replicas) - len(self._work))
        matched = self._matched(tokens, namespace, len(replicas))
        n, work = len(tokens), self._work
        kept = self._session_home(session, up, now)
        if kept is not None:
            choice, why = kept, "session"
        else:
            home = max(up, key=lambda i: (matched[i], -work[i], -i))
            mean_after = (sum(work[i] for i in up) + n - matched[home]) / len(up)
            if matched[home] and work[home] + n - matched[home] <= (1 + self.slack) * mean_after:
                choice, why = home, "affinity"
            else:
                choice = min(up, key=lambda i: (work[i] + n - matched[i], i))
                why = "balance" if matched[home] else "new"
        work[choice] += n - matched[choice]
        self._insert(choice, tokens, namespace)
        if session is not None:
            self.sessions.homes.place(session, choice, n, now)
        self.counts[why] += 1
        return choice

    def _session_home(self, session: Hashable, up: list[int], now: float) -> int | None:
        """The replica the session's last request went to, if it is up and not past its cliff; else None."""
        homes = self.sessions.homes
        home = homes.home(session, now)
        if home is None or home not in up:
            return None
        limit = None if self.capacity_tokens is None else self.capacity_tokens + self.host_capacity_tokens
        return home if limit is None or homes.active[home] <= limit else None

    def _matched(self, tokens: np.ndarray, namespace: Hashable, replicas: int) -> list[float]:
        """Each replica's believed prefix of ``tokens``, host-tier tokens weighted by ``host_weight``."""
        self._trees.grow(replicas)
        device = self._trees.match(tokens, namespace)
        if self._host_trees is None:
            return device
        self._host_trees.grow(replicas)
        both = self._host_trees.match(tokens, namespace)
        return [d + self.host_weight * max(0, h - d) for d, h in zip(device, both, strict=True)]

    def _insert(self, replica: int, tokens: np.ndarray, namespace: Hashable) -> None:
        self._trees.insert(replica, tokens, namespace)
        if self._host_trees is not None:
            self._host_trees.insert(replica, tokens, namespace)

    def finished(self, replica: int, tokens: np.ndarray, namespace: Hashable = None) -> None:
        if len(tokens) and replica < len(self._trees):
            self._insert(replica, tokens, namespace)
