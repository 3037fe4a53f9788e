"""``session``: admit by session, not by request (Continuum's program-level idea, made concrete for a prefix
cache at its capacity cliff).

An agent session sends a request, waits for the answer, pauses for a tool call (seconds) or a human (minutes),
and sends the next request, whose prompt is the previous prompt plus the answer plus a little. Below the
memory that holds every active session's context, first-come-first-served admission lets each new request
evict another session's context, which then misses when that session comes back, which makes its prefill
long, which keeps more sessions waiting at once: a cliff. This policy keeps the device for the sessions it
has started:

* a session is **in service** while one of its requests runs, and after one finishes with a tool call
  (``CacheHints.stop == "tool_use"``, known at the finish) for as long as its stream's tool pauses last
  (learned online per stream kind, the main agent or a sub-agent: ``hold_factor`` x the mean pause seen so
  far, ``hold`` seconds before any was seen); a finish that ends the turn takes it out of service;
* waiting requests of sessions in service come first, in arrival order: their contexts are resident;
* any other waiting request starts only when the device holds it beside what the sessions in service
  hold (the running requests' slots and each held session's last sequence), sessions that came first
  first (program order, as Continuum's FCFS over programs);
* **bounded wait**: once any request has waited ``max_wait`` seconds, the requests that have are the only
  ones offered, oldest first, until they are admitted: no session in service goes ahead of them, and they
  take the room of held sessions (holds are soft), though never of running requests. So a request waits at
  most ``max_wait`` seconds plus the time the requests running then take to finish (and the aged ones ahead
  of it); when nothing runs the oldest waiting request is always offered, so the queue never stalls.

The scheduler admits the offered requests while memory lasts, evicting by the cache's own policy (under
LRU the contexts of sessions out of service go first: theirs were used longest ago; the ``session``
eviction policy ranks a turn's end first and holds a tool call's).

On the agentic trace (16 sessions, radix page 64, ``llama3-70b-8xh100``) with the ``session`` eviction
policy, on a 1M-token device it lifts the hit rate from 0.181 to 0.712 and cuts mean TTFT from 777 s to 38 s
against FCFS with LRU; over a 1M-token host tier, from 0.275 to 0.887 and from 657 s to 7.5 s
(docs/agentic.md has the tables and the commands).

It needs the session hints (``CacheHints.session``, ``stream``, ``stop``), which the simulator takes from an
agent trace and the engine from its callers; requests without a session are each a session of their own.
O(waiting + sessions in service) per ranking.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

from radixkv.cache.eviction.session import TOOL_USE, ToolPauses


class _Held:
    """A session between a tool call's answer and its next request: the context it left and when."""

    __slots__ = ("footprint", "since", "stream")

    def __init__(self, footprint: int, since: float, stream: Hashable):
        self.footprint, self.since, self.stream = footprint, since, stream


class SessionAware:
    """See the module doc. ``max_wait``: seconds after which a waiting request goes first (> 0, default 3,600).
    ``hold``: seconds a session stays in service after a tool call before any pause was seen (default 10);
    ``hold_factor``: the learned hold is this times the mean tool pause of its stream kind (default 2)."""

    name, needs_match, sees_in_flight, follows_sessions = "session", False, False, True

    def __init__(self, max_wait: float = 3600.0, hold: float = 10.0, hold_factor: float = 2.0):
        for key, value in (("max_wait", max_wait), ("hold", hold), ("hold_factor", hold_factor)):
            if not isinstance(value, int | float) or isinstance(value, bool) or not value > 0:
                raise ValueError(f"session policy: {key} must be a number > 0, got {value!r}")
        self.max_wait, self.hold, self.hold_factor = float(max_wait), float(hold), float(hold_factor)
        self.scheduler: Any = None
        self.held: dict[Hashable, _Held] = {}  # sessions in a tool pause
        self.since: dict[int, float] = {}  # rid -> when it joined the queue
        self.started: dict[Hashable, float] = {}  # session -> when its first request came (program order)
        self.pauses = ToolPauses(self.hold, self.hold_factor)

    # ------------------------------------------------------------ what the scheduler tells it
    def attach(self, scheduler: Any) -> None:
        """Read the scheduler's clock, running requests and device capacity from now on."""
        self.scheduler = scheduler

    def added(self, state: Any) -> None:
        """A request joined the queue; the tool pause it ends is learned."""
        now = self.scheduler.clock()
        self.since[state.rid] = now
        if state.hints.session is not None:  # a request of no session is ordered by its own arrival
            self.started.setdefault(state.hints.session, now)
        held = self.held.get(_key(state))
        if held is not None and held.stream == state.hints.stream:
            self.pauses.observe(bool(held.stream), now - held.since)

    def finished(self, state: Any, length: int) -> None:
        """A request finished leaving ``length`` tokens of context; its hints say how its answer ended."""
        self.since.pop(state.rid, None)
        if self._holds(state):
            self.held[_key(state)] = _Held(length, self.scheduler.clock(), state.hints.stream)
        else:
            self.held.pop(_key(state), None)

    def _holds(self, state: Any) -> bool:
        """Whether a finished request's session stays in service: its answer ended in a tool call."""
        return state.hints.stop == TOOL_USE

    # ------------------------------------------------------------ the order
    def hold_for(self, sub_agent: bool) -> float:
        """Seconds a session stays in service after a tool call of this stream kind."""
        return self.pauses.hold(sub_agent)

    def order(self, waiting: Sequence[Any]) -> list[Any]:
        """The waiting ``Candidate``s to offer, in order (those left out wait)."""
        now, scheduler = self.scheduler.clock(), self.scheduler
        for key in [k for k, h in self.held.items() if self._lapsed(k, h, now)]:
            del self.held[key]  # its pause outlasted the hold: out of service
        running = {}
        for s in scheduler.running:
            running[_key(s)] = running.get(_key(s), 0) + len(s.slots)
        # what running requests hold, and the contexts of sessions held through a tool call
        committed = sum(running.values()) + sum(h.footprint for k, h in self.held.items() if k not in running)
        capacity = scheduler.allocator.capacity
        self._forget(waiting, scheduler.running)
        aged = [c for c in waiting if now - self.since.get(c.request.rid, now) >= self.max_wait]
        if aged:  # they go first, alone, in arrival order: running requests finish, holds yield, so none starves
            return sorted(aged, key=lambda c: c.order)
        first, rest = [], []
        for c in sorted(waiting, key=lambda c: c.order):
            (first if _key(c.request) in running or _key(c.request) in self.held else rest).append(c)
        for c in sorted(rest, key=lambda c: (self.started.get(_key(c.request), self.since.get(c.request.rid, now)),
                                              c.order)):
            if committed + len(c.tokens) <= capacity:
                first.append(c)
                committed += len(c.tokens)
        if not first and waiting and not scheduler.running:
            first.append(min(waiting, key=lambda c: c.order))  # nothing runs: the oldest goes, never a stall
        return first

    def _lapsed(self, key: Hashable, held: _Held, now: float) -> bool:
        """Whether a held session's pause outlasted its hold."""
        return now - held.since > self.hold_for(bool(held.stream))

    def _forget(self, waiting: Sequence[Any], running: Sequence[Any]) -> None:
        """Drop what requests that left without finishing (aborted, withdrawn) and long-gone sessions left
        behind, so a server's books stay the size of its queue. O(books) when they have outgrown it."""
        live = [c.request for c in waiting] + list(running)
        if len(self.since) > len(live):
            rids = {s.rid for s in live}
            self.since = {rid: t for rid, t in self.since.items() if rid in rids}
        if len(self.started) > 2 * (len(live) + len(self.held)) + 1024:
            keep = {_key(s) for s in live} | set(self.held)
            self.started = {k: t for k, t in self.started.items() if k in keep}


def _key(state: Any) -> Hashable:
    session = state.hints.session
    return ("request", state.rid) if session is None else session


class SessionOracle(SessionAware):
    """``session-oracle``: the ``session`` policy handed the workload's future (simulator only), a reference
    for what admitting by session could reach with no guess in it: after a tool call a session stays in
    service for exactly the real pause before its next request (``session`` guesses ``hold_factor`` x the
    mean pause) and then until that request runs; it leaves at once when the session has no next request.
    Everything else as ``session``'s. ``foresee`` hands it the requests (``simulate`` does, before the first
    arrival)."""

    name, needs_future = "session-oracle", True

    def __init__(self, max_wait: float = 3600.0):
        super().__init__(max_wait=max_wait)
        self.pause: dict[int, float] | None = None  # rid -> seconds before its session's next request is sent
        self.until: dict[Hashable, float] = {}  # held session -> when its next request comes
        self._back: set[Hashable] = set()

    def foresee(self, requests: Sequence[Any]) -> None:
        """Learn every request's following pause. O(requests)."""
        self.pause = {r.parent: r.think_time for r in requests if r.parent is not None}

    def order(self, waiting: Sequence[Any]) -> list[Any]:
        if self.pause is None:
            raise ValueError("schedule policy 'session-oracle' needs the workload's future: only simulate runs it")
        self._back = {_key(c.request) for c in waiting}  # sessions whose next request came: held until it runs
        return super().order(waiting)

    def finished(self, state: Any, length: int) -> None:
        super().finished(state, length)
        if _key(state) in self.held:
            self.until[_key(state)] = self.scheduler.clock() + self.pause[state.rid]

    def _holds(self, state: Any) -> bool:
        return super()._holds(state) and state.rid in self.pause

    def _lapsed(self, key: Hashable, held: _Held, now: float) -> bool:
        # past its pause with no request back: its next one waits for others (``after``), as any request
        return now > self.until[key] and key not in self._back
