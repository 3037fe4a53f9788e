"""``session``: retention that knows the agent session (what a request leaves depends on how its answer ended).

An agent's answer ends in a tool call (``CacheHints.stop == Finish.TOOL_CALL``: the session comes back in
seconds, with a prompt that extends this one) or ends its turn (``END_TURN``: a human answers, minutes
later). Told how it ended with the insert a request makes when it finishes:

* after a **tool call** the path is **held** for the learned tool pause of its kind: ``hold_factor`` x the
  mean pause the sessions' book (``radixkv.sessions``, the scheduler's) has seen after a tool call from the
  same kind of stream (the main agent, a sub-agent) and the same tool where known, ``hold`` seconds before
  any was seen;
* after the **end of a turn** the path is **cold**: it goes first, so under a tiered cache it is the first
  demoted to the host tier, where it waits for the human;
* anything else (prefill chunks, a length, a stop sequence, an abort: none says a return is coming) is
  ranked least recently used.

Victims: copies a nearer tier holds (``demote``d: a lower tier keeps this policy's order and stays nearly
exclusive of the device, as under ``lru``) and cold entries first, then unheld ones, least recently used
first; held entries only when nothing else is left, earliest hold end first (holds are soft: a hold never
keeps an admission from memory). A match does not extend a hold. O(log n) per push and pop; a pop also moves
lapsed holds to the unheld heap (each once per hold); O(1) per touched entry.

A cache built alone (no scheduler) has a book of its own that nobody tells of returns: its holds stay
``hold`` seconds.

Args:
    hold: seconds a tool-call hold lasts before any pause was observed, > 0 (default 10).
    hold_factor: the learned hold as a multiple of the mean observed tool pause, > 0 (default 2).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from radixkv.cache.base import CacheHints
from radixkv.cache.eviction.base import Entry, LazyHeap, Live, check_param
from radixkv.cache.eviction.requests import TTL
from radixkv.sessions import Finish, Sessions, is_sub_agent

COLD = -1.0  # ``entry.state`` of a path a turn ended on; a hold stores its end (> 0), 0 is unheld


def learned_hold(sessions: Sessions, sub_agent: bool, tool: str | None, default: float, factor: float) -> float:
    """Seconds to hold a stream after a tool call: ``factor`` x the mean tool pause the book has seen of this
    kind (sub-agent?, the tool where its pauses were seen), ``default`` before any was seen."""
    mean = sessions.pauses.mean((sub_agent, Finish.TOOL_CALL, tool))
    return default if mean is None else factor * mean


class SessionRetention(TTL):
    """See the module doc."""

    name = "session"
    observes = True

    def __init__(self, hold: float = 10.0, hold_factor: float = 2.0):
        check_param("session", "hold", hold, 0.0)
        check_param("session", "hold_factor", hold_factor, 0.0)
        self.hold_s, self.hold_factor = float(hold), float(hold_factor)
        self.sessions = Sessions()  # the scheduler's, once ``build_stack`` hands it over
        super().__init__(hold)

    def reset(self) -> None:
        super().reset()
        self.cold = LazyHeap(self)

    def heaps(self) -> Sequence[LazyHeap]:
        return self.cold, self.unheld, self.held

    def hold_for(self, sub_agent: bool, tool: str | None = None) -> float:
        """The learned hold after a tool call of this stream kind (and tool), seconds."""
        return learned_hold(self.sessions, sub_agent, tool, self.hold_s, self.hold_factor)

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
            return
        state = self._state(hints)
        for entry in entries:
            entry.state = state if state != 0.0 or entry.state == COLD else entry.state

    def _state(self, hints: CacheHints) -> float:
        """The state a path gets from the request that left it: a hold's end, cold, or 0 (unheld)."""
        if hints.stop == Finish.TOOL_CALL:
            return self.clock() + self.hold_for(is_sub_agent(hints.stream), hints.tool)
        # a turn's end waits for a human, if anyone; a length, a stop sequence or an abort says nothing of a return
        return COLD if hints.stop == Finish.END_TURN else 0.0

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "hold": self.hold_s, "hold_factor": self.hold_factor,
                "learned_hold_main": self.hold_for(False), "learned_hold_sub": self.hold_for(True)}
