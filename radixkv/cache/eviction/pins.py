"""Paths held as their schedule policy decided at the finish that left them: the eviction side of the agent
anchors that decide per tool call (Continuum's TTL, ``continuum``; InferCept's preserve, discard or swap,
``infercept``).

The schedule policy (``radixkv.scheduling.continuum``, ``radixkv.scheduling.infercept``) writes its decision
on the sessions book's entry for the finish (``Awaited.pin``) before the cache is told of the path
(``Scheduler.finish``); ``Pins`` reads it when the path is inserted:

* ``pin > 0``: held that many seconds, then ranked with the rest;
* ``pin == 0``: not held: least recently used, with the rest;
* ``pin < 0``: first to go (and over a host tier the first demoted to it);
* no decision (a cache without such a schedule policy, a stream it does not follow): held ``hold`` seconds.

Everything else is as ``session`` (``SessionRetention``): a turn's end goes first, anything else least
recently used first, held paths only when nothing else is left, the earliest expiry first. O(log n) per push
and pop.
"""

from __future__ import annotations

from radixkv.cache.base import CacheHints
from radixkv.cache.eviction.session import COLD, SessionRetention
from radixkv.sessions import Finish, stream_key


class Pins(SessionRetention):
    """See the module doc. ``hold``: seconds a tool call's path is held where no decision was made (> 0)."""

    def __init__(self, hold: float = 10.0):
        super().__init__(hold=hold)

    def _state(self, hints: CacheHints) -> float:
        if hints.stop != Finish.TOOL_CALL:
            return super()._state(hints)
        key = stream_key(hints)
        entry = self.sessions.awaited.get(key) if key is not None else None
        pin = entry.pin if entry is not None and entry.pin is not None else self.hold_s
        return self.clock() + pin if pin > 0 else 0.0 if pin == 0 else COLD

    def describe(self) -> dict:
        return {"name": self.name, "hold": self.hold_s}
