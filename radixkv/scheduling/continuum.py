"""``continuum``: Continuum's tool-call time-to-live and program-level FCFS (Li et al., "Continuum: Efficient
and Robust Multi-Turn LLM Agent Scheduling with KV Cache Time-to-Live", arXiv 2511.02230), as the paper
states them, on this scheduler.

The paper's two rules:

* **A time-to-live per tool call.** When a request's answer ends in a tool call, the program's KV cache is
  pinned on the device for a TTL ``tau``, chosen by cost and benefit over the tool's duration distribution:
  pinning pays when the tool comes back within ``tau`` (the program then skips the reload, or the recompute,
  of its context and the queueing it would face re-entering), and costs the memory it holds meanwhile, which
  others wait for. When the TTL expires the pin lapses and the context is evicted like any other.
* **Program-level FCFS.** Waiting requests are ordered by their program's (session's) first arrival, not
  their own, so a program that came first keeps its turn across its tool calls.

This module's reading of the cost-benefit rule, with every term in seconds of waiting:

    U(tau) = F(tau) * (R + Q) - M * E[min(D, tau)]

* ``D``: the tool's duration, its distribution the latest pauses the scheduler's sessions book has seen
  after the same tool from the same kind of stream (``radixkv.sessions.Pauses``, learned online); ``F``
  its empirical CDF;
* ``R``: the seconds to recompute the context, ``reload_per_token`` x its tokens;
* ``Q``: the queueing an evicted program would face: the mean time the requests waiting now have waited;
* ``M``: what holding the context costs others each second: the share of the device it holds times the
  requests waiting for memory (each is delayed about that share of a second per second held).

``tau*`` maximizes ``U`` over 0 and the observed durations (``continuum_ttl``, O(window)); no pin where every
``U`` is at most 0; ``hold`` seconds before any duration of that kind was seen (the paper's cold start).
The schedule policy computes ``tau*`` at each tool-call finish and records it on the book's entry
(``Awaited.pin``), which the ``continuum`` eviction policy pins the path for
(``radixkv.cache.eviction.continuum``); admission counts pinned contexts as taken, as the running requests'
are. Pins are soft here, as every hold in this engine: a pin never keeps an admission from memory once
nothing else is left to evict (the paper's pins are hard until the TTL). O(waiting log waiting + window)
per ranking and finish.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import numpy as np

from radixkv.scheduling.session import SessionAware, program_of
from radixkv.sessions import Awaited, Finish, stream_key

RELOAD_PER_TOKEN = 3.57e-5  # seconds to prefill a token: the llama3-70b-8xh100 preset's (radixkv.cost)


def continuum_ttl(durations: Sequence[float], benefit: float, memory: float) -> float:
    """``tau*``: the TTL that maximizes ``F(tau) * benefit - memory * E[min(D, tau)]`` over 0 and the
    ``durations`` seen (sorted or not); 0 where no pin pays. O(n log n).

    >>> continuum_ttl([1.0, 2.0, 100.0], benefit=10.0, memory=0.0)  # holding is free: cover every return
    100.0
    >>> continuum_ttl([1.0, 2.0, 100.0], benefit=10.0, memory=1.0)  # the long one is not worth 98 s more
    2.0
    >>> continuum_ttl([5.0], benefit=1.0, memory=1.0)
    0.0
    """
    d = np.sort(np.asarray(durations, dtype=np.float64))
    n = len(d)
    if n == 0 or benefit <= 0:
        return 0.0
    k = np.arange(1, n + 1)
    # E[min(D, d_k)] = (sum of the k shortest + (n - k) d_k) / n;  F(d_k) = k / n
    expected_hold = (np.cumsum(d) + (n - k) * d) / n
    utility = k / n * benefit - memory * expected_hold
    best = int(np.argmax(utility))
    return float(d[best]) if utility[best] > 0 else 0.0


class Continuum(SessionAware):
    """See the module doc. ``reload_per_token``: seconds to recompute a context token (> 0; default the
    llama3-70b-8xh100 preset's prefill); ``hold``: the TTL before any duration of a tool's kind was seen
    (default 10 s); ``max_wait``: the bounded wait ``session`` has (default 3,600 s)."""

    name, follows_sessions = "continuum", True

    def __init__(self, reload_per_token: float = RELOAD_PER_TOKEN, hold: float = 10.0, max_wait: float = 3600.0):
        super().__init__(max_wait=max_wait, hold=hold)
        if not isinstance(reload_per_token, int | float) or not reload_per_token > 0:
            raise ValueError(f"continuum policy: reload_per_token must be a number > 0, got {reload_per_token!r}")
        self.reload_per_token = float(reload_per_token)

    def finished(self, state: Any, length: int) -> None:
        """A request finished: after a tool call, its stream's TTL by the cost-benefit rule, on the book."""
        super().finished(state, length)
        key = stream_key(state.hints)
        entry = self.sessions.awaited.get(key) if key is not None else None
        if entry is not None and state.hints.stop == Finish.TOOL_CALL:
            entry.pin = self.ttl(entry, length)

    def ttl(self, entry: Awaited, length: int) -> float:
        """The TTL for a context of ``length`` tokens left by this finish, from the scheduler's state now."""
        window = self.sessions.pauses.window(entry.kind)
        if not window:
            return self.hold
        scheduler, now = self.scheduler, self.scheduler.clock()
        waiting = scheduler.waiting
        queued = float(np.mean([now - self.since.get(s.rid, now) for s in waiting])) if waiting else 0.0
        memory = length / max(scheduler.allocator.capacity, 1) * len(waiting)
        return continuum_ttl(window, self.reload_per_token * length + queued, memory)

    def hold_for(self, sub_agent: bool, tool: str | None = None) -> float:
        """Before a finish's own TTL is known: the cold-start hold."""
        return self.hold

    def _lapsed(self, key: tuple[Hashable, Hashable], held: Awaited, now: float) -> bool:
        ttl = held.pin if held.pin is not None else self.hold
        return now - held.finished > ttl

    def order(self, waiting: Sequence[Any]) -> list[Any]:
        """Program-level FCFS: by the session's first arrival, then the request's; a request of a program
        neither running nor pinned is offered while the device holds it beside the running requests and the
        pinned contexts; the oldest request when nothing runs (no stall). Aged requests first, as ``session``."""
        now, scheduler = self.scheduler.clock(), self.scheduler
        committed, in_service = self.in_service(now)  # the running requests' and the pinned contexts' tokens
        self._forget(waiting, scheduler.running)
        aged = [c for c in waiting if now - self.since.get(c.request.rid, now) >= self.max_wait]
        if aged:
            return sorted(aged, key=lambda c: c.order)
        offered = []
        for c in sorted(waiting, key=lambda c: (self.started.get(program_of(c.request), now), c.order)):
            if program_of(c.request) in in_service:
                offered.append(c)  # its context is held: only its new tokens are asked for
            elif committed + len(c.tokens) <= scheduler.allocator.capacity:
                offered.append(c)
                committed += len(c.tokens)
        if not offered and waiting and not scheduler.running:
            offered.append(min(waiting, key=lambda c: c.order))
        return offered
