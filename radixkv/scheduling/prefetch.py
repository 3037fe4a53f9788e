"""KVFlow's prefetch for agent sessions: load a session's context back from the lower tiers before its next
request is predicted to come.

A request of a session that finishes with a tool call (``CacheHints.stop == "tool_use"``) or the end of its
turn (``end_turn``) leaves its context (the sequence it cached), and its session is expected back after a
pause. ``Prefetcher`` predicts that pause as the geometric mean of the pauses it saw after the same kind of
finish from the same kind of stream (the main agent, a sub-agent), learned online from each session's return
(none is predicted before one was seen: no prior is fitted to any trace). The geometric mean, because the
pauses spread over orders of magnitude (a tool runs for seconds, a human answers in minutes or hours): it
sits near their median, where an arithmetic mean sits near the longest. ``lead(tokens)`` seconds before the
predicted return (the cost model's time to load the whole context from the host tier: KVFlow's prefetch
priced by the bandwidth it uses), the context is *due*, and ``Scheduler.prefetch`` loads what the lower
tiers hold of it past the device's match back to the device.

Soft, like every hint: the scheduler prefetches only while no request waits and only into free device
slots (a prefetch evicts nothing), looks nothing up unless the device lacks part of the context and has the
free slots for all of it, and what it loads is an ordinary unlocked cache entry (ranked as just used: the
prefetch's bet that its session comes back first) that any admission may evict again. A session that came
back before its prefetch loads what it needs itself; a context still not loaded a predicted pause after it
fell due (the scheduler was busy all along) is dropped. A context's tokens are kept here only from a finish
whose pause can be predicted until its prefetch is due (otherwise only when and how it finished, to learn
the pause). Contexts are per replica: a router that does not keep sessions on one sends their returns
elsewhere. O(log n) per finish, return and due context.

Args:
    lead: seconds to load a context of that many tokens (None: 0, prefetch at the predicted return).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Hashable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from radixkv.cache.base import CacheHints
from radixkv.cache.eviction.session import END_TURN, TOOL_USE, bound_pending

PREDICTED = (TOOL_USE, END_TURN)  # the finishes after which a session is expected back


@dataclass
class Context:
    """What a finished request of a stream left: its cached ``tokens`` (None when no pause of its kind was seen
    yet, and once its prefetch was due), their ``namespace``, its ``hints``, when it finished, the kind of
    pause that follows (stop, sub-agent?), which item of the due heap is its own (``tie``; 0: none) and when
    a prefetch stops being worth it (``stale``: a predicted pause past its due time)."""

    tokens: np.ndarray | None
    namespace: Hashable
    hints: CacheHints
    finished: float
    kind: tuple[str, bool]
    tie: int = 0
    stale: float = math.inf


class Prefetcher:
    """See the module doc."""

    def __init__(self, lead: Callable[[int], float] | None = None):
        self.lead = lead or (lambda tokens: 0.0)
        self.reset()

    def reset(self) -> None:
        self.pauses: dict[tuple[str, bool], list[float]] = {}  # kind -> [sum of log pauses, how many]
        self.pending: dict[Hashable, Context] = {}  # (session, stream) -> the context its last finish left
        self._due: list[tuple[float, int, Hashable]] = []  # (when due, tie, stream key), stale items skipped
        self._tie = 0
        self.prefetched = 0  # contexts handed out as due

    def predicted_pause(self, kind: tuple[str, bool]) -> float | None:
        """The pause expected after a finish of this kind (stop, sub-agent?): the geometric mean of those
        seen, seconds; None before any was seen."""
        total = self.pauses.get(kind)
        return None if total is None else math.exp(total[0] / total[1])

    def finished(self, tokens: np.ndarray, namespace: Hashable, hints: CacheHints, now: float) -> None:
        """A request of ``hints.session`` (its stream ``hints.stream``) finished leaving ``tokens`` cached;
        ``hints.stop`` says how. O(log n)."""
        if hints.session is None:
            return
        key = (hints.session, hints.stream)
        if hints.stop not in PREDICTED:
            self.pending.pop(key, None)  # nothing says when, or whether, it comes back
            return
        bound_pending(self.pending, lambda context: context.finished)
        kind = (hints.stop, bool(hints.stream))
        pause = self.predicted_pause(kind)
        context = self.pending[key] = Context(None, namespace, hints, now, kind)  # kept to learn its pause
        if pause is not None:  # the tokens only where a prefetch will come
            self._tie += 1
            due = now + pause - self.lead(len(tokens))
            context.tokens, context.tie, context.stale = tokens, self._tie, due + pause
            heapq.heappush(self._due, (due, self._tie, key))

    def returned(self, hints: CacheHints, now: float) -> None:
        """A request of ``hints.session`` (stream ``hints.stream``) arrived: the pause since that stream's last
        finish is learned, and its context is no longer due. O(1)."""
        context = self.pending.pop((hints.session, hints.stream), None) if hints.session is not None else None
        if context is not None:
            total = self.pauses.setdefault(context.kind, [0.0, 0])
            total[0] += math.log(max(now - context.finished, 1e-3))  # a return at once counts as a millisecond
            total[1] += 1

    def next_due(self) -> float:
        """When the next context is due (``math.inf``: none). O(log n) amortized (stale items dropped)."""
        while self._due and not self._current(self._due[0]):
            heapq.heappop(self._due)
        return self._due[0][0] if self._due else math.inf

    def due(self, now: float) -> list[Context]:
        """The contexts due by ``now``, earliest first, each handed out once (its tokens kept no longer here);
        one a predicted pause past its due time (the scheduler was busy all along) is dropped instead: its
        session is as likely back, or gone, as anything. O(k log n) for k due."""
        out = []
        while self.next_due() <= now:
            context = self.pending[heapq.heappop(self._due)[2]]
            if now <= context.stale:
                out.append(replace(context))
                self.prefetched += 1
            context.tokens = None
        return out

    def _current(self, item: tuple[float, int, Hashable]) -> bool:
        """Whether a heap item is its stream's pending context, not yet handed out."""
        context = self.pending.get(item[2])
        return context is not None and context.tokens is not None and context.tie == item[1]

    def describe(self) -> dict[str, Any]:
        """What it learned: the predicted pause per kind of finish, and contexts handed out."""
        return {"prefetched": self.prefetched, **{f"pause_{stop}_{'sub' if sub else 'main'}": self.predicted_pause(
            (stop, sub)) for stop, sub in self.pauses}}
