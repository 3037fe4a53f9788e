"""``session``: admit by session, not by request (Continuum's program-level idea, made concrete for a prefix
cache at its capacity cliff).

An agent session sends a request, waits for the answer, pauses for a tool call (seconds) or a human (minutes),
and sends the next request, whose prompt is the previous prompt plus the answer plus a little. Below the
memory that holds every active session's context, first-come-first-served admission lets each new request
evict another session's context, which then misses when that session comes back, which makes its prefill
long, which keeps more sessions waiting at once: a cliff. This policy keeps the device for the sessions it
has started:

* a session is **in service** while one of its requests runs, and while one of its streams is held after a
  tool call (``Finish.TOOL_CALL``, known at the finish) for as long as tool pauses of its kind last (the
  scheduler's sessions book, ``radixkv.sessions``, learns them online per kind of stream, the main agent or
  a sub-agent, and per tool where known: ``hold_factor`` x their mean, ``hold`` seconds before any was seen);
  a stream held is keyed by (session, stream), so a sub-agent's finish neither replaces nor drops its main
  agent's hold; any other finish of a stream ends its hold;
* waiting requests of sessions in service come first, in arrival order: their contexts are resident;
* any other waiting request starts only when the device holds it beside what the sessions in service
  hold (the running requests' slots and each held stream's last sequence), sessions that came first
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
policy, on a 1M-token device it lifts the hit rate from 0.181 to 0.722 and cuts mean TTFT from 777 s to 42 s
against FCFS with LRU; over a 1M-token host tier, from 0.275 to 0.894 and from 657 s to 6.4 s
(docs/agentic.md has the tables and the commands).

It needs the session hints (``CacheHints.session``, ``stream``, ``stop``), which the simulator takes from an
agent trace and the engine from its callers; requests without a session are each a session of their own.
O(waiting + sessions in service) per ranking.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

from radixkv.cache.eviction.session import learned_hold
from radixkv.sessions import Awaited, Finish, Sessions, is_sub_agent


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
        self.sessions = Sessions()  # the scheduler's, once attached
        self.since: dict[int, float] = {}  # rid -> when it joined the queue
        self.started: dict[Hashable, float] = {}  # session -> when its first request came (program order)

    # ------------------------------------------------------------ what the scheduler tells it
    def attach(self, scheduler: Any) -> None:
        """Read the scheduler's clock, running requests, device capacity and sessions book from now on."""
        self.scheduler, self.sessions = scheduler, scheduler.sessions

    def added(self, state: Any) -> None:
        """A request joined the queue (the book learned the pause it ends)."""
        now = self.scheduler.clock()
        self.since[state.rid] = now
        if state.hints.session is not None:  # a request of no session is ordered by its own arrival
            self.started.setdefault(state.hints.session, now)

    def finished(self, state: Any, length: int) -> None:
        """A request finished leaving ``length`` tokens of context (the book knows how its answer ended)."""
        self.since.pop(state.rid, None)

    # ------------------------------------------------------------ the order
    def hold_for(self, sub_agent: bool, tool: str | None = None) -> float:
        """Seconds a stream stays in service after a tool call of this stream kind (and tool)."""
        return learned_hold(self.sessions, sub_agent, tool, self.hold, self.hold_factor)

    def held(self, now: float) -> dict[tuple[Hashable, Hashable], Awaited]:
        """The streams held now, by (session, stream): awaited after a tool call, within their hold."""
        return {k: a for k, a in self.sessions.after(Finish.TOOL_CALL).items() if not self._lapsed(k, a, now)}

    def in_service(self, now: float) -> tuple[int, set[Hashable]]:
        """The device tokens the sessions in service hold (the running requests' slots and the contexts of
        streams held through a tool call) and those sessions (a request of none is a session of its own)."""
        held = self.held(now)
        running: dict[Hashable, int] = {}
        for s in self.scheduler.running:
            running[_stream(s)] = running.get(_stream(s), 0) + len(s.slots)
        committed = sum(running.values()) + sum(a.length for k, a in held.items() if k not in running)
        return committed, {k[0] for k in running} | {k[0] for k in held}

    def order(self, waiting: Sequence[Any]) -> list[Any]:
        """The waiting ``Candidate``s to offer, in order (those left out wait)."""
        now, scheduler = self.scheduler.clock(), self.scheduler
        committed, in_service = self.in_service(now)
        capacity = scheduler.allocator.capacity
        self._forget(waiting, scheduler.running)
        aged = [c for c in waiting if now - self.since.get(c.request.rid, now) >= self.max_wait]
        if aged:  # they go first, alone, in arrival order: running requests finish, holds yield, so none starves
            return sorted(aged, key=lambda c: c.order)
        first, rest = [], []
        for c in sorted(waiting, key=lambda c: c.order):
            (first if program_of(c.request) in in_service else rest).append(c)
        started = lambda c: self.started.get(program_of(c.request), self.since.get(c.request.rid, now))  # noqa: E731
        for c in sorted(rest, key=lambda c: (started(c), c.order)):
            if committed + len(c.tokens) <= capacity:
                first.append(c)
                committed += len(c.tokens)
        if not first and waiting and not scheduler.running:
            first.append(min(waiting, key=lambda c: c.order))  # nothing runs: the oldest goes, never a stall
        return first

    def _lapsed(self, key: tuple[Hashable, Hashable], held: Awaited, now: float) -> bool:
        """Whether a held stream's pause outlasted its hold."""
        return now - held.finished > self.hold_for(is_sub_agent(held.hints.stream), held.hints.tool)

    def _forget(self, waiting: Sequence[Any], running: Sequence[Any]) -> None:
        """Drop what requests that left without finishing (aborted, withdrawn) and long-gone sessions left
        behind, so a server's books stay the size of its queue. O(books) when they have outgrown it."""
        live = [c.request for c in waiting] + list(running)
        if len(self.since) > len(live):
            rids = {s.rid for s in live}
            self.since = {rid: t for rid, t in self.since.items() if rid in rids}
        awaited = self.sessions.after(Finish.TOOL_CALL)
        if len(self.started) > 2 * (len(live) + len(awaited)) + 1024:
            keep = {program_of(s) for s in live} | {k[0] for k in awaited}
            self.started = {k: t for k, t in self.started.items() if k in keep}


def program_of(state: Any) -> Hashable:
    """A request's session (one of no session is a session of its own)."""
    session = state.hints.session
    return ("request", state.rid) if session is None else session


def _stream(state: Any) -> tuple[Hashable, Hashable]:
    """A request's (session, stream), as the book keys them."""
    return program_of(state), state.hints.stream


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
        self.until: dict[tuple[Hashable, Hashable], float] = {}  # held stream -> when its next request comes
        self._back: set[Hashable] = set()

    def foresee(self, requests: Sequence[Any]) -> None:
        """Learn every request's following pause. O(requests)."""
        self.pause = {r.parent: r.think_time for r in requests if r.parent is not None}

    def order(self, waiting: Sequence[Any]) -> list[Any]:
        if self.pause is None:
            raise ValueError("schedule policy 'session-oracle' needs the workload's future: only simulate runs it")
        self._back = {_stream(c.request) for c in waiting}  # streams whose next request came: held until it runs
        return super().order(waiting)

    def finished(self, state: Any, length: int) -> None:
        super().finished(state, length)
        key = _stream(state)
        if state.hints.stop == Finish.TOOL_CALL and state.rid in self.pause:
            self.until[key] = self.scheduler.clock() + self.pause[state.rid]
        else:  # no next request: out of service at once
            self.until.pop(key, None)

    def _lapsed(self, key: tuple[Hashable, Hashable], held: Awaited, now: float) -> bool:
        # past its pause with no request back: its next one waits for others (``after``), as any request
        return key not in self.until or (now > self.until[key] and key not in self._back)
