"""``session``: retention that knows the agent session (what a request leaves depends on how its answer ended).

An agent's answer ends in a tool call (``CacheHints.stop == "tool_use"``: the session comes back in seconds,
with a prompt that extends this one) or ends its turn (``end_turn``: a human answers, minutes later). Told
the stop reason with the insert a request makes when it finishes:

* after a **tool call** the path is **held** for the stream kind's learned tool pause: ``hold_factor`` x the
  mean of the pauses this cache observed (a finish with a tool call, then the same session's next match),
  kept apart for main agents (stream 0) and sub-agents, ``hold`` seconds before any was seen;
* after the **end of a turn** (``end_turn``) the path is **cold**: it goes first, so under a tiered cache it
  is the first demoted to the host tier, where it waits for the human;
* anything else (prefill chunks, a stop not recorded, the engine's ``stop`` / ``length``, which say nothing
  of what comes next) is ranked least recently used.

Victims: copies a nearer tier holds (``demote``d: a lower tier keeps this policy's order and stays nearly
exclusive of the device, as under ``lru``) and cold entries first, then unheld ones, least recently used
first; held entries only when nothing else is left, earliest hold end first (holds are soft: a hold never
keeps an admission from memory). A match does not extend a hold. O(log n) per push and pop; a pop also moves
lapsed holds to the unheld heap (each once per hold); O(1) per touched entry.

Args:
    hold: seconds a tool-call hold lasts before any pause was observed, > 0 (default 10).
    hold_factor: the learned hold as a multiple of the mean observed tool pause, > 0 (default 2).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any

from radixkv.cache.base import CacheHints
from radixkv.cache.eviction.base import Entry, LazyHeap, Live, check_param
from radixkv.cache.eviction.requests import TTL

TOOL_USE, END_TURN = "tool_use", "end_turn"
PENDING_MAX = 4096  # tool calls awaiting their session's return, at most
COLD = -1.0  # ``entry.state`` of a path a turn ended on; a hold stores its end (> 0), 0 is unheld


def bound_pending(pending: dict, since: Callable[[Any], float]) -> None:
    """Keep a book of sessions awaited after a finish under ``PENDING_MAX``: once full, the older half (by
    ``since(value)``, when each finished) goes: those that never came back. O(n log n) once per n/2 adds."""
    if len(pending) >= PENDING_MAX:
        for key in sorted(pending, key=lambda k: since(pending[k]))[: PENDING_MAX // 2]:
            del pending[key]


class ToolPauses:
    """The tool-call pauses observed per stream kind (the main agent, sub-agents) and the hold they imply:
    ``factor`` x their mean, ``default`` seconds before any was seen. O(1) per call."""

    def __init__(self, default: float, factor: float):
        self.default, self.factor = default, factor
        self.totals = {False: [0.0, 0], True: [0.0, 0]}  # sub-agent? -> [sum of pauses, how many]

    def observe(self, sub_agent: bool, seconds: float) -> None:
        total = self.totals[sub_agent]
        total[0] += seconds
        total[1] += 1

    def hold(self, sub_agent: bool) -> float:
        total, n = self.totals[sub_agent]
        return self.default if n == 0 else self.factor * total / n


class SessionRetention(TTL):
    """See the module doc."""

    name = "session"
    observes = True

    def __init__(self, hold: float = 10.0, hold_factor: float = 2.0):
        check_param("session", "hold", hold, 0.0)
        check_param("session", "hold_factor", hold_factor, 0.0)
        self.hold_s, self.hold_factor = float(hold), float(hold_factor)
        super().__init__(hold)

    def reset(self) -> None:
        super().reset()
        self.cold = LazyHeap(self)
        self.pending: dict[Hashable, tuple[float, bool]] = {}  # session -> (tool call's finish, sub-agent?)
        self.pauses = ToolPauses(self.hold_s, self.hold_factor)

    def heaps(self) -> Sequence[LazyHeap]:
        return self.cold, self.unheld, self.held

    def hold_for(self, sub_agent: bool) -> float:
        """The learned hold after a tool call of this stream kind, seconds."""
        return self.pauses.hold(sub_agent)

    def push(self, entry: Entry) -> None:
        if entry.state == COLD or entry.last_access < 0:  # demoted (below zero): a tier's spare copy goes first
            self.cold.push(entry, entry.last_access)
        else:
            super().push(entry)

    def pop(self, live: Live) -> Entry | None:
        entry = self.cold.pop(live)
        return entry[1] if entry is not None else super().pop(live)

    def inserted(self, entry: Entry, hints: CacheHints) -> None:
        entry.state = self._state(hints)

    def touched(self, entries: Sequence[Entry], hints: CacheHints, hit: bool) -> None:
        if hit:
            started = self.pending.pop(hints.session, None) if hints.session is not None else None
            if started is not None:  # the session is back from its tool call: learn how long that took
                self.pauses.observe(started[1], self.clock() - started[0])
            return
        state = self._state(hints)
        for entry in entries:
            entry.state = state if state != 0.0 or entry.state == COLD else entry.state

    def _state(self, hints: CacheHints) -> float:
        """The state a path gets from the request that left it: a hold's end, cold, or 0 (unheld)."""
        if hints.stop == TOOL_USE:
            sub = bool(hints.stream)
            if hints.session is not None:
                bound_pending(self.pending, lambda started: started[0])
                self.pending[hints.session] = (self.clock(), sub)
            return self.clock() + self.hold_for(sub)
        if hints.stop:  # the answer ended otherwise: no tool call to wait for
            self.pending.pop(hints.session, None)
        # a turn's end waits for a human, if anyone; an engine's "stop" / "length" says nothing of what follows
        return COLD if hints.stop == END_TURN else 0.0

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "hold": self.hold_s, "hold_factor": self.hold_factor,
                "learned_hold_main": self.hold_for(False), "learned_hold_sub": self.hold_for(True)}
