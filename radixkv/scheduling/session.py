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
* **bounded wait**: a request that has waited ``max_wait`` seconds may take the room of held sessions (holds
  are soft), though never of running requests; and when nothing runs the oldest waiting request is always
  offered. So once the running requests ahead of it finish, a request waits at most ``max_wait`` seconds
  for holds, and the queue never stalls.

The scheduler admits the offered requests while memory lasts, evicting by the cache's own policy (under
LRU the contexts of sessions out of service go first: theirs were used longest ago; the ``session``
eviction policy ranks a turn's end first and holds a tool call's).

On the agentic trace (16 sessions, radix page 64, ``llama3-70b-8xh100``) with a 1M-token device over a 1M-token
host tier, it lifts the hit rate from 0.275 to 0.884 and cuts mean TTFT from 657 s to 7.9 s against FCFS
(with the ``session`` eviction policy; docs/agentic.md has the table and the commands).

It needs the session hints (``CacheHints.session``, ``stream``, ``stop``), which the simulator takes from an
agent trace and the engine from its callers; requests without a session are each a session of their own.
O(waiting + sessions in service) per ranking.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

TOOL_USE = "tool_use"


class _Held:
    """A session between a tool call's answer and its next request: the context it left and when."""

    __slots__ = ("footprint", "since", "stream")

    def __init__(self, footprint: int, since: float, stream: Hashable):
        self.footprint, self.since, self.stream = footprint, since, stream


class SessionAware:
    """See the module doc. ``max_wait``: seconds after which a waiting request goes first (> 0, default 300).
    ``hold``: seconds a session stays in service after a tool call before any pause was seen (default 10);
    ``hold_factor``: the learned hold is this times the mean tool pause of its stream kind (default 2)."""

    name, needs_match, sees_in_flight, follows_sessions = "session", False, False, True

    def __init__(self, max_wait: float = 300.0, hold: float = 10.0, hold_factor: float = 2.0):
        for key, value in (("max_wait", max_wait), ("hold", hold), ("hold_factor", hold_factor)):
            if not isinstance(value, int | float) or isinstance(value, bool) or not value > 0:
                raise ValueError(f"session policy: {key} must be a number > 0, got {value!r}")
        self.max_wait, self.hold, self.hold_factor = float(max_wait), float(hold), float(hold_factor)
        self.scheduler: Any = None
        self.held: dict[Hashable, _Held] = {}  # sessions in a tool pause
        self.since: dict[int, float] = {}  # rid -> when it joined the queue
        self.started: dict[Hashable, float] = {}  # session -> when its first request came (program order)
        self.pauses = {False: [0.0, 0], True: [0.0, 0]}  # sub-agent? -> [sum of tool pauses, how many]

    # ------------------------------------------------------------ what the scheduler tells it
    def attach(self, scheduler: Any) -> None:
        """Read the scheduler's clock, running requests and device capacity from now on."""
        self.scheduler = scheduler

    def added(self, state: Any) -> None:
        """A request joined the queue; the tool pause it ends is learned."""
        now = self.scheduler.clock()
        self.since[state.rid] = now
        self.started.setdefault(_key(state), now)
        held = self.held.get(_key(state))
        if held is not None and held.stream == state.hints.stream:
            total = self.pauses[bool(held.stream)]
            total[0] += now - held.since
            total[1] += 1

    def finished(self, state: Any, length: int) -> None:
        """A request finished leaving ``length`` tokens of context; its hints say how its answer ended."""
        self.since.pop(state.rid, None)
        if state.hints.stop == TOOL_USE:
            self.held[_key(state)] = _Held(length, self.scheduler.clock(), state.hints.stream)
        else:
            self.held.pop(_key(state), None)

    # ------------------------------------------------------------ the order
    def hold_for(self, sub_agent: bool) -> float:
        """Seconds a session stays in service after a tool call of this stream kind."""
        total, n = self.pauses[sub_agent]
        return self.hold if n == 0 else self.hold_factor * total / n

    def order(self, waiting: Sequence[Any]) -> list[Any]:
        """The waiting ``Candidate``s to offer, in order (those left out wait)."""
        now, scheduler = self.scheduler.clock(), self.scheduler
        for key in [k for k, h in self.held.items() if now - h.since > self.hold_for(bool(h.stream))]:
            del self.held[key]  # its pause outlasted the hold: out of service
        running = {}
        for s in scheduler.running:
            running[_key(s)] = running.get(_key(s), 0) + len(s.slots)
        busy = sum(running.values())  # what running requests hold: no admission can take it
        committed = busy + sum(h.footprint for k, h in self.held.items() if k not in running)
        capacity = scheduler.allocator.capacity
        first, rest = [], []
        for c in sorted(waiting, key=lambda c: c.order):
            (first if _key(c.request) in running or _key(c.request) in self.held else rest).append(c)
        for c in sorted(rest, key=lambda c: (self.started.get(_key(c.request), now), c.order)):
            need = len(c.tokens)
            aged = now - self.since.get(c.request.rid, now) >= self.max_wait
            if committed + need <= capacity or (aged and busy + need <= capacity):
                first.append(c)
                committed += need
                busy += need
        if not first and waiting and not scheduler.running:
            first.append(min(waiting, key=lambda c: c.order))  # nothing runs: the oldest goes, never a stall
        return first


def _key(state: Any) -> Hashable:
    session = state.hints.session
    return ("request", state.rid) if session is None else session
