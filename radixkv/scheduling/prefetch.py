"""KVFlow's prefetch for agent sessions: load a session's context back from the lower tiers before its next
request is predicted to come.

A request of a session that finishes with a tool call (``Finish.TOOL_CALL``) or the end of its turn
(``END_TURN``) leaves its context (the sequence it cached), and its stream is awaited (``radixkv.sessions``,
the scheduler's book). ``Prefetcher`` predicts the pause as the book's expected return
(``Pauses.expected``: the geometric mean of the pauses seen after the same kind of finish, from the same
kind of stream, the main agent or a sub-agent, and for a tool call the same tool where its pauses were
seen), learned online from each stream's return (none is predicted before one was seen: no prior is fitted
to any trace). The geometric mean, because the pauses spread over orders of magnitude (a tool runs for
seconds, a human answers in minutes or hours): it sits near their median, where an arithmetic mean sits
near the longest. ``lead(tokens)`` seconds before the
predicted return (the cost model's time to load the whole context from the host tier: KVFlow's prefetch
priced by the bandwidth it uses), the context is *due*, and ``Scheduler.prefetch`` loads what the lower
tiers hold of it past the device's match back to the device.

Soft, like every hint: the scheduler prefetches only while no request waits and only into free device
slots (a prefetch evicts nothing), looks nothing up unless the device lacks part of the context and has the
free slots for all of it, and what it loads is an ordinary unlocked cache entry (ranked as just used: the
prefetch's bet that its session comes back first) that any admission may evict again. A session that came
back before its prefetch loads what it needs itself; a context still not loaded a predicted pause after it
fell due (the scheduler was busy all along) is dropped. A context's tokens are kept (on the book's entry) only from a
finish whose pause can be predicted until its prefetch is due. Contexts are per replica: a router that does
not keep sessions on one sends their returns elsewhere. O(log n) per finish and due context.

Args:
    lead: seconds to load a context of that many tokens (None: 0, prefetch at the predicted return).
    sessions: the book it reads (the scheduler's; None: a book of its own, for a caller that tells it).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Hashable
from typing import Any

import numpy as np

from radixkv.cache.base import CacheHints
from radixkv.sessions import Awaited, PauseKey, Sessions, stream_key


class Prefetcher:
    """See the module doc."""

    def __init__(self, lead: Callable[[int], float] | None = None, sessions: Sessions | None = None):
        self.lead = lead or (lambda tokens: 0.0)
        self.sessions = sessions if sessions is not None else Sessions()
        self.reset()

    def reset(self) -> None:
        self._due: list[tuple[float, int, Hashable]] = []  # (when due, tie, stream key), stale items skipped
        self._tie = 0
        self.prefetched = 0  # contexts handed out as due

    def predicted_pause(self, kind: PauseKey) -> float | None:
        """The pause expected after a finish of this kind (sub-agent?, finish, tool), seconds; None before any
        was seen."""
        return self.sessions.pauses.expected(kind)

    def finished(self, awaited: Awaited, tokens: np.ndarray, namespace: Hashable) -> None:
        """A stream the book now awaits (``Sessions.finished``'s entry) left ``tokens`` cached: due for a
        prefetch where its pause can be predicted. O(log n)."""
        pause = self.predicted_pause(awaited.kind)
        if pause is None:  # nothing to predict from yet: the book learns this pause when the stream is back
            return
        self._tie += 1
        due = awaited.finished + pause - self.lead(len(tokens))
        awaited.tokens, awaited.namespace, awaited.tie, awaited.stale = tokens, namespace, self._tie, due + pause
        heapq.heappush(self._due, (due, self._tie, stream_key(awaited.hints)))

    def next_due(self) -> float:
        """When the next context is due (``math.inf``: none). O(log n) amortized (stale items dropped)."""
        while self._due and not self._current(self._due[0]):
            heapq.heappop(self._due)
        return self._due[0][0] if self._due else math.inf

    def due(self, now: float) -> list[tuple[np.ndarray, Hashable, CacheHints]]:
        """The contexts due by ``now`` (tokens, namespace, the finished request's hints), earliest first, each
        handed out once (its tokens kept no longer); one a predicted pause past its due time (the scheduler
        was busy all along) is dropped instead: its session is as likely back, or gone, as anything. O(k log n)
        for k due."""
        out = []
        while self.next_due() <= now:
            entry = self.sessions.awaited[heapq.heappop(self._due)[2]]
            if now <= entry.stale:
                out.append((entry.tokens, entry.namespace, entry.hints))
                self.prefetched += 1
            entry.tokens = None
        return out

    def _current(self, item: tuple[float, int, Hashable]) -> bool:
        """Whether a heap item is its stream's awaited context, not yet handed out."""
        entry = self.sessions.awaited.get(item[2])
        return entry is not None and entry.back is None and entry.tokens is not None and entry.tie == item[1]

    def describe(self) -> dict[str, Any]:
        """What it learned: the predicted pause per kind of finish, and contexts handed out."""
        return {"prefetched": self.prefetched, **{
            f"pause_{finish.value}_{'sub' if sub else 'main'}" + (f"_{tool}" if tool else ""): self.predicted_pause(
                (sub, finish, tool)) for sub, finish, tool in self.sessions.pauses.kinds()}}
